"""DP-FedAvg (McMahan et al. 2018, "Learning differentially private recurrent language models"):
client-level differential privacy for FedAvg, with adaptive clipping (Andrew et al. 2021) and
pfl-research's noise cohort as options; DP-FedMom is the same mechanism followed by FedMom's step.

  d_k = w_k - w,   s_k = min(1, C / ||d_k||)              each client's update clipped to L2 norm C
  w  <- w + eta (sum_k s_k d_k + N(0, (z C)^2 I)) / K     noise on the sum, fixed denominator

K is ``num_sampled``: with fixed-size sampling (run.sampling = fixed) the configured number of
clients a round samples, with Poisson sampling the expected cohort q N (McMahan et al.'s
fixed-denominator estimator, their qW), never the number of reports, so one client moves the
model by at most C / K. Weights are uniform (the bound needs equal weights). Computed as
sum_k (s_k / K) w_k + (1 - sum_k s_k / K) w, so with every client reporting, none clipped and
z = 0, the weights and the fused weighted mean are FedAvg's (uniform) bit for bit. eta =
hp.server_lr is the server's step along the noised mean update, as for FedAvg (1, the paper's
rule, leaves the bits as they are); it acts after the noise, so it costs no privacy. Under
Poisson sampling the mechanism runs every round, also one without reports (the noise alone
moves the model), since "the model did not change" would reveal an empty cohort, an outcome the
accountant's Poisson-subsampled Gaussian never releases.

Adaptive clipping (``dp_adaptive_quantile`` gamma > 0; Andrew et al. 2021, "Differentially Private
Learning with Adaptive Clipping", Alg. 1): C is server state (checkpointed; ``dp_clip`` is its
start). Each round also releases the count of unclipped updates, centred as sum_k (b_k - 1/2)
with b_k = [||d_k|| <= C], with Gaussian noise of std sigma_b (``dp_adaptive_count_noise``; 0:
their m / 20), and moves C <- C exp(-eta_C (clamp(b~, 0, 1) - gamma)), b~ = that noised sum / K
+ 1/2 and eta_C = ``dp_adaptive_lr``: b~ clamped to [0, 1] as TF Privacy's QuantileEstimatorQuery
does (the noise, or under Poisson sampling more reports than K, can put it outside), so one step
moves C by a factor in [exp(-eta_C (1 - gamma)), exp(eta_C gamma)]. The two releases together are
one Gaussian mechanism of multiplier z when the update's multiplier is z_Delta = (z^-2 - (2
sigma_b)^-2)^(-1/2) (their Thm. 1: the count's sensitivity is 1/2 under add/remove; under
replace-one both sensitivities double, 2C and 1, and the pair is still the multiplier z / 2 the
fixed-size accountant is given), so epsilon is accounted at z as without it.

Noise cohort (``dp_noise_cohort`` m > 0; pfl-research's ``noise_cohort_size``): the noise is
calibrated as if m clients trained each round while K train: every noise std is scaled by K / m
(pfl's ``noise_scale = cohort_size / noise_cohort_size``, which multiplies the accountant's noise
parameter: pfl/privacy/privacy_accountant.py, ``cohort_noise_parameter``, and
benchmarks/utils/argument_parsing.py, ``parse_mechanism``, in apple/pfl-research), so the noised
mean has the noise std z C / m of a deployment with m clients a round; and epsilon is that
deployment's: sampling m of the N clients (Poisson: q = m / N, pfl's ``max(cohort_size,
noise_cohort_size) / population``). It is not the privacy of the simulation itself, which adds
less noise; it holds only for a run with m clients a round.

Privacy (``epsilon`` at ``hp.params["dp_delta"]``, from Google's dp-accounting, ``pip install
fedddp[dp]``), one step per aggregation:
  - Poisson sampling (run.sampling = poisson, the default for this rule): add/remove-one
    neighbours, sensitivity C, so PoissonSampledDpEvent(q, GaussianDpEvent(z)); the
    ``dp_accountant`` pld (default: dp-accounting's PLD accountant, a tight numerical bound) or
    rdp (its RDP accountant, an upper bound, larger).
  - Fixed-size sampling: exactly K of the N clients, uniformly without replacement
    (fedddp.sampling), so every aggregation is SampledWithoutReplacementDpEvent(N, K, ...),
    whose RDP is the bound of Wang, Balle and Kasiviswanathan (AISTATS 2019, Thm. 27), under
    replace-one neighbours (dp-accounting's only relation for it; N is public: it fixes the
    sampling). Replacing one client changes its clipped update from u to u' (both of norm
    <= C), so the noised sum moves by ||u - u'|| <= 2C, not C: dp-accounting's RDP routine for
    this event takes the Gaussian's multiplier as the noise std over that l2-sensitivity (at
    K = N it returns alpha / (2 m^2), the Gaussian mechanism's RDP for std m times the
    sensitivity), so the multiplier passed is z C / (2 C) = z / 2. Passing z would understate
    epsilon: 29.0 instead of 113.1 for the quickstart's N = 30, K = 10, z = 1, 40 rounds at
    delta = 1e-5. dp-accounting's PLD accountant has no event for this sampling: pld with
    fixed-size sampling is refused (algorithms._check_dp).
  - Steps: with fixed-size sampling one per round that aggregated (a round whose sampled
    clients all dropped out releases nothing, and dropouts, independent of the data, are not
    credited); with Poisson sampling one per round. The division by K and the server step (and
    DP-FedMom's momentum) are post-processing.
  - The noise and the sample are drawn from run.seed: the guarantee holds for someone who does
    not know it.
How epsilon is computed (one step's PLD or RDP curve, composed; PLD's grid): strategies/accounting.py.

Blocks (run.aggregation = sharded, and the gathered form alike): the clip norms ||d_k|| are float64
sums of squares per block of run.aggregation_block columns, added over the blocks in block order
(``update_norms_K``, Span.total), then the square root, so they, the clip factors, the count of
unclipped updates and the next clip are the same bits on every rank and world size; with one
block (P <= the block) they are the norms of the whole d_k as before. The noise vector is drawn
whole on every rank and each rank takes its columns. The range form (``aggregate_span``) then
walks its blocks with the gathered form's per-column ops, so sharded equals gathered bit for bit;
dp_steps and dp_clip are scalars on every rank, DP-FedMom's previous_P a ranged entry (FedMom's).

Composes with any local rule whose server rule this can replace (algorithm.local = plain,
prox, sam, gam, moon); every other server rule is refused: they reweight, mask, normalise or
carry state across clients' raw updates, which voids the C / K bound.
Legend: K sampled clients (or their expected number), P flat elements, N all clients.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from ..sampling import _mix
from ..params import at_least_zero, in_unit, one_of, positive
from ..registry import resolve, weighting_of
from .accounting import ACCOUNTANTS, spent
from .base import Span, Strategy, block_width, register, server_step, weighted_mean_P

_NOISE_STREAM = 0xD9_0153
_COUNT_STREAM = 0xD9_C047


def clip_factors_K(updates_KP: torch.Tensor, clip: float) -> torch.Tensor:
    """s_k = min(1, C / ||d_k||) (float32; exactly 1.0 for a client within the bound)."""
    return _factors_K(torch.linalg.vector_norm(updates_KP, dim=1, dtype=torch.float64), clip, updates_KP.dtype)


def _factors_K(norms_K: torch.Tensor, clip: float, dtype) -> torch.Tensor:
    return (clip / norms_K).clamp(max=1.0).to(dtype)


def calibration(params: dict, num_sampled: float) -> tuple[float, float, float]:
    """(m, z_Delta, sigma_b): the cohort the noise is calibrated for (dp_noise_cohort, else K),
    the update's noise multiplier and the count's noise std in that cohort. Without adaptive
    clipping (or without noise) z_Delta = z and sigma_b = 0; with it sigma_b is
    dp_adaptive_count_noise (0: Andrew et al.'s m / 20) and z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2),
    which needs sigma_b > z / 2 (checked with the config)."""
    z = params["dp_noise"]
    cohort = params["dp_noise_cohort"] or num_sampled
    if params["dp_adaptive_quantile"] <= 0 or z <= 0:
        return cohort, z, 0.0
    sigma_b = params["dp_adaptive_count_noise"] or cohort / 20
    if not 2 * sigma_b > z:
        raise ValueError(f"dp_adaptive_count_noise: sigma_b = {sigma_b:g} must exceed dp_noise / 2 = {z / 2:g}")
    return cohort, (z ** -2 - (2 * sigma_b) ** -2) ** -0.5, sigma_b


def start_words(params: dict, expected_cohort: float, numel: int) -> str:
    """The noise against the clip, said before round 1: the noised mean update carries noise of
    std z_Delta C / m a coordinate, so of norm about z_Delta C sqrt(P) / m, while the clipped
    mean update is at most C long. Where the noise's norm exceeds C, no round's update can show
    through it (the model walks at random: chance accuracy), whatever the rounds."""
    try:
        cohort, z_update, _ = calibration(params, expected_cohort)
    except ValueError:  # refused with the config
        return ""
    if z_update <= 0:
        return ""
    std = z_update * params["dp_clip"] / cohort
    times = z_update * numel ** 0.5 / cohort
    words = (f"DP noise std {std:.3g} a coordinate, its norm {times:.3g}x the clip C that bounds the "
             f"mean update ({numel} parameters, cohort {cohort:g})")
    if times > 1:
        words += ("; the noise outweighs any round's update: more clients a round (or "
                  "algorithm.params.dp_noise_cohort), a smaller dp_noise, or a smaller model")
    return words


def init_state(global_P, hp):
    return {"dp_steps": torch.zeros((), dtype=torch.float64),
            "dp_clip": torch.tensor(float(hp.params["dp_clip"]), dtype=torch.float64)}


class _Release(NamedTuple):
    """What one aggregation computes over the whole vector, the same bits on every rank: the
    clipped clients' weights s_k / K, w's own weight 1 - sum_k s_k / K, the whole noise vector
    [P] (None without noise) and its factor z_Delta C / m, the new state's scalars and the
    diagnostics."""
    weights_K: torch.Tensor
    stay: torch.Tensor
    noise_P: torch.Tensor | None
    noise_scale: torch.Tensor | None
    state: dict
    diagnostics: dict

    def columns(self, global_P, params_KP, cols: slice) -> torch.Tensor:
        """The noised mean over the columns ``cols`` of the whole vector (global_P and params_KP
        cut to them): per column the same ops as over the whole vector."""
        sum_P = weighted_mean_P(self.weights_K, params_KP) if params_KP.shape[0] else torch.zeros_like(global_P)
        new_P = sum_P + self.stay * global_P
        if self.noise_P is not None:
            new_P = new_P + self.noise_P[cols] * self.noise_scale
        return new_P


def update_norms_K(params_KP: torch.Tensor, global_P: torch.Tensor, span: Span) -> torch.Tensor:
    """||w_k - w|| over the whole vector, float64: per block the norm of the block's d_k, whose
    squares are added over every block in block order (Span.total), then the square root. One
    block gives the norm of the whole d_k itself (sqrt(x * x) is x in binary floating point)."""
    rows = [torch.linalg.vector_norm(params_KP[:, b] - global_P[b], dim=1, dtype=torch.float64).square()
            for b in span.blocks]
    return span.total(rows, params_KP.shape[0]).sqrt()


def _noise_P(numel: int, like: torch.Tensor, seed: int, steps) -> torch.Tensor:
    """The server's noise N(0, 1) for the whole vector [P], from (run.seed, aggregation count):
    the range form draws it whole on every rank too and takes its columns, so its bits do not
    depend on the ranks."""
    gen = torch.Generator(device=like.device).manual_seed(_mix(_NOISE_STREAM, seed, int(steps)))
    return torch.randn((numel,), generator=gen, device=like.device, dtype=like.dtype)


def _next_clip(norms_K, clip: float, stacks, hp, sigma_count: float, cohort: float, steps) -> tuple[float, dict]:
    """Adaptive clipping's next clip from the noised count of unclipped updates (a global scalar:
    the norms are the whole vector's on every rank, the count's noise a CPU draw from the seed),
    and its diagnostic; the clip as it is without adaptive clipping."""
    if hp.params["dp_adaptive_quantile"] <= 0:
        return clip, {}
    centred = float((norms_K <= clip).sum()) - norms_K.shape[0] / 2  # sum_k (b_k - 1/2)
    if sigma_count > 0:  # std sigma_b K / m: the deployment's sigma_b / m on the fraction
        gen = torch.Generator().manual_seed(_mix(_COUNT_STREAM, int(stacks["noise_seed"]), int(steps)))
        centred += float(torch.randn((), generator=gen, dtype=torch.float64)) * sigma_count * float(
            stacks["num_sampled"]) / cohort
    below = centred / float(stacks["num_sampled"]) + 0.5  # b~, the noised fraction within C
    # the step takes b~ clamped to [0, 1], as TF Privacy's QuantileEstimatorQuery ("protect against
    # out-of-range estimates"): the noise, and under Poisson sampling more reports than the expected
    # cohort K, can put b~ outside it, so one step moves C by at most exp(eta_C gamma) up and
    # exp(-eta_C (1 - gamma)) down. Post-processing of the release; the diagnostic is b~ as released.
    fraction = min(1.0, max(0.0, below))
    next_clip = clip * math.exp(-hp.params["dp_adaptive_lr"] * (fraction - hp.params["dp_adaptive_quantile"]))
    return next_clip, {"unclipped_fraction_noised": torch.tensor(below, dtype=torch.float64)}


def release(global_P, stacks, state, hp, span: Span) -> _Release:
    """The mechanism's whole-vector part: per-client clip factors from the update norms (float64
    per-block sums in block order over every rank's blocks), the shares over K, the noise and
    (adaptive clipping) the next round's clip from the noised count of unclipped updates."""
    params_KP = stacks["params_KP"]
    num_sampled = stacks["num_sampled"].to(params_KP.dtype)  # K, or the expected cohort q N
    clip = float(state["dp_clip"]) if "dp_clip" in state else hp.params["dp_clip"]
    norms_K = update_norms_K(params_KP, global_P, span)
    scale_K = _factors_K(norms_K, clip, params_KP.dtype)
    share_K = torch.ones_like(scale_K) / num_sampled  # FedAvg's uniform weights when all report
    # w's own weight 1 - sum_k s_k / K, as sums that are exactly 0 when every sampled client
    # reported within the bound (so the neutral setting keeps FedAvg's bits); 1 without reports
    stay = (share_K * (1 - scale_K)).sum() + (num_sampled - scale_K.shape[0]) / num_sampled
    steps = state["dp_steps"] + 1
    cohort, z_update, sigma_count = calibration(hp.params, float(stacks["num_sampled"]))
    noise_P = noise_scale = None
    if z_update > 0:
        noise_P = _noise_P(span.numel, global_P, int(stacks["noise_seed"]), steps)
        # std z C / m on the mean: m = K (the noise on the sum z C) or the noise cohort (z C K / m)
        over = num_sampled if not hp.params["dp_noise_cohort"] else num_sampled.new_tensor(float(cohort))
        noise_scale = z_update * clip / over
    next_clip, count_diagnostics = _next_clip(norms_K, clip, stacks, hp, sigma_count, cohort, steps)
    diagnostics = {"clipped_fraction": (scale_K < 1).float().mean()} | count_diagnostics
    new_state = {"dp_steps": steps, "dp_clip": torch.tensor(next_clip, dtype=torch.float64)}
    return _Release(share_K * scale_K, stay, noise_P, noise_scale, new_state, diagnostics)


def private_mean(global_P, stacks, state, hp):
    """The mechanism over the whole vector: (the noised mean as a model, its state, diagnostics).
    The clip norms are summed per block in block order (the static aggregation_block; one block
    without it), as the range form sums them."""
    numel = global_P.shape[0]
    rel = release(global_P, stacks, state, hp, Span.whole(numel, block_width(stacks, numel), global_P.device))
    return rel.columns(global_P, stacks["params_KP"], slice(0, numel)), rel.state, rel.diagnostics


def private_span(global_P, stacks, state, hp, span, momentum: float | None = None):
    """The range form: the whole-vector part over every rank's blocks, then block by block over
    this rank's range, the noise's columns taken from the whole vector, the server step and (DP-
    FedMom: ``momentum``) m (w - w_prev) on each block. (new range, new state, diagnostics)."""
    rel = release(global_P, stacks, state, hp, span)
    params_KP, new_P = stacks["params_KP"], torch.empty_like(global_P)
    for b in span.blocks:
        cols = slice(span.start + b.start, span.start + b.stop)
        new_B = server_step(global_P[b], rel.columns(global_P[b], params_KP[:, b], cols), hp.server_lr)
        if momentum is not None:
            new_B = new_B.add_(torch.sub(global_P[b], state["previous_P"][b]), alpha=momentum)
        new_P[b] = new_B
    return new_P, rel.state, rel.diagnostics


def aggregate(global_P, stacks, state, hp):
    new_global_P, new_state, diagnostics = private_mean(global_P, stacks, state, hp)
    return server_step(global_P, new_global_P, hp.server_lr), new_state, diagnostics


def aggregate_span(global_P, stacks, state, hp, span):
    """DP-FedAvg on this rank's range (Strategy.aggregate_span): the gathered bits on any number
    of ranks."""
    return private_span(global_P, stacks, state, hp, span)


def init_state_momentum(global_P, hp):
    return init_state(global_P, hp) | {"previous_P": global_P.clone()}


def aggregate_momentum(global_P, stacks, state, hp):
    """DP-FedMom: FedMom's step (strategies/fedmom.py, its torch-op form) along the noised mean,
    w_new = lerp(w, mean~, eta) + m (w - w_prev): post-processing of the released mean, so it is
    accounted exactly as DP-FedAvg."""
    target_P, new_state, diagnostics = private_mean(global_P, stacks, state, hp)
    new_global_P = server_step(global_P, target_P, hp.server_lr).add_(
        torch.sub(global_P, state["previous_P"]), alpha=float(hp.params["server_momentum"]))
    diagnostics["velocity_norm"] = torch.linalg.vector_norm(new_global_P - global_P)
    return new_global_P, new_state | {"previous_P": global_P}, diagnostics


def aggregate_momentum_span(global_P, stacks, state, hp, span):
    """DP-FedMom on this rank's range: previous_P is the range's (ranged state, as FedMom's);
    velocity_norm from float64 per-block sums of squares added in block order."""
    new_P, new_state, diagnostics = private_span(global_P, stacks, state, hp, span,
                                                 float(hp.params["server_momentum"]))
    sq_rows = [torch.sub(new_P[b], global_P[b]).double().square().sum() for b in span.blocks]
    diagnostics["velocity_norm"] = span.total(sq_rows, 1)[0].sqrt().to(global_P.dtype)
    return new_P, new_state | {"previous_P": global_P.clone()}, diagnostics


def ledger(state, static, hp):
    """The clip the next round uses (moving with adaptive clipping), written every round."""
    clip = state["dp_clip"] if "dp_clip" in state else torch.tensor(hp.params["dp_clip"], dtype=torch.float64)
    return {"dp_clip": clip}


# dp_clip's default 0 is no bound at all: a DP run names its clip (DP-FedAvg's C has no neutral value)
PARAMS = {"dp_clip": 0.0, "dp_noise": 1.0, "dp_delta": 1e-5, "dp_accountant": "pld",
          "dp_adaptive_quantile": 0.0, "dp_adaptive_lr": 0.2, "dp_adaptive_count_noise": 0.0,
          "dp_noise_cohort": 0}
PARAM_DOCS = {
    "dp_clip": "DP-FedAvg: L2 norm C each client's update is clipped to (with adaptive clipping its "
               "start); must be set > 0.",
    "dp_noise": "DP-FedAvg noise multiplier z: Gaussian noise of std z C on the sum of the clipped updates.",
    "dp_delta": "DP-FedAvg: the delta at which metrics.jsonl's epsilon is given.",
    "dp_accountant": "DP-FedAvg privacy accountant (dp-accounting): pld (privacy loss distributions, tight; "
                     "its grid coarsened for small dp_noise or many rounds, still an upper bound) or rdp "
                     "(Renyi DP, an upper bound); run.sampling = fixed needs rdp.",
    "dp_adaptive_quantile": "DP-FedAvg adaptive clipping (Andrew et al. 2021): the clip follows this quantile "
                            "gamma of the update norms, C <- C exp(-eta_C (b - gamma)), b the noised fraction of "
                            "unclipped updates clamped to [0, 1] (as TF Privacy); 0: a fixed clip.",
    "dp_adaptive_lr": "DP-FedAvg adaptive clipping: the clip's geometric step eta_C.",
    "dp_adaptive_count_noise": "DP-FedAvg adaptive clipping: std sigma_b of the noise on the count of "
                               "unclipped updates; 0: expected cohort / 20. Must exceed dp_noise / 2; the "
                               "update's multiplier becomes (z^-2 - (2 sigma_b)^-2)^-1/2, total privacy as at z.",
    "dp_noise_cohort": "DP-FedAvg noise cohort m (pfl-research's noise_cohort_size): noise calibrated, and "
                       "epsilon accounted, as if m clients trained each round (m of N sampled); 0: off."}


def check_params(params: dict) -> list[str]:
    errors = at_least_zero(params, "dp_noise", "dp_adaptive_count_noise", "dp_noise_cohort")
    errors += one_of(params, "dp_accountant", ACCOUNTANTS) + positive(params, "dp_adaptive_lr")
    if not params["dp_clip"] > 0:
        errors.append(f"algorithm.params.dp_clip: dpfedavg clips each client's update to this L2 norm; set it "
                      f"> 0, got {params['dp_clip']}")
    if not 0 < params["dp_delta"] < 1:
        errors.append(f"algorithm.params.dp_delta: must be in (0, 1), got {params['dp_delta']}")
    if not 0 <= params["dp_adaptive_quantile"] < 1:
        errors.append(f"algorithm.params.dp_adaptive_quantile: must be in [0, 1) (0: a fixed clip), got "
                      f"{params['dp_adaptive_quantile']}")
    return errors


def check_config(cfg, local: str, params: dict) -> list[str]:
    """The bound on one client's influence, C / K, holds for equal weights; the epsilon is
    dp-accounting's, for the run's sampling (the rule's own values: check_params); the noise
    cohort and adaptive clipping's count noise against the cohort."""
    errors, server = [], resolve(cfg.algorithm)[1]
    if weighting_of(cfg.algorithm) != "uniform":
        errors.append(f"algorithm.weighting: {server} bounds one client's influence by C / K with equal "
                      f"weights; set algorithm.weighting = uniform or auto, not {cfg.algorithm.weighting}")
    try:
        import dp_accounting  # noqa: F401
    except ImportError:
        errors.append(f"algorithm.name: {server} accounts its privacy with Google's dp-accounting (PLD or "
                      "RDP), which is not installed: pip install 'fedddp[dp]' (or pip install dp-accounting)")
    # run.sampling = auto is poisson for a private rule (algorithms.sampling_of)
    sampling = dataclasses.replace(cfg.run, sampling="poisson" if cfg.run.sampling == "auto" else cfg.run.sampling)
    if sampling.sampling == "fixed" and params.get("dp_accountant") == "pld":
        errors.append("algorithm.params.dp_accountant: pld cannot account run.sampling = fixed (K of N without "
                      "replacement: dp-accounting's PLD accountant has no such event); use run.sampling=poisson, "
                      "or algorithm.params.dp_accountant=rdp")
    cohort = dataclasses.replace(cfg, run=sampling).expected_cohort()
    noise_cohort, n = params.get("dp_noise_cohort", 0), cfg.data.num_clients
    if noise_cohort and not cohort <= noise_cohort <= n:
        errors.append(f"algorithm.params.dp_noise_cohort: the noise is calibrated for this many clients a round, "
                      f"so it must lie between the clients that train ({cohort:g} a round) and data.num_clients "
                      f"= {n}; got {noise_cohort}")
    elif params.get("dp_adaptive_quantile", 0) > 0 and params.get("dp_noise", 0) > 0:
        errors += _check_count_noise(params, noise_cohort or cohort)
    return errors


def _check_count_noise(params: dict, cohort: float) -> list[str]:
    z, m = params["dp_noise"], cohort
    sigma_b = params["dp_adaptive_count_noise"] or m / 20
    if 2 * sigma_b > z:
        return []
    # the value to set: sigma_b = z costs the update 1.155x its noise multiplier
    # ((z^-2 - (2 z)^-2)^-1/2); or a cohort whose m / 20 exceeds z / 2
    return [f"algorithm.params.dp_adaptive_count_noise: adaptive clipping's count noise sigma_b = "
            f"{sigma_b:g} (0: the cohort {m:g} / 20) must exceed dp_noise / 2 = {z / 2:g}, else no "
            "update noise keeps the total privacy at dp_noise; set "
            f"algorithm.params.dp_adaptive_count_noise={z:g} (the update's noise multiplier then "
            f"{z * (1 - 0.25) ** -0.5:.3g} instead of {z:g}), or a cohort (run.clients_per_round or "
            f"algorithm.params.dp_noise_cohort) above {10 * z:g}"]


def closing_words(last_row: dict, params: dict) -> str:
    """The final epsilon at delta (and the noise cohort it is for), as the last row wrote it."""
    eps = last_row.get("epsilon")
    if eps is None:
        return ""
    cohort = f" (for a noise cohort of {params['dp_noise_cohort']} a round)" if params.get("dp_noise_cohort") else ""
    return f"epsilon {eps:.4g} at delta {params['dp_delta']:g}{cohort}"


DP_NEEDS = frozenset({"num_sampled", "num_clients", "noise_seed", "sampling_rate", "poisson", "aggregation_block"})
DPFEDAVG = register(Strategy("dpfedavg", aggregate, init_state=init_state, ledger=ledger, spent=spent,
                             needs=DP_NEEDS, doc=__doc__, takes_server_lr=True, private=True, params=PARAMS,
                             check_params=check_params, param_docs=PARAM_DOCS, aggregate_span=aggregate_span,
                             start_words=start_words, check_config=check_config,
                             closing_words=closing_words))
DPFEDMOM = register(Strategy(
    "dpfedmom", aggregate_momentum, init_state=init_state_momentum, ledger=ledger, spent=spent, needs=DP_NEEDS,
    doc=__doc__, takes_server_lr=True, private=True, params=PARAMS | {"server_momentum": 0.9},
    check_params=lambda params: check_params(params) + in_unit(params, "server_momentum"),
    param_docs=PARAM_DOCS | {"server_momentum": "FedMom server momentum delta_m (0 gives FedAvg)."},
    aggregate_span=aggregate_momentum_span, start_words=start_words, check_config=check_config,
    closing_words=closing_words))
