"""FedMom (Fernandes et al., seed 004, eqs. 4-6): server momentum over the FedAvg update.

delta = sum_k p_k (w_k - w);  v <- m v + delta;  w <- w + v.   (m = hp.server_momentum)

Since sum_k p_k = 1, w + v = w + m v_old + (FedAvg - w) = FedAvg + m v_old: the new global
model is computed in that form, so momentum 0 returns FedAvg's vector bit for bit (on any
round) instead of w + (FedAvg - w), which differs from FedAvg by rounding. The new velocity is
then (FedAvg + m v_old) - w, one subtraction (the same rounding as forming delta first).
Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import torch

from . import Strategy, client_weights_K, register, weighted_mean_P


def init_state(global_P: torch.Tensor, hp) -> dict[str, torch.Tensor]:
    return {"velocity_P": torch.zeros_like(global_P)}


def aggregate(global_P, stacks, state, hp):
    momentum = float(hp.server_momentum)
    velocity_P = state["velocity_P"]
    # FedAvg + m v_old, in place in the fresh FedAvg vector (at m = 0 this adds 0 * v: FedAvg's
    # bits); then delta + m v_old = (FedAvg + m v_old) - w. Two [P] outputs and two [P] passes
    # after the average: every fresh [P] buffer costs page faults on top of its pass, which at
    # small K is as much as the average itself.
    new_global_P = weighted_mean_P(client_weights_K(stacks, hp), stacks["params_KP"])
    new_global_P.add_(velocity_P, alpha=momentum)
    new_velocity_P = torch.sub(new_global_P, global_P)
    diagnostics = {"velocity_norm": torch.linalg.vector_norm(new_velocity_P)}
    return new_global_P, {"velocity_P": new_velocity_P}, diagnostics


FEDMOM = register(Strategy("fedmom", aggregate, init_state=init_state, doc=__doc__))
