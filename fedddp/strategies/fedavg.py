"""FedAvg: w = sum_k p_k w_k (McMahan et al. 2017), or with algorithm.server_lr = eta != 1 the
server SGD step along the averaged update, w <- w + eta (sum_k p_k w_k - w) (FedOpt's FedAvg,
Reddi et al. 2021). FedProx, MOON, FedSAM and FedGAM use this server rule."""

from __future__ import annotations

import torch

from .base import Strategy, client_weights_K, gathered, register, server_step, weighted_mean_P


def aggregate_span(global_P, stacks, state, hp, span):
    """w + eta (sum_k p_k w_k - w) per column, block by block over this rank's range (Strategy.aggregate_span)."""
    weights_K, params_KP = client_weights_K(stacks, hp), stacks["params_KP"]
    new_P = torch.empty_like(global_P)
    for b in span.blocks:
        new_P[b] = server_step(global_P[b], weighted_mean_P(weights_K, params_KP[:, b]), hp.server_lr)
    return new_P, state, {}


aggregate = gathered(aggregate_span)  # one block: the fused weighted mean over the whole vector


FEDAVG = register(Strategy("fedavg", aggregate, doc=__doc__, takes_server_lr=True, aggregate_span=aggregate_span,
                           buffered=True))
