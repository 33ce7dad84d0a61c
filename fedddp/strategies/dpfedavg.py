"""DP-FedAvg (McMahan et al. 2018, "Learning differentially private recurrent language models"):
client-level differential privacy for FedAvg.

  d_k = w_k - w,   s_k = min(1, C / ||d_k||)              each client's update clipped to L2 norm C
  w  <- w + (sum_k s_k d_k + N(0, (z C)^2 I)) / K         noise on the sum, fixed denominator

K is the configured number of clients sampled per round (``num_sampled``), not the number of
reports: with dropouts the denominator stays fixed, as the paper's estimator (qW) does, so one
client moves the model by at most C / K. Weights are uniform (the bound needs equal weights).
Computed as sum_k (s_k / K) w_k + (1 - sum_k s_k / K) w, so with every client reporting, none
clipped and z = 0, the weights and the fused weighted mean are FedAvg's (uniform) bit for bit.

Privacy: every aggregation is one step of the subsampled Gaussian mechanism with noise
multiplier z and sampling rate q = K / N; epsilon at ``algorithm.dp_delta`` after the steps so
far comes from Opacus's RDP accountant (``pip install fedddp[dp]``), written every round as
``epsilon``. The accountant assumes Poisson sampling at rate q, as the paper's clients are
sampled; fedddp samples exactly K of N, for which this is the usual approximation.

Composes with any local rule whose server rule this can replace (algorithm.local = plain,
prox, sam, gam, moon); every other server rule is refused: they reweight, mask, normalise or
carry state across clients' raw updates, which voids the C / K bound.
Legend: K sampled clients that reported, P flat elements.
"""

from __future__ import annotations

import math

import torch

from ..sampling import _mix
from .base import Strategy, register, weighted_mean_P

_NOISE_STREAM = 0xD9_0153


def clip_factors_K(updates_KP: torch.Tensor, clip: float) -> torch.Tensor:
    """s_k = min(1, C / ||d_k||) (float32; exactly 1.0 for a client within the bound)."""
    norms_K = torch.linalg.vector_norm(updates_KP, dim=1, dtype=torch.float64)
    return (clip / norms_K).clamp(max=1.0).to(updates_KP.dtype)


def epsilon(noise: float, sample_rate: float, steps: int, delta: float) -> float:
    """Epsilon spent after ``steps`` subsampled Gaussian steps (Opacus's RDP accountant)."""
    if steps == 0:
        return 0.0
    if noise <= 0.0:
        return math.inf
    from opacus.accountants import RDPAccountant  # late: an optional extra, imported only for DP runs
    accountant = RDPAccountant()
    accountant.history = [(noise, sample_rate, steps)]
    return accountant.get_epsilon(delta)


def init_state(global_P, hp):
    return {"dp_steps": torch.zeros((), dtype=torch.float64)}


def aggregate(global_P, stacks, state, hp):
    params_KP = stacks["params_KP"]
    num_sampled = stacks["num_sampled"].to(params_KP.dtype)
    scale_K = clip_factors_K(params_KP - global_P, hp.dp_clip)
    share_K = torch.ones_like(scale_K) / num_sampled  # FedAvg's uniform weights when all report
    # w's own weight 1 - sum_k s_k / K, as sums that are exactly 0 when every sampled client
    # reported within the bound (so the neutral setting keeps FedAvg's bits)
    stay = (share_K * (1 - scale_K)).sum() + (num_sampled - scale_K.shape[0]) / num_sampled
    new_global_P = weighted_mean_P(share_K * scale_K, params_KP) + stay * global_P
    steps = state["dp_steps"] + 1
    if hp.dp_noise > 0:
        gen = torch.Generator(device=global_P.device).manual_seed(
            _mix(_NOISE_STREAM, int(stacks["noise_seed"]), int(steps)))
        noise_P = torch.randn(global_P.shape, generator=gen, device=global_P.device, dtype=global_P.dtype)
        new_global_P = new_global_P + noise_P * (hp.dp_noise * hp.dp_clip / num_sampled)
    return new_global_P, {"dp_steps": steps}, {"clipped_fraction": (scale_K < 1).float().mean()}


def ledger(state, static, hp):
    """The privacy spent so far, written every round (a round without reports spends none)."""
    q = float(static["num_sampled"]) / float(static["num_clients"])
    eps = epsilon(hp.dp_noise, q, int(state["dp_steps"]), hp.dp_delta)
    return {"epsilon": torch.tensor(eps, dtype=torch.float64)}


DPFEDAVG = register(Strategy("dpfedavg", aggregate, init_state=init_state, ledger=ledger,
                             needs=frozenset({"num_sampled", "num_clients", "noise_seed"}), doc=__doc__))
