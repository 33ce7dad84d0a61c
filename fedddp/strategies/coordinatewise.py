"""Coordinate-wise robust means: FedMedian and FedTrimmedAvg (Yin et al. 2018, "Byzantine-Robust
Distributed Learning: Towards Optimal Statistical Rates", Definitions 1 and 2), the rules of
Flower's FedMedian and FedTrimmedAvg.

  fedmedian:      w_j = median_k w_kj   (K even: the mean of the two middle values, as numpy's
                                         median and so Flower's)
  fedtrimmedavg:  b = floor(beta K); w_j = the mean of w_kj over the K - 2b clients left when the
                  b largest and the b smallest values of coordinate j are left out
                  (beta = algorithm.params.trim_beta in [0, 0.5), 0.2 as Flower's)

Both are unweighted, as in the paper and in Flower: algorithm.weighting only weights the reported
train_loss. Each coordinate is a sort over the client axis. The fused form (kernels.sorted_mean:
kernels.c's fd_sorted_mean on CPU, triton_kernels' _sorted_mean_kernel on CUDA, where the probe or
FEDDDP_KERNELS chooses it and K <= kernels.SORT_MAX_CLIENTS) sorts and averages in one pass; the
torch form is torch.sort along dim 0 of the [K, P] stack, a piece of columns at a time so that
its [K, C] values and int64 indices stay about 1 MiB on CPU, then the fused uniform mean (C,
Triton or torch ops: weighted_mean_P) of the rows kept. The kernels sum the kept values in order
with the mean kernel's arithmetic (NaN sorted last, as torch.sort), so both forms give the same
bits where FedAvg's form is the C kernel. beta = 0 sorts nothing and is uniform FedAvg bit for
bit in either form. b takes floor with a 1e-9 slack
(0.29 x 100 is 28.999999999999996: 29, where Flower's int() trims 28). No state, no server step
(algorithm.server_lr is refused). Sharded: every coordinate is its own, so each rank runs the
same on its columns. Legend: K clients that reported, P flat parameters, C columns of a piece,
R rows kept.
"""

from __future__ import annotations

import math

import torch

from . import kernels
from .base import Span, Strategy, column_block, gathered, register, weighted_mean_P


def pieces(span: Span, num_rows: int) -> list[list[slice]]:
    """This range's blocks (counted from its start), each as pieces of at most column_block
    columns for [num_rows, C] float32 temporaries: the same pieces of a block on any rank."""
    step = column_block(num_rows, span.device)
    return [[slice(c, min(c + step, b.stop)) for c in range(b.start, b.stop, step)] for b in span.blocks]


def by_columns(global_P, params_KP, span: Span, temporaries: int, columns_fn) -> torch.Tensor:
    """The new range, columns_fn(params_KC) -> new_C piece by piece over this rank's columns;
    ``temporaries``: [K, C] float32 temporaries that columns_fn makes at once."""
    new_P = torch.empty_like(global_P)
    for block in pieces(span, temporaries * params_KP.shape[0]):
        for c in block:
            new_P[c] = columns_fn(params_KP[:, c])
    return new_P


def uniform_mean_C(rows_RC: torch.Tensor) -> torch.Tensor:
    """(1/R) sum_r rows_r through the fused mean, with client_weights_K's uniform weights (1/R as
    ones / their sum), so that all K rows in client-id order give uniform FedAvg's bits."""
    ones_R = torch.ones(rows_RC.shape[0], dtype=rows_RC.dtype, device=rows_RC.device)
    return weighted_mean_P(ones_R / ones_R.sum(), rows_RC)


def median_C(rows_KC: torch.Tensor) -> torch.Tensor:
    """The median over the client axis; K even: (lower + upper middle value) / 2, numpy's bits."""
    num_rows = rows_KC.shape[0]
    sorted_KC = torch.sort(rows_KC, dim=0).values
    low_C, high_C = sorted_KC[(num_rows - 1) // 2], sorted_KC[num_rows // 2]
    return low_C.clone() if num_rows % 2 else (low_C + high_C) / 2


def num_trimmed(beta: float, num_clients: int) -> int:
    """b = floor(beta K), with a 1e-9 slack: 0.29 * 100 is 28.999999999999996."""
    return max(0, math.floor(beta * num_clients + 1e-9))


def trimmed_mean_C(rows_KC: torch.Tensor, num_trim: int) -> torch.Tensor:
    if num_trim == 0:          # nothing left out: the mean in client-id order, FedAvg's bits
        return uniform_mean_C(rows_KC)
    num_rows = rows_KC.shape[0]
    return uniform_mean_C(torch.sort(rows_KC, dim=0).values[num_trim:num_rows - num_trim])


def fused_sorted_mean(rule: str, params_KP: torch.Tensor, lo: int, hi: int, median: bool):
    """The fused form's new range (kernels.sorted_mean: the C kernel on CPU, Triton on CUDA) where
    the rule takes it and K fits its sort, else None: the torch ops. Every column is its own, so
    the kernel on a span's columns gives the gathered form's bits for them."""
    if params_KP.shape[0] > kernels.SORT_MAX_CLIENTS:
        return None
    lib = kernels.lib(params_KP, rule=rule)
    return None if lib is None else kernels.sorted_mean(lib, params_KP, lo, hi, median)


def _median_span(global_P, stacks, state, hp, span):
    """Strategy.aggregate_span: each column's median, fused or piece by piece (the sort: values +
    indices)."""
    params_KP = stacks["params_KP"]
    num_rows = params_KP.shape[0]
    new_P = fused_sorted_mean("fedmedian", params_KP, (num_rows - 1) // 2, num_rows // 2 + 1, median=True)
    if new_P is None:
        new_P = by_columns(global_P, params_KP, span, 3, median_C)
    return new_P.to(global_P.dtype), state, {}


def _trimmed_span(global_P, stacks, state, hp, span):
    params_KP = stacks["params_KP"]
    num_rows = params_KP.shape[0]
    num_trim = num_trimmed(hp.params["trim_beta"], num_rows)
    # nothing trimmed: uniform FedAvg's form and bits, whatever form this rule takes
    new_P = (fused_sorted_mean("fedtrimmedavg", params_KP, num_trim, num_rows - num_trim, median=False)
             if num_trim else None)
    if new_P is None:
        new_P = by_columns(global_P, params_KP, span, 4, lambda rows_KC: trimmed_mean_C(rows_KC, num_trim))
    return new_P.to(global_P.dtype), state, {}


def check_trim(params: dict) -> list[str]:
    beta = params["trim_beta"]
    return [] if 0.0 <= beta < 0.5 else [f"algorithm.params.trim_beta: must be in [0, 0.5), got {beta!r}"]


FEDMEDIAN = register(Strategy("fedmedian", gathered(_median_span), doc=__doc__, aggregate_span=_median_span))
FEDTRIMMEDAVG = register(Strategy("fedtrimmedavg", gathered(_trimmed_span), doc=__doc__,
                                  aggregate_span=_trimmed_span, params={"trim_beta": 0.2}, check_params=check_trim,
                                  param_docs={"trim_beta": "FedTrimmedAvg: the fraction beta of clients left out "
                                                           "at each end of every coordinate, in [0, 0.5) (0 gives "
                                                           "uniform FedAvg)."}))
