"""FedMom (Fernandes et al., seed 004, eqs. 4-6): server momentum over the FedAvg update.

delta = sum_k p_k (w_k - w);  v <- m v + delta;  w <- w + v.   (m = hp.server_momentum)

Since sum_k p_k = 1, w + v = w + m v_old + (FedAvg - w) = FedAvg + m v_old: the new global
model is computed in that form, so momentum 0 returns FedAvg's vector bit for bit (on any
round) instead of w + (FedAvg - w), which differs from FedAvg by rounding.
The velocity is then the step the global model just took, v = w_new - w, so the state keeps
the previous global model instead of v: next round v_old = w - w_prev is recomputed with the
same single subtraction (the same bits), and the round writes one [P] vector instead of two
(at small K the extra output costs as much as the average itself). State: previous_P (the
model before the last aggregation; at round 1 the initial model, i.e. v = 0).
Diagnostics: velocity_norm = ||w_new - w||.
Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import torch

from . import kernels
from .base import Strategy, client_weights_K, register, weighted_mean_P


def init_state(global_P: torch.Tensor, hp) -> dict[str, torch.Tensor]:
    return {"previous_P": global_P.clone()}


def aggregate(global_P, stacks, state, hp):
    momentum = float(hp.server_momentum)
    params_KP, previous_P = stacks["params_KP"], state["previous_P"]
    weights_K = client_weights_K(stacks, hp)
    lib = kernels.lib(params_KP, global_P, previous_P, rule="fedmom")
    if lib is not None:
        new_global_P, sq_norm = kernels.fedmom(lib, params_KP, weights_K, global_P, previous_P,
                                               momentum)
        velocity_norm = torch.as_tensor(sq_norm, dtype=torch.float64).sqrt().to(global_P.dtype)
    else:
        velocity_P = torch.sub(global_P, previous_P)
        new_global_P = weighted_mean_P(weights_K, params_KP).add_(velocity_P, alpha=momentum)
        velocity_norm = torch.linalg.vector_norm(torch.sub(new_global_P, global_P, out=velocity_P))
    return new_global_P, {"previous_P": global_P}, {"velocity_norm": velocity_norm}


FEDMOM = register(Strategy("fedmom", aggregate, init_state=init_state, doc=__doc__))
