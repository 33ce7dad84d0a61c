"""FedAvg: w = sum_k p_k w_k (McMahan et al. 2017), or with algorithm.server_lr = eta != 1 the
server SGD step along the averaged update, w <- w + eta (sum_k p_k w_k - w) (FedOpt's FedAvg,
Reddi et al. 2021). FedProx, MOON, FedSAM and FedGAM use this server rule."""

from __future__ import annotations

from .base import Strategy, client_weights_K, register, server_step, weighted_mean_P


def aggregate(global_P, stacks, state, hp):
    weights_K = client_weights_K(stacks, hp)
    return server_step(global_P, weighted_mean_P(weights_K, stacks["params_KP"]), hp.server_lr), state, {}


FEDAVG = register(Strategy("fedavg", aggregate, doc=__doc__, takes_server_lr=True))
