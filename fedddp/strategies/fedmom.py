"""FedMom (Fernandes et al., seed 004, eqs. 4-6): server momentum over the FedAvg update.

delta = sum_k p_k (w_k - w);  v <- m v + delta;  w <- w + eta v.
(m = hp.params["server_momentum"]; eta = hp.server_lr, 1 in the paper: Flower's FedAvgM step
w <- w - eta (momentum buffer) with the same unscaled buffer.)

Since sum_k p_k = 1, w + v = w + m v_old + (FedAvg - w) = FedAvg + m v_old: at eta = 1 the new
global model is computed in that form, so momentum 0 returns FedAvg's vector bit for bit (on
any round) instead of w + (FedAvg - w), which differs from FedAvg by rounding.
The step taken is s = w_new - w = eta v, so the state keeps the previous global model instead of
v: next round s_old = w - w_prev is recomputed with the same single subtraction (the same bits),
and the round writes one [P] vector instead of two (at small K the extra output costs as much
as the average itself). Since s = eta v, s_new = eta (m v_old + delta) = m s_old + eta delta:
w_new = lerp(w, FedAvg, eta) + m (w - w_prev), no division by eta (eta = 0 is allowed).
State: previous_P (the model before the last aggregation; at round 1 the initial model, i.e.
v = 0). Diagnostics: velocity_norm = ||w_new - w|| (eta ||v||).
Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import torch

from . import kernels
from ..params import in_unit
from .base import Strategy, client_weights_K, register, server_step, weighted_mean_P


def init_state(global_P: torch.Tensor, hp) -> dict[str, torch.Tensor]:
    return {"previous_P": global_P.clone()}


def _step(global_P, params_KP, previous_P, weights_K, momentum: float, server_lr: float):
    """(w_new, ||w_new - w||^2 as a float from the fused kernel, or None from the torch ops)."""
    lib = kernels.lib(params_KP, global_P, previous_P, rule="fedmom")
    if lib is not None:
        return kernels.fedmom(lib, params_KP, weights_K, global_P, previous_P, momentum, server_lr)
    velocity_P = torch.sub(global_P, previous_P)
    new_global_P = server_step(global_P, weighted_mean_P(weights_K, params_KP), server_lr)
    return new_global_P.add_(velocity_P, alpha=momentum), None


def aggregate(global_P, stacks, state, hp):
    momentum, server_lr = float(hp.params["server_momentum"]), float(hp.server_lr)
    weights_K = client_weights_K(stacks, hp)
    new_global_P, sq_norm = _step(global_P, stacks["params_KP"], state["previous_P"], weights_K, momentum, server_lr)
    if sq_norm is not None:
        velocity_norm = torch.as_tensor(sq_norm, dtype=torch.float64).sqrt().to(global_P.dtype)
    else:
        velocity_norm = torch.linalg.vector_norm(torch.sub(new_global_P, global_P))
    return new_global_P, {"previous_P": global_P}, {"velocity_norm": velocity_norm}


def aggregate_span(global_P, stacks, state, hp, span):
    """Block by block over this rank's range; velocity_norm from float64 per-block sums of
    squares added in block order (Strategy.aggregate_span)."""
    momentum, server_lr = float(hp.params["server_momentum"]), float(hp.server_lr)
    params_KP, previous_P = stacks["params_KP"], state["previous_P"]
    weights_K = client_weights_K(stacks, hp)
    new_P, sq_rows = torch.empty_like(global_P), []
    for b in span.blocks:
        new_P[b] = _step(global_P[b], params_KP[:, b], previous_P[b], weights_K, momentum, server_lr)[0]
        sq_rows.append(torch.sub(new_P[b], global_P[b]).double().square().sum())
    velocity_norm = span.total(sq_rows, 1)[0].sqrt().to(global_P.dtype)
    return new_P, {"previous_P": global_P.clone()}, {"velocity_norm": velocity_norm}


def check_params(params: dict) -> list[str]:
    return in_unit(params, "server_momentum")


FEDMOM = register(Strategy("fedmom", aggregate, init_state=init_state, doc=__doc__,
                           takes_server_lr=True, aggregate_span=aggregate_span,
                           params={"server_momentum": 0.9}, check_params=check_params,
                           param_docs={"server_momentum": "FedMom server momentum delta_m (0 gives FedAvg)."}))
