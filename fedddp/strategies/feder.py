"""FedER (seed 003, Alg. 4): average each conv layer with weights proportional to the clients'
effective rank of that layer.

  er_kl    = max(1e-3, ER_kl)          (ER of client k's layer l: fedddp.metrics.effective_rank)
  alpha_kl = er_kl / sum_k er_kl
  W_l      = sum_k alpha_kl W_kl        (not sample-weighted)
Every other element (bias, BatchNorm, FC, and buffers) takes the alpha of the conv layer it
follows (``conv_group_P``, from the flat layout); elements before the first conv layer take
uniform weights 1/K. Freshly initialised kernels have EVBMF rank 0, so early rounds clamp every
client to 1e-3 and reduce to the uniform mean (expected).

The per-element weights are gathered a block of columns at a time from the small [K, L+1]
table (column 0 = uniform), so no [K, P] weight matrix is ever built and the params are read
from memory once. Diagnostics: alpha_KL.
Legend: K sampled clients, P flat parameters, L conv layers, B columns in a block.
"""

from __future__ import annotations

import torch

from . import Strategy, register
from .fedgma import column_block

MIN_RANK = 1e-3


def layer_weights_KL(eff_rank_KL: torch.Tensor) -> torch.Tensor:
    er_KL = eff_rank_KL.clamp(min=MIN_RANK)
    return er_KL / er_KL.sum(0, keepdim=True)


def aggregate(global_P, stacks, state, hp):
    params_KP = stacks["params_KP"]
    num_clients, num_params = params_KP.shape
    alpha_KL = layer_weights_KL(stacks["eff_rank_KL"].to(params_KP.dtype))
    uniform_K1 = torch.full((num_clients, 1), 1.0 / num_clients, dtype=params_KP.dtype,
                            device=params_KP.device)
    table_KG = torch.cat([uniform_K1, alpha_KL.to(params_KP.device)], dim=1)  # G = L + 1
    column_P = stacks["conv_group_P"] + 1                                  # -1 -> uniform column

    new_global_P = torch.empty_like(global_P)
    step = column_block(num_clients, params_KP.device)
    for start in range(0, num_params, step):
        cols = slice(start, start + step)
        weights_KB = table_KG.index_select(1, column_P[cols])
        torch.sum(weights_KB.mul_(params_KP[:, cols]), dim=0, out=new_global_P[cols])
    return new_global_P, state, {"feder_alpha": alpha_KL}


FEDER = register(Strategy("feder", aggregate, needs=frozenset({"eff_rank_KL", "conv_group_P"}),
                          doc=__doc__))
