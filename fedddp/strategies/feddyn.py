"""FedDyn (Acar et al. 2021, "Federated Learning Based on Dynamic Regularization", Alg. 1), the
server side:

  h <- h - alpha (1/N) sum_{k in S} (w_k - w)      N = data.num_clients: the mean over ALL clients
                                                    of their updates, a client outside S adding 0
  w <- (1/|S|) sum_{k in S} w_k - h / alpha         (p_k by hp.weighting: uniform, the paper's)

h (``dyn_h_P``, zero at first) is the server's state; N reaches the rule as the static scalar
``num_clients``. The client side (the linear and quadratic terms of the local objective) is the
``feddyn`` local rule (fedddp/client/rules/feddyn.py), with the same ``feddyn_alpha``. The rule is
this file and that one: both register themselves, the algorithm with them.
Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import torch

from ..params import positive
from ..registry import add_algorithm
from .base import Strategy, client_weights_K, gathered, register, weighted_mean_P

PARAMS = {"feddyn_alpha": 0.01}
PARAM_DOCS = {"feddyn_alpha": "FedDyn regularisation alpha: the local objective's (alpha/2) ||w - w_server||^2 "
                              "and the server's h / alpha (> 0)."}


def init_state(global_P: torch.Tensor, hp) -> dict[str, torch.Tensor]:
    return {"dyn_h_P": torch.zeros_like(global_P)}


def aggregate_span(global_P, stacks, state, hp, span):
    """Block by block over this rank's range: every column's h and w from that column alone."""
    alpha = float(hp.params["feddyn_alpha"])
    weights_K, params_KP = client_weights_K(stacks, hp), stacks["params_KP"]
    num_clients, num_reports = stacks["num_clients"].to(global_P.dtype), params_KP.shape[0]
    new_P, h_P = torch.empty_like(global_P), torch.empty_like(state["dyn_h_P"])
    for b in span.blocks:
        # sum_{k in S} (w_k - w) = sum_k w_k - |S| w
        drift_P = params_KP[:, b].sum(0) - num_reports * global_P[b]
        h_P[b] = state["dyn_h_P"][b] - alpha * drift_P / num_clients
        new_P[b] = weighted_mean_P(weights_K, params_KP[:, b]) - h_P[b] / alpha
    return new_P, {"dyn_h_P": h_P}, {}


def check_params(params: dict) -> list[str]:
    return positive(params, "feddyn_alpha")


FEDDYN = register(Strategy("feddyn", gathered(aggregate_span), needs=frozenset({"num_clients"}),
                           init_state=init_state, doc=__doc__, params=PARAMS, param_docs=PARAM_DOCS,
                           check_params=check_params, aggregate_span=aggregate_span))
add_algorithm("feddyn", "feddyn", "feddyn", "uniform")  # Alg. 1: the plain mean over the round's clients
