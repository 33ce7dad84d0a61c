"""FedAvg: w = sum_k p_k w_k (McMahan et al. 2017)."""

from __future__ import annotations

from .base import Strategy, client_weights_K, register, weighted_mean_P


def aggregate(global_P, stacks, state, hp):
    weights_K = client_weights_K(stacks, hp)
    return weighted_mean_P(weights_K, stacks["params_KP"]), state, {}


FEDAVG = register(Strategy("fedavg", aggregate, doc=__doc__))
