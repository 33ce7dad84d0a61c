"""FedSMOO's server rule (Sun et al., ICML 2023; after the authors' FL-Simulator ``FedSMOO.py``).

  H <- H + sum_{k in S} (w_k - w)                 H = sum over all N clients of their drift h_k
  w <- sum_k p_k w_k + H / N                      (FedDyn-style correction; N = data.num_clients)
  m  = sum_k p_k mu_k;   s <- rho m / (||m|| + 1e-7)    (rho = hp.params["sam_rho"])

Each client keeps its own h_k and mu_k (the ``smoo`` local rule, fedddp.client.rules); the
server keeps H (``drift_sum_P``) instead of the reference code's [N, P] table, which is the same
sum at 1/N of the memory. s (``perturb_P``) is client-visible. As in the reference code, s
ignores the small \\hat{s}_{i,K} term. Buffers (BatchNorm statistics) are averaged and get no
drift (``param_mask_P``, static). N is passed in ``stacks`` as the static scalar ``num_clients``.
The reference averages uniformly: hp.weighting = auto resolves to uniform.
Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import torch

from ..params import at_least_zero
from .base import Strategy, client_weights_K, register, weighted_mean_P


def init_state(global_P: torch.Tensor, hp) -> dict[str, torch.Tensor]:
    return {"drift_sum_P": torch.zeros_like(global_P), "perturb_P": torch.zeros_like(global_P)}


def aggregate(global_P, stacks, state, hp):
    params_KP = stacks["params_KP"]
    weights_K = client_weights_K(stacks, hp)
    mean_P = weighted_mean_P(weights_K, params_KP)
    mask_P = stacks["param_mask_P"].to(global_P.dtype)
    drift_sum_P = state["drift_sum_P"] + (params_KP - global_P).sum(0) * mask_P
    new_global_P = mean_P + drift_sum_P / stacks["num_clients"].to(global_P.dtype)
    dual_P = weighted_mean_P(weights_K, stacks["perturb_dual_KP"])
    norm = torch.linalg.vector_norm(dual_P)
    perturb_P = dual_P * (float(hp.params["sam_rho"]) / (norm + 1e-7))
    return new_global_P, {"drift_sum_P": drift_sum_P, "perturb_P": perturb_P}, {"dual_norm": norm}


def aggregate_span(global_P, stacks, state, hp, span):
    """Block by block over this rank's range; the dual made whole (span.gather_vector) for its
    norm, so s (client-visible, returned whole) has the gathered form's bits."""
    params_KP, duals_KP = stacks["params_KP"], stacks["perturb_dual_KP"]
    weights_K = client_weights_K(stacks, hp)
    mask_P, num_clients = stacks["param_mask_P"].to(global_P.dtype), stacks["num_clients"].to(global_P.dtype)
    new_P, drift_sum_P, dual_P = (torch.empty_like(global_P) for _ in range(3))
    for b in span.blocks:
        drift_sum_P[b] = state["drift_sum_P"][b] + (params_KP[:, b] - global_P[b]).sum(0) * mask_P[b]
        new_P[b] = weighted_mean_P(weights_K, params_KP[:, b]) + drift_sum_P[b] / num_clients
        dual_P[b] = weighted_mean_P(weights_K, duals_KP[:, b])
    dual_P = span.gather_vector(dual_P)
    norm = torch.linalg.vector_norm(dual_P)
    perturb_P = dual_P * (float(hp.params["sam_rho"]) / (norm + 1e-7))
    return new_P, {"drift_sum_P": drift_sum_P, "perturb_P": perturb_P}, {"dual_norm": norm}


FEDSMOO = register(Strategy("fedsmoo", aggregate,
                            needs=frozenset({"perturb_dual_KP", "num_clients", "param_mask_P"}),
                            init_state=init_state, client_visible=("perturb_P",), doc=__doc__,
                            aggregate_span=aggregate_span, params={"sam_rho": 0.1},
                            check_params=lambda params: at_least_zero(params, "sam_rho"),
                            param_docs={"sam_rho": "FedSAM / FedSMOO perturbation radius rho (the smoo "
                                                   "clients' and the server's)."}))
