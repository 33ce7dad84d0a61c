"""FedER (seed 003, Alg. 4): average each conv layer with weights proportional to the clients'
effective rank of that layer.

  er_kl    = max(1e-3, ER_kl)          (ER of client k's layer l: fedddp.metrics.effective_rank)
  alpha_kl = er_kl / sum_k er_kl
  W_l      = sum_k alpha_kl W_kl        (not sample-weighted)
Every other element (bias, BatchNorm, FC, and buffers) takes the alpha of the conv layer it
follows (the flat layout's ``conv_group_P``); elements before the first conv layer take
uniform weights 1/K. Freshly initialised kernels have EVBMF rank 0, so early rounds clamp every
client to 1e-3 and reduce to the uniform mean (expected).

The layout's runs of columns that follow one conv layer (``conv_runs_R3``: at most one per
tensor, 62 for ResNet-18 with buffers) each take one column of the small [K, L+1] weight table
(column 0 = uniform): one fused pass over the params on CPU and CUDA (the same kernel as
FedAvg, with a weight vector per run), one matrix-vector product per run in the torch ops. No
[K, P] weight matrix is built and the params are read once. Diagnostics: feder_alpha_KL, each
client's weight per conv layer (clients.jsonl).
Legend: K sampled clients, P flat parameters, L conv layers, R runs of equal conv group.
"""

from __future__ import annotations

import torch

from ..flat import runs_within
from . import kernels
from ..params import one_of
from .base import Strategy, register

MIN_RANK = 1e-3


def layer_weights_KL(eff_rank_KL: torch.Tensor) -> torch.Tensor:
    er_KL = eff_rank_KL.clamp(min=MIN_RANK)
    return er_KL / er_KL.sum(0, keepdim=True)


def _table_KG(stacks) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha_KL, the [K, L+1] weight table: column 0 uniform, column l + 1 conv layer l)."""
    params_KP = stacks["params_KP"]
    num_clients = params_KP.shape[0]
    alpha_KL = layer_weights_KL(stacks["eff_rank_KL"].to(params_KP.dtype))
    uniform_K1 = torch.full((num_clients, 1), 1.0 / num_clients, dtype=params_KP.dtype,
                            device=params_KP.device)
    return alpha_KL, torch.cat([uniform_K1, alpha_KL.to(params_KP.device)], dim=1)  # G = L + 1


def _columns(global_P, params_KP, table_KG, runs_R3):
    """Each run of columns averaged with its conv layer's weights."""
    weights_RK = table_KG[:, runs_R3[:, 2].to(table_KG.device) + 1].T
    lib = kernels.lib(params_KP, rule="feder")
    if lib is not None:
        bounds_R1 = torch.cat([runs_R3[:, 0], runs_R3[-1:, 1]]).cpu()
        return kernels.mix(lib, params_KP, weights_RK, bounds_R1)
    new_global_P = torch.empty_like(global_P)
    for r, (start, stop, _) in enumerate(runs_R3.tolist()):  # one host sync: the run bounds
        # w @ rows, as FedAvg's torch form: its column sums do not depend on where a range cuts
        # the run (torch.mv over the transposed rows did on an AVX-512 CPU)
        new_global_P[start:stop] = weights_RK[r] @ params_KP[:, start:stop]
    return new_global_P


def aggregate(global_P, stacks, state, hp):
    alpha_KL, table_KG = _table_KG(stacks)
    return _columns(global_P, stacks["params_KP"], table_KG, stacks["conv_runs_R3"]), state, {"feder_alpha_KL": alpha_KL}


def aggregate_span(global_P, stacks, state, hp, span):
    """Block by block over this rank's range, each block with the runs that cross it
    (Strategy.aggregate_span)."""
    alpha_KL, table_KG = _table_KG(stacks)
    params_KP, runs_R3 = stacks["params_KP"], stacks["conv_runs_R3"].cpu()
    new_P = torch.empty_like(global_P)
    for b in span.blocks:
        new_P[b] = _columns(global_P[b], params_KP[:, b], table_KG, runs_within(runs_R3, b.start, b.stop))
    return new_P, state, {"feder_alpha_KL": alpha_KL}


FEDER = register(Strategy("feder", aggregate, needs=frozenset({"eff_rank_KL", "conv_runs_R3"}),
                          doc=__doc__, aggregate_span=aggregate_span, params={"feder_unfold": "average"},
                          check_params=lambda params: one_of(params, "feder_unfold", ("average", "out", "in")),
                          param_docs={"feder_unfold": "FedER: conv kernel unfolding for the effective rank "
                                                      "(computed on the clients): output mode (out), input "
                                                      "mode (in), or the mean of both (average)."}))
