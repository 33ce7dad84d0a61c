"""FedER (seed 003, Alg. 4): average each conv layer with weights proportional to the clients'
effective rank of that layer.

  er_kl    = max(1e-3, ER_kl)          (ER of client k's layer l: fedddp.metrics.effective_rank)
  alpha_kl = er_kl / sum_k er_kl
  W_l      = sum_k alpha_kl W_kl        (not sample-weighted)
Every other element (bias, BatchNorm, FC, and buffers) takes the alpha of the conv layer it
follows (``conv_group_P``, from the flat layout); elements before the first conv layer take
uniform weights 1/K. Freshly initialised kernels have EVBMF rank 0, so early rounds clamp every
client to 1e-3 and reduce to the uniform mean (expected).

conv_group_P is constant over each tensor of the layout, so the rule walks its runs (R of them,
at most one per tensor: 40 for ResNet-18 with buffers) and does one matrix-vector product per
run with that run's column of the small [K, L+1] weight table (column 0 = uniform): no [K, P]
weight matrix is built and the params are read once. Diagnostics: alpha_KL.
Legend: K sampled clients, P flat parameters, L conv layers, R runs of equal conv group.
"""

from __future__ import annotations

import torch

from . import Strategy, register

MIN_RANK = 1e-3


def layer_weights_KL(eff_rank_KL: torch.Tensor) -> torch.Tensor:
    er_KL = eff_rank_KL.clamp(min=MIN_RANK)
    return er_KL / er_KL.sum(0, keepdim=True)


def aggregate(global_P, stacks, state, hp):
    params_KP = stacks["params_KP"]
    num_clients = params_KP.shape[0]
    alpha_KL = layer_weights_KL(stacks["eff_rank_KL"].to(params_KP.dtype))
    uniform_K1 = torch.full((num_clients, 1), 1.0 / num_clients, dtype=params_KP.dtype,
                            device=params_KP.device)
    table_KG = torch.cat([uniform_K1, alpha_KL.to(params_KP.device)], dim=1)  # G = L + 1
    # Runs of equal conv_group_P: at most one per tensor of the layout. Reading their bounds is
    # the one host sync of this rule. The +1 (group -1 -> table column 0) is applied to the R
    # run values, not to the int64 [P] vector: a fresh 8P-byte temporary cost more than the
    # averaging itself at K = 4.
    groups_R, lengths_R = torch.unique_consecutive(stacks["conv_group_P"], return_counts=True)
    new_global_P = torch.empty_like(global_P)
    start = 0
    for group, length in zip(groups_R.tolist(), lengths_R.tolist()):
        cols = slice(start, start + length)
        torch.mv(params_KP[:, cols].T, table_KG[:, group + 1], out=new_global_P[cols])
        start += length
    return new_global_P, state, {"feder_alpha": alpha_KL}


FEDER = register(Strategy("feder", aggregate, needs=frozenset({"eff_rank_KL", "conv_group_P"}),
                          doc=__doc__))
