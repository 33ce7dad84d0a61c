"""DP-FedAvg (McMahan et al. 2018, "Learning differentially private recurrent language models"):
client-level differential privacy for FedAvg.

  d_k = w_k - w,   s_k = min(1, C / ||d_k||)              each client's update clipped to L2 norm C
  w  <- w + eta (sum_k s_k d_k + N(0, (z C)^2 I)) / K     noise on the sum, fixed denominator

K is the configured number of clients sampled per round (``num_sampled``), not the number of
reports: with dropouts the denominator stays fixed, as the paper's estimator (qW) does, so one
client moves the model by at most C / K. Weights are uniform (the bound needs equal weights).
Computed as sum_k (s_k / K) w_k + (1 - sum_k s_k / K) w, so with every client reporting, none
clipped and z = 0, the weights and the fused weighted mean are FedAvg's (uniform) bit for bit.
eta = hp.server_lr is the server's step along the noised mean update, as for FedAvg (1, the
paper's rule, leaves the bits as they are); it acts after the noise, so it costs no privacy.

Privacy: ``epsilon`` (written every round, at ``hp.params["dp_delta"]``) is the RDP accountant's bound for
the mechanism fedddp runs, from Google's dp-accounting (``pip install fedddp[dp]``):
  - Sampling: exactly K of the N clients, uniformly without replacement (fedddp.sampling), so
    every aggregation is SampledWithoutReplacementDpEvent(N, K, ...), whose RDP is the bound
    of Wang, Balle and Kasiviswanathan (AISTATS 2019, Thm. 27). Poisson sampling at q = K / N
    (Opacus's accountant, which fedddp used before) is a different mechanism: for the same
    z, K, N and rounds its epsilon is smaller (by 2x or more wherever checked), a figure the
    run does not have.
  - Neighbouring relation: replace one (dp-accounting's REPLACE_ONE, the only one it offers
    for this sampling). Two federations are neighbours when they have the same N clients
    (N is public: it fixes the sampling) and one client's data differ arbitrarily.
  - Sensitivity: replacing one client changes its clipped update from u to u' (both of norm
    <= C), so the noised sum moves by ||u - u'|| <= 2C, not C. dp-accounting's RDP routine
    for this event takes the Gaussian's noise multiplier as the noise std over that
    l2-sensitivity (at K = N it returns alpha / (2 m^2), the Gaussian mechanism's RDP for
    std m times the sensitivity), so the multiplier passed is z C / (2 C) = z / 2. Passing z
    (as GaussianDpEvent's own docstring, std / C, would suggest; dp-accounting's PLD
    accountant doubles the shift itself under REPLACE_ONE, its RDP accountant does not)
    would understate epsilon: 29.0 instead of 113.1 for the quickstart's N = 30, K = 10,
    z = 1, 40 rounds at delta = 1e-5 (Opacus's Poisson figure: 16.5).
  - Steps: one per round that aggregated; a round without reports releases nothing. The
    division by K and the server step are post-processing; dropouts (clients that do not
    report, independently of their data) could only lower epsilon and are not credited.
  - The noise and the sample are drawn from run.seed: the guarantee holds for someone who does
    not know it.
The one-step RDP curve depends on (z, K, N) only and is computed once per run (it takes a
fraction of a second); T steps are T times it, converted to epsilon as the accountant does.

Composes with any local rule whose server rule this can replace (algorithm.local = plain,
prox, sam, gam, moon); every other server rule is refused: they reweight, mask, normalise or
carry state across clients' raw updates, which voids the C / K bound.
Legend: K sampled clients that reported, P flat elements, N all clients.
"""

from __future__ import annotations

import functools
import math

import torch

from ..sampling import _mix
from ..params import at_least_zero
from .base import Strategy, register, server_step, weighted_mean_P

_NOISE_STREAM = 0xD9_0153


def clip_factors_K(updates_KP: torch.Tensor, clip: float) -> torch.Tensor:
    """s_k = min(1, C / ||d_k||) (float32; exactly 1.0 for a client within the bound)."""
    norms_K = torch.linalg.vector_norm(updates_KP, dim=1, dtype=torch.float64)
    return (clip / norms_K).clamp(max=1.0).to(updates_KP.dtype)


@functools.lru_cache(maxsize=4)
def _one_step_rdp(noise: float, num_sampled: int, num_clients: int):
    """(orders, RDP at each order) of one aggregation: K of N sampled without replacement, the
    Gaussian's multiplier z / 2 for the replace-one sensitivity 2C (module docstring)."""
    import dp_accounting  # late: an optional extra, imported only for DP runs
    accountant = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(
        num_clients, num_sampled, dp_accounting.GaussianDpEvent(noise / 2)))
    return accountant.orders, accountant.rdp


def epsilon(noise: float, num_sampled: int, num_clients: int, steps: int, delta: float) -> float:
    """Epsilon at ``delta`` after ``steps`` aggregations of K = num_sampled of N = num_clients
    clients sampled without replacement, noise multiplier z = ``noise`` on the clipped sum:
    what dp-accounting's RdpAccountant gives for that many SampledWithoutReplacementDpEvent(N,
    K, GaussianDpEvent(z / 2)) under REPLACE_ONE (the accountant adds the one-step curve
    ``steps`` times, as here)."""
    if steps == 0:
        return 0.0
    if noise <= 0.0:
        return math.inf
    import dp_accounting
    orders, rdp = _one_step_rdp(float(noise), int(num_sampled), int(num_clients))
    return float(dp_accounting.rdp.compute_epsilon(orders, steps * rdp, delta)[0])


def init_state(global_P, hp):
    return {"dp_steps": torch.zeros((), dtype=torch.float64)}


def aggregate(global_P, stacks, state, hp):
    params_KP = stacks["params_KP"]
    num_sampled = stacks["num_sampled"].to(params_KP.dtype)
    scale_K = clip_factors_K(params_KP - global_P, hp.params["dp_clip"])
    share_K = torch.ones_like(scale_K) / num_sampled  # FedAvg's uniform weights when all report
    # w's own weight 1 - sum_k s_k / K, as sums that are exactly 0 when every sampled client
    # reported within the bound (so the neutral setting keeps FedAvg's bits)
    stay = (share_K * (1 - scale_K)).sum() + (num_sampled - scale_K.shape[0]) / num_sampled
    new_global_P = weighted_mean_P(share_K * scale_K, params_KP) + stay * global_P
    steps = state["dp_steps"] + 1
    if hp.params["dp_noise"] > 0:
        gen = torch.Generator(device=global_P.device).manual_seed(
            _mix(_NOISE_STREAM, int(stacks["noise_seed"]), int(steps)))
        noise_P = torch.randn(global_P.shape, generator=gen, device=global_P.device, dtype=global_P.dtype)
        new_global_P = new_global_P + noise_P * (hp.params["dp_noise"] * hp.params["dp_clip"] / num_sampled)
    new_global_P = server_step(global_P, new_global_P, hp.server_lr)
    return new_global_P, {"dp_steps": steps}, {"clipped_fraction": (scale_K < 1).float().mean()}


def ledger(state, static, hp):
    """The privacy spent so far, written every round (a round without reports spends none)."""
    eps = epsilon(hp.params["dp_noise"], int(static["num_sampled"]), int(static["num_clients"]),
                  int(state["dp_steps"]), hp.params["dp_delta"])
    return {"epsilon": torch.tensor(eps, dtype=torch.float64)}


# dp_clip's default 0 is no bound at all: a DP run names its clip (DP-FedAvg's C has no neutral value)
PARAMS = {"dp_clip": 0.0, "dp_noise": 1.0, "dp_delta": 1e-5}
PARAM_DOCS = {
    "dp_clip": "DP-FedAvg: L2 norm C each client's update is clipped to; must be set > 0.",
    "dp_noise": "DP-FedAvg noise multiplier z: Gaussian noise of std z C on the sum of the clipped updates.",
    "dp_delta": "DP-FedAvg: the delta at which metrics.jsonl's epsilon is given."}


def check_params(params: dict) -> list[str]:
    errors = at_least_zero(params, "dp_noise")
    if not params["dp_clip"] > 0:
        errors.append(f"algorithm.params.dp_clip: dpfedavg clips each client's update to this L2 norm; set it "
                      f"> 0, got {params['dp_clip']}")
    if not 0 < params["dp_delta"] < 1:
        errors.append(f"algorithm.params.dp_delta: must be in (0, 1), got {params['dp_delta']}")
    return errors


DPFEDAVG = register(Strategy("dpfedavg", aggregate, init_state=init_state, ledger=ledger,
                             needs=frozenset({"num_sampled", "num_clients", "noise_seed"}), doc=__doc__,
                             takes_server_lr=True, params=PARAMS, check_params=check_params,
                             param_docs=PARAM_DOCS))
