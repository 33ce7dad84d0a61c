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

Privacy: ``epsilon`` (written every round, at ``hp.dp_delta``) is the RDP accountant's bound for
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
from .base import Span, Strategy, block_width, register, server_step, weighted_mean_P

_NOISE_STREAM = 0xD9_0153


def clip_factors_K(updates_KP: torch.Tensor, clip: float) -> torch.Tensor:
    """s_k = min(1, C / ||d_k||) (float32; exactly 1.0 for a client within the bound)."""
    norms_K = torch.linalg.vector_norm(updates_KP, dim=1, dtype=torch.float64)
    return (clip / norms_K).clamp(max=1.0).to(updates_KP.dtype)


def update_norms_K(params_KP: torch.Tensor, global_P: torch.Tensor, span: Span) -> torch.Tensor:
    """||w_k - w|| over the whole vector, float64: per block the norm of the block's d_k, whose
    squares are added over every block in block order (Span.total), then the square root. One
    block gives the norm of the whole d_k itself (sqrt(x * x) is x in binary floating point)."""
    rows = [torch.linalg.vector_norm(params_KP[:, b] - global_P[b], dim=1, dtype=torch.float64).square()
            for b in span.blocks]
    return span.total(rows, params_KP.shape[0]).sqrt()


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


def _noise_P(numel: int, like: torch.Tensor, stacks, hp, steps):
    """The server's noise N(0, 1) for the whole vector [P], from (run.seed, aggregation count):
    the sharded form draws it whole on every rank too and takes its columns, so its bits do not
    depend on the ranks (None without noise)."""
    if not hp.dp_noise > 0:
        return None
    gen = torch.Generator(device=like.device).manual_seed(_mix(_NOISE_STREAM, int(stacks["noise_seed"]), int(steps)))
    return torch.randn((numel,), generator=gen, device=like.device, dtype=like.dtype)


def _shares(stacks, scale_K):
    """(s_k / K, w's own weight 1 - sum_k s_k / K): sums that are exactly 0 when every sampled
    client reported within the bound (so the neutral setting keeps FedAvg's bits)."""
    num_sampled = stacks["num_sampled"].to(scale_K.dtype)
    share_K = torch.ones_like(scale_K) / num_sampled  # FedAvg's uniform weights when all report
    stay = (share_K * (1 - scale_K)).sum() + (num_sampled - scale_K.shape[0]) / num_sampled
    return share_K * scale_K, stay, num_sampled


def aggregate(global_P, stacks, state, hp):
    params_KP = stacks["params_KP"]
    span = Span.whole(global_P.shape[0], block_width(stacks, global_P.shape[0]), global_P.device)
    scale_K = (hp.dp_clip / update_norms_K(params_KP, global_P, span)).clamp(max=1.0).to(params_KP.dtype)
    weights_K, stay, num_sampled = _shares(stacks, scale_K)
    new_global_P = weighted_mean_P(weights_K, params_KP) + stay * global_P
    steps = state["dp_steps"] + 1
    noise_P = _noise_P(global_P.shape[0], global_P, stacks, hp, steps)
    if noise_P is not None:
        new_global_P = new_global_P + noise_P * (hp.dp_noise * hp.dp_clip / num_sampled)
    new_global_P = server_step(global_P, new_global_P, hp.server_lr)
    return new_global_P, {"dp_steps": steps}, {"clipped_fraction": (scale_K < 1).float().mean()}


def aggregate_span(global_P, stacks, state, hp, span):
    """Clip norms over every rank's blocks, then block by block over this rank's range with its
    columns of the whole noise vector (Strategy.aggregate_span)."""
    params_KP = stacks["params_KP"]
    scale_K = (hp.dp_clip / update_norms_K(params_KP, global_P, span)).clamp(max=1.0).to(params_KP.dtype)
    weights_K, stay, num_sampled = _shares(stacks, scale_K)
    steps = state["dp_steps"] + 1
    noise_P = _noise_P(span.numel, global_P, stacks, hp, steps)
    new_P = torch.empty_like(global_P)
    for b in span.blocks:
        new_B = weighted_mean_P(weights_K, params_KP[:, b]) + stay * global_P[b]
        if noise_P is not None:
            cols = slice(span.start + b.start, span.start + b.stop)
            new_B = new_B + noise_P[cols] * (hp.dp_noise * hp.dp_clip / num_sampled)
        new_P[b] = server_step(global_P[b], new_B, hp.server_lr)
    return new_P, {"dp_steps": steps}, {"clipped_fraction": (scale_K < 1).float().mean()}


def ledger(state, static, hp):
    """The privacy spent so far, written every round (a round without reports spends none)."""
    eps = epsilon(hp.dp_noise, int(static["num_sampled"]), int(static["num_clients"]),
                  int(state["dp_steps"]), hp.dp_delta)
    return {"epsilon": torch.tensor(eps, dtype=torch.float64)}


DPFEDAVG = register(Strategy("dpfedavg", aggregate, init_state=init_state, ledger=ledger,
                             needs=frozenset({"num_sampled", "num_clients", "noise_seed", "aggregation_block"}),
                             doc=__doc__, takes_server_lr=True, aggregate_span=aggregate_span))
