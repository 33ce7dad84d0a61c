"""SCAFFOLD's server rule (Karimireddy et al. 2020) and FedGAM-CV's (seed 002, Alg. 2, eq. 22).

  w <- w + eta_g sum_k p_k (w_k - w)          (eta_g = hp.server_lr; p_k by hp.weighting)
  c <- c + (1/N) sum_{k in S} (c_k+ - c_k)    SCAFFOLD: N = data.num_clients
  c <- c + (1/K) sum_{k in S} (c_k+ - c_k)    FedGAM-CV eq. 22: K = sampled clients

The client side (c - c_k in every step; c_k+ = c_k - c + (w - w_k) / (tau lr), option II, or
SCAFFOLD's option I, the client's full gradient at w) is the ``scaffold`` / ``gam_cv`` local
rule; it reports c_k+ - c_k as ``control_delta_KP``. The server control c (``control_P``, zero
at first) is client-visible: broadcast with the model every round.

N is not a hyperparameter of the algorithm section: the round loop passes it in ``stacks`` as
the static scalar ``num_clients`` (float32 0-d tensor), as it does ``conv_group_P``.
The new model is ``lerp(w, mean_k w_k, eta_g)`` (strategies.server_step), the same formula,
and the weighted mean itself when eta_g = 1, so round 1 (c = c_k = 0) equals FedAvg exactly.
The SCAFFOLD and FedGAM-CV papers average uniformly: hp.weighting = auto resolves to uniform.
Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import torch

from .base import Strategy, client_weights_K, gathered, register, server_step, weighted_mean_P


def init_state(global_P: torch.Tensor, hp) -> dict[str, torch.Tensor]:
    return {"control_P": torch.zeros_like(global_P)}


def _aggregate_span(global_P, stacks, state, hp, span, divisor):
    """w <- w + eta_g (sum_k p_k w_k - w) and c <- c + sum_k (c_k+ - c_k) / divisor, block by block
    over this rank's range; c comes back whole (client-visible), its norm that of the whole vector."""
    weights_K, params_KP, deltas_KP = client_weights_K(stacks, hp), stacks["params_KP"], stacks["control_delta_KP"]
    new_P, control_P = torch.empty_like(global_P), torch.empty_like(state["control_P"])
    for b in span.blocks:
        new_P[b] = server_step(global_P[b], weighted_mean_P(weights_K, params_KP[:, b]), hp.server_lr)
        control_P[b] = state["control_P"][b] + deltas_KP[:, b].sum(0) / divisor
    control_P = span.gather_vector(control_P)
    return new_P, {"control_P": control_P}, {"control_norm": torch.linalg.vector_norm(control_P)}


def aggregate_span(global_P, stacks, state, hp, span):
    return _aggregate_span(global_P, stacks, state, hp, span, stacks["num_clients"].to(global_P.dtype))


def aggregate_sampled_span(global_P, stacks, state, hp, span):
    return _aggregate_span(global_P, stacks, state, hp, span, stacks["control_delta_KP"].shape[0])


# the gathered forms: the range forms over the whole vector in one block
aggregate, aggregate_sampled = gathered(aggregate_span), gathered(aggregate_sampled_span)


SCAFFOLD = register(Strategy("scaffold", aggregate, needs=frozenset({"control_delta_KP", "num_clients"}),
                             init_state=init_state, client_visible=("control_P",), doc=__doc__,
                             takes_server_lr=True, aggregate_span=aggregate_span))
FEDGAM_CV = register(Strategy("fedgam_cv", aggregate_sampled, needs=frozenset({"control_delta_KP"}),
                              init_state=init_state, client_visible=("control_P",), doc=__doc__,
                              takes_server_lr=True, aggregate_span=aggregate_sampled_span))
