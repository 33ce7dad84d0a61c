"""Krum and Multi-Krum (Blanchard et al. 2017, "Machine Learning with Adversaries: Byzantine
Tolerant Gradient Descent", sec. 4) and Bulyan (El Mhamdi et al. 2018, "The Hidden Vulnerability
of Distributed Learning in Byzantium", sec. 3): the rules of Flower's Krum and Bulyan
(flwr.server.strategy.aggregate: aggregate_krum, aggregate_bulyan with aggregate_krum).

With f = algorithm.params.byzantine_f (the clients that may be Byzantine, 1) and the squared
distances d_ij = ||w_i - w_j||^2 between the K reports:

  score_i = the sum of d_ij over the n = max(1, K - f - 2) clients j != i closest to w_i
  krum:    the m = algorithm.params.krum_m clients of lowest score (ties: the lower client id),
           averaged with the run's weights p_k renormalised over them: uniform by default
           (Blanchard's Multi-Krum), samples as Flower's aggregate_krum. m = 1 is Krum, the chosen
           client's model bit for bit; m >= K every client, FedAvg's bits.
  bulyan:  theta = K - 2f clients chosen one at a time by Krum (f as above) among the clients not
           chosen yet; then each coordinate is the mean of the beta = theta - 2f values of the
           chosen clients closest to their median (K even: the mean of the middle two). Bulyan
           assumes K >= 4f + 3 (Flower raises otherwise); a round with fewer reports (dropouts,
           Poisson sampling) runs with the largest f that satisfies it, written as bulyan_f
           (0 below 7 reports: the uniform mean). f = 0 is uniform FedAvg bit for bit.

d_ij is summed in float64 from exact-ish differences (torch.cdist without the Gram matrix, whose
|w_i|^2 + |w_j|^2 - 2 w_i.w_j cancels when clients are close relative to |w|), per block of
run.aggregation_block columns, the blocks added in block order (Span.total): the sharded server
(run.aggregation = sharded) gets the same matrix on every rank, so every rank chooses the same
clients and then averages its own columns. A client whose report is not finite scores inf or
NaN, sorts last and is not chosen while enough others are. No state, no server step
(algorithm.server_lr is refused). Diagnostics, per client in clients.jsonl: krum_score and
krum_selected (Krum), bulyan_selected (Bulyan); per round bulyan_f. Legend: K clients that
reported, P flat parameters, C columns of a piece, S chosen clients.
"""

from __future__ import annotations

import torch

from ..params import at_least_zero, positive
from .base import Strategy, client_weights_K, gathered, register, weighted_mean_P
from .coordinatewise import by_columns, median_C, pieces, uniform_mean_C

NEEDS = frozenset({"aggregation_block"})


def sq_distances_KK(params_KP: torch.Tensor, span) -> torch.Tensor:
    """d_ij = ||w_i - w_j||^2 over the whole vector, float64: per block (in pieces of columns),
    then over every rank's blocks in block order."""
    num_clients = params_KP.shape[0]
    rows = []
    for block in pieces(span, 4 * num_clients):      # float64 copies: two floats a value
        dist_KK = torch.zeros(num_clients, num_clients, dtype=torch.float64, device=params_KP.device)
        for c in block:
            x_KC = params_KP[:, c].double()
            dist_KK += torch.cdist(x_KC, x_KC, compute_mode="donot_use_mm_for_euclid_dist").square()
        rows.append(dist_KK)
    return span.total(rows, num_clients * num_clients).reshape(num_clients, num_clients)


def krum_scores_K(dist_KK: torch.Tensor, num_byzantine: int) -> torch.Tensor:
    """score_i: the sum of the n = max(1, K - f - 2) smallest d_ij, j != i (i's own 0 sorts first;
    NaN last)."""
    num_clients = dist_KK.shape[0]
    num_closest = min(max(1, num_clients - num_byzantine - 2), num_clients - 1)
    return torch.sort(dist_KK, dim=1).values[:, 1:1 + num_closest].sum(1)


def lowest_K(score_K: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` clients of lowest score (ties: lower id; NaN last), in client-id order."""
    return torch.sort(score_K, stable=True).indices[:count].sort().values


def _chosen_K(keep_S: torch.Tensor, num_clients: int) -> torch.Tensor:
    chosen_K = torch.zeros(num_clients, dtype=torch.float64, device=keep_S.device)
    return chosen_K.index_fill_(0, keep_S, 1.0)


def _krum_span(global_P, stacks, state, hp, span):
    """Strategy.aggregate_span: the scores over the whole vector, then the chosen clients' mean
    over this rank's columns."""
    params_KP = stacks["params_KP"]
    num_clients = params_KP.shape[0]
    score_K = krum_scores_K(sq_distances_KK(params_KP, span), hp.params["byzantine_f"])
    keep_S = lowest_K(score_K, min(hp.params["krum_m"], num_clients))
    # the run's weights over the chosen clients: n_k or 1 each, over their sum (all K: FedAvg's p_k)
    weights_S = client_weights_K({"num_samples_K": stacks["num_samples_K"][keep_S], "params_KP": params_KP}, hp)
    new_P = by_columns(global_P, params_KP, span, 1,
                       lambda rows_KC: weighted_mean_P(weights_S, rows_KC.index_select(0, keep_S)))
    return new_P, state, {"krum_score_K": score_K, "krum_selected_K": _chosen_K(keep_S, num_clients)}


def bulyan_selection_S(dist_KK: torch.Tensor, num_byzantine: int) -> torch.Tensor:
    """theta = K - 2f clients, each the Krum choice among those not chosen yet, in client-id
    order. A loop of theta steps over the [K, K] matrix, never over the [K, P] reports."""
    remaining = torch.arange(dist_KK.shape[0], device=dist_KK.device)
    chosen = []
    for _ in range(dist_KK.shape[0] - 2 * num_byzantine):
        score_R = krum_scores_K(dist_KK[remaining][:, remaining], num_byzantine)
        best = lowest_K(score_R, 1)
        chosen.append(remaining[best])
        remaining = remaining[torch.arange(len(remaining), device=remaining.device) != best]
    return torch.cat(chosen).sort().values


def closest_to_median_mean_C(rows_SC: torch.Tensor, beta: int) -> torch.Tensor:
    """Per column, the mean of the beta values closest to the median (ties: lower client id)."""
    if beta == rows_SC.shape[0]:     # every value: the mean in client-id order, FedAvg's bits
        return uniform_mean_C(rows_SC)
    order_BC = (rows_SC - median_C(rows_SC)).abs_().argsort(dim=0, stable=True)[:beta]
    return uniform_mean_C(rows_SC.gather(0, order_BC))


def _bulyan_span(global_P, stacks, state, hp, span):
    """Strategy.aggregate_span: the selection over the whole vector, then the coordinate-wise
    stage over this rank's columns."""
    params_KP = stacks["params_KP"]
    num_clients = params_KP.shape[0]
    num_byzantine = min(hp.params["byzantine_f"], max(0, (num_clients - 3) // 4))
    keep_S = bulyan_selection_S(sq_distances_KK(params_KP, span), num_byzantine)
    beta = len(keep_S) - 2 * num_byzantine
    new_P = by_columns(global_P, params_KP, span, 8,
                       lambda rows_KC: closest_to_median_mean_C(rows_KC.index_select(0, keep_S), beta))
    return new_P, state, {"bulyan_selected_K": _chosen_K(keep_S, num_clients),
                          "bulyan_f": torch.tensor(float(num_byzantine), dtype=torch.float64)}


def check_params(params: dict) -> list[str]:
    return at_least_zero(params, "byzantine_f") + (positive(params, "krum_m") if "krum_m" in params else [])


F_DOC = "Krum, Bulyan: f, the clients that may be Byzantine (Bulyan: at most (K - 3) / 4 of a round's K)."
KRUM = register(Strategy("krum", gathered(_krum_span), needs=NEEDS, doc=__doc__, aggregate_span=_krum_span,
                         params={"byzantine_f": 1, "krum_m": 1}, check_params=check_params,
                         param_docs={"byzantine_f": F_DOC,
                                     "krum_m": "Krum: m, the clients of lowest score averaged (1: Krum, more: "
                                               "Multi-Krum; K: FedAvg)."}))
BULYAN = register(Strategy("bulyan", gathered(_bulyan_span), needs=NEEDS, doc=__doc__, aggregate_span=_bulyan_span,
                           params={"byzantine_f": 1}, check_params=check_params, param_docs={"byzantine_f": F_DOC}))
