"""Fused GPU forms of the server rules as Triton kernels: one pass over the stacked [K, P]
float32 reports per rule, the GPU counterpart of kernels.c.

Imported only when a rule runs on CUDA tensors (or on CPU tensors under Triton's interpreter,
``TRITON_INTERPRET=1``, which is how the tests run these kernels without a GPU): importing
triton costs start-up time that a CPU run never pays (tests/test_fast_start.py).

Shape of every kernel: a program owns a block of BLOCK columns and walks the K client rows in
order, k = 0 .. K-1, keeping its per-column sums, counts and masks in registers; it writes its
columns of the [P] output and, for sums over columns (FedMom's norm, FedGMA's mask density,
FedCong's group counts, CGW's statistics), one partial per program that torch then adds in a
fixed order. No atomics, so the bits do not depend on scheduling; columns are independent, so
the [P] outputs do not depend on the grid or the block size either (CGW's only through its
weights x, whose float64 statistics are summed per block).

The arithmetic is kernels.c's: every kernel forms the p-weighted mean of the params as
``acc = 0; acc = acc + p_k * w_kj`` (``_weighted_rows``), and the kernels are compiled without
fused multiply-add (``enable_fp_fusion=False``), as kernels.c is built with -ffp-contract=off.
So the neutral settings (FedMom momentum 0, CGW alpha 0, FedGMA server_lr 0) return the mean
kernel's vector bit for bit, as on CPU. CGW's statistics (||D_k||^2 and D_k . D with
D = sum_k D_k) are float64 sums, as in kernels.c, for the precision cgw.py explains; they are
summed as trees inside a program, so they agree with the C kernel to float64 rounding only.

Row k of a stack starts at base + k * ld (ld >= P in floats: round.py hands the rules column
slices of its gather buffer); the row offset is carried in 64 bits, so K * ld may pass 2^31.
Loads are vectorised (4 floats) only in full blocks (no mask) of stacks whose every row starts
on 16 bytes, which the host checks and passes as ALIGNED.
Legend: K clients, P columns, R runs of columns sharing one weight vector (FedER), G programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# True when the kernels below were defined under TRITON_INTERPRET=1 (decoration time decides):
# they then run on CPU tensors through numpy and cannot run on a GPU.
INTERPRETED = bool(triton.knobs.runtime.interpret)

# Columns per program of the row-walking kernels: 1024 floats over 4 warps is two 16-byte loads
# per thread and row; ResNet-18's 11.2M columns make about 11,000 programs, several waves on
# any GPU. Not tuned on a GPU yet (BENCHMARKS.md). The tests shrink it to cross block edges.
BLOCK = 1024
NUM_WARPS = 4
# Elements of the [KC, B] register tile of CGW's statistics pass (KC clients by B columns).
STATS_TILE = 4096
# Most clients one statistics tile holds; more clients are read in chunks of this many, twice.
STATS_MAX_CLIENTS = 128
# Elements of the [KC, B] register tile of the column sorts (FedMedian, FedTrimmedAvg), and the
# most clients one holds (kernels.SORT_MAX_CLIENTS: more take the torch ops).
SORT_TILE = 4096
SORT_MAX_CLIENTS = 256
# kernels.c's arithmetic: no multiply-add contraction (the interpreter ignores the option).
OPTIONS = {"num_warps": NUM_WARPS, "enable_fp_fusion": False}


# Only builtins of triton.language below, no functions of its standard library (tl.zeros,
# tl.sum): those are jit functions, interpreted only if TRITON_INTERPRET=1 was set before triton
# itself was imported, which a test session cannot promise.
@triton.jit
def _add(a, b):
    return a + b


# triton's own combine of tl.sum where it has one: the interpreter then sums with numpy instead
# of element by element in Python (compiled, any associative combine gives the same tree)
_SUM_COMBINE = getattr(tl.standard, "_sum_combine", _add)


@triton.jit
def _sum(values, axis: tl.constexpr):
    return tl.reduce(values, axis, _SUM_COMBINE)


@triton.jit
def _load(base, offset, cols, inside, FULL: tl.constexpr, ALIGNED: tl.constexpr):
    """(base + offset)[cols]: in a full block without a mask, so that the compiler can vectorise
    the loads (a mask on cols < P, P not a multiple of 16, keeps every load scalar); ALIGNED:
    the host checked that base + offset starts on 16 bytes (every row of the stack), which the
    compiler cannot prove. (The hint must sit on a pointer computed here: on an argument of
    this function it would be dropped.)"""
    ptr = base + offset
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    if FULL:
        values = tl.load(ptr + cols)
    else:
        values = tl.load(ptr + cols, mask=inside, other=0.0)
    return values


@triton.jit
def _store(ptr, cols, values, inside, FULL: tl.constexpr):
    if FULL:
        tl.store(ptr + cols, values)
    else:
        tl.store(ptr + cols, values, mask=inside)


@triton.jit
def _weighted_rows(rows, ld, K, p, cols, inside, BLOCK: tl.constexpr, FULL: tl.constexpr,
                   ALIGNED: tl.constexpr):
    """acc_j = sum_k p_k rows[k, j] over k in order: the mean every kernel shares."""
    acc = tl.full([BLOCK], 0, tl.float32)
    offset = tl.full([], 0, tl.int64)                      # k * ld, in 64 bits
    for k in range(K):
        acc = acc + tl.load(p + k) * _load(rows, offset, cols, inside, FULL, ALIGNED)
        offset += ld
    return acc


# Each kernel below is a block function with FULL a compile-time flag, and an entry that calls
# it with FULL = True in every program but the one holding the last, partial block.

@triton.jit
def _mean_block(rows, ld, K, P, p, out, pid, BLOCK: tl.constexpr, FULL: tl.constexpr,
                ALIGNED: tl.constexpr):
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    inside = cols < P
    _store(out, cols, _weighted_rows(rows, ld, K, p, cols, inside, BLOCK, FULL, ALIGNED), inside,
           FULL)


@triton.jit
def _mean_kernel(rows, ld, K, P, p, out, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    pid = tl.program_id(0)
    if (pid + 1) * BLOCK <= P:
        _mean_block(rows, ld, K, P, p, out, pid, BLOCK, True, ALIGNED)
    else:
        _mean_block(rows, ld, K, P, p, out, pid, BLOCK, False, ALIGNED)


@triton.jit
def _mix_block(rows, ld, K, weights, start, stop, block, out, BLOCK: tl.constexpr,
               FULL: tl.constexpr, ALIGNED: tl.constexpr):
    cols = block * BLOCK + tl.arange(0, BLOCK)
    inside = (cols >= start) & (cols < stop)
    _store(out, cols, _weighted_rows(rows, ld, K, weights, cols, inside, BLOCK, FULL, ALIGNED),
           inside, FULL)


@triton.jit
def _mix_kernel(rows, ld, K, weights_RK, tile_run, tile_block, bounds, out, BLOCK: tl.constexpr,
                ALIGNED: tl.constexpr):
    """One tile = one run's columns inside one aligned block of BLOCK columns (a block that
    holds several runs is one tile per run), so loads stay aligned to the block."""
    t = tl.program_id(0)
    run = tl.load(tile_run + t)
    block = tl.load(tile_block + t)
    start = tl.load(bounds + run)
    stop = tl.load(bounds + run + 1)
    if (start <= block * BLOCK) & ((block + 1) * BLOCK <= stop):
        _mix_block(rows, ld, K, weights_RK + run * K, start, stop, block, out, BLOCK, True, ALIGNED)
    else:
        _mix_block(rows, ld, K, weights_RK + run * K, start, stop, block, out, BLOCK, False,
                   ALIGNED)


@triton.jit
def _fedmom_block(rows, ld, K, P, p, g, g_prev, momentum, lr, out, sq_parts, pid,
                  BLOCK: tl.constexpr, FULL: tl.constexpr, ALIGNED: tl.constexpr):
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    inside = cols < P
    mean = _weighted_rows(rows, ld, K, p, cols, inside, BLOCK, FULL, ALIGNED)
    gv = _load(g, 0, cols, inside, FULL, False)
    gp = _load(g_prev, 0, cols, inside, FULL, False)
    mean = tl.where(lr != 1.0, gv + lr * (mean - gv), mean)  # the server step; lr = 1: the mean
    w_new = mean + momentum * (gv - gp)
    v = w_new - gv
    _store(out, cols, w_new, inside, FULL)
    tl.store(sq_parts + pid, _sum(tl.where(inside, v * v, 0.0).to(tl.float64), axis=0))


@triton.jit
def _fedmom_kernel(rows, ld, K, P, p, g, g_prev, momentum, lr, out, sq_parts,
                   BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """out = mean + m (g - g_prev), with g + lr (mean - g) for the mean when lr != 1; partial
    sum of (out - g)^2, in float64, per program."""
    pid = tl.program_id(0)
    if (pid + 1) * BLOCK <= P:
        _fedmom_block(rows, ld, K, P, p, g, g_prev, momentum, lr, out, sq_parts, pid, BLOCK, True,
                      ALIGNED)
    else:
        _fedmom_block(rows, ld, K, P, p, g, g_prev, momentum, lr, out, sq_parts, pid, BLOCK, False,
                      ALIGNED)


@triton.jit
def _cgw_block(W, D, ldw, ldd, K, P, p, x, out, pid, BLOCK: tl.constexpr, FULL: tl.constexpr,
               ALIGNED: tl.constexpr):
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    inside = cols < P
    mean = _weighted_rows(W, ldw, K, p, cols, inside, BLOCK, FULL, ALIGNED)
    correction = _weighted_rows(D, ldd, K, x, cols, inside, BLOCK, FULL, ALIGNED)
    _store(out, cols, mean - correction, inside, FULL)


@triton.jit
def _cgw_kernel(W, D, ldw, ldd, K, P, p, x, out, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """out = sum_k p_k w_k - sum_k x_k d_k; x = 0 subtracts +0 and leaves the mean's bits."""
    pid = tl.program_id(0)
    if (pid + 1) * BLOCK <= P:
        _cgw_block(W, D, ldw, ldd, K, P, p, x, out, pid, BLOCK, True, ALIGNED)
    else:
        _cgw_block(W, D, ldw, ldd, K, P, p, x, out, pid, BLOCK, False, ALIGNED)


@triton.jit
def _stats_tile(D, ld, K, k0, cols, inside, KC: tl.constexpr, FULL: tl.constexpr,
                ALIGNED: tl.constexpr):
    """Rows k0 .. k0 + KC of D over the block's columns, as float64 (zeros past K and P)."""
    rows = k0 + tl.arange(0, KC)
    starts = D + rows.to(tl.int64) * ld
    if ALIGNED:
        starts = tl.multiple_of(starts, 16)
    if FULL:
        take = (rows[:, None] < K) & (cols[None, :] >= 0)   # constant along the columns
    else:
        take = (rows[:, None] < K) & inside[None, :]
    return tl.load(starts[:, None] + cols[None, :], mask=take, other=0.0).to(tl.float64), rows


@triton.jit
def _cgw_stats_block(D, ld, K, P, sq_parts, dot_parts, pid, KC: tl.constexpr, B: tl.constexpr,
                     ONE_TILE: tl.constexpr, FULL: tl.constexpr, ALIGNED: tl.constexpr):
    cols = pid * B + tl.arange(0, B)
    inside = cols < P
    if ONE_TILE:
        d, rows = _stats_tile(D, ld, K, 0, cols, inside, KC, FULL, ALIGNED)
        total = _sum(d, axis=0)                            # D over the block's columns
        tl.store(sq_parts + pid * K + rows, _sum(d * d, axis=1), mask=rows < K)
        tl.store(dot_parts + pid * K + rows, _sum(d * total[None, :], axis=1), mask=rows < K)
    else:
        total = tl.full([B], 0, tl.float64)
        for k0 in range(0, K, KC):
            d, rows = _stats_tile(D, ld, K, k0, cols, inside, KC, FULL, ALIGNED)
            total = total + _sum(d, axis=0)
        for k0 in range(0, K, KC):
            d, rows = _stats_tile(D, ld, K, k0, cols, inside, KC, FULL, ALIGNED)
            tl.store(sq_parts + pid * K + rows, _sum(d * d, axis=1), mask=rows < K)
            tl.store(dot_parts + pid * K + rows, _sum(d * total[None, :], axis=1), mask=rows < K)


@triton.jit
def _cgw_stats_kernel(D, ld, K, P, sq_parts, dot_parts, KC: tl.constexpr, B: tl.constexpr,
                      ONE_TILE: tl.constexpr, ALIGNED: tl.constexpr):
    """Per program: ||D_k||^2 and D_k . D over its B columns, for every k, in float64.
    With K <= KC the [KC, B] tile of D is read once and kept in registers for both sums
    (a second walk over the rows would come back from DRAM once many programs share L2)."""
    pid = tl.program_id(0)
    if (pid + 1) * B <= P:
        _cgw_stats_block(D, ld, K, P, sq_parts, dot_parts, pid, KC, B, ONE_TILE, True, ALIGNED)
    else:
        _cgw_stats_block(D, ld, K, P, sq_parts, dot_parts, pid, KC, B, ONE_TILE, False, ALIGNED)


@triton.jit
def _fedgma_block(W, G, ldw, ldg, K, num_clients, P, p, g, need, eta, out, mask_parts, pid,
                  HAS_G: tl.constexpr, SOFT: tl.constexpr, BLOCK: tl.constexpr,
                  FULL: tl.constexpr, ALIGNED: tl.constexpr):
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    inside = cols < P
    gv = _load(g, 0, cols, inside, FULL, False)
    mean = tl.full([BLOCK], 0, tl.float32)
    grad = tl.full([BLOCK], 0, tl.float32)
    signs = tl.full([BLOCK], 0, tl.int32)
    w_offset = tl.full([], 0, tl.int64)
    g_offset = tl.full([], 0, tl.int64)
    for k in range(K):
        pk = tl.load(p + k)
        w = _load(W, w_offset, cols, inside, FULL, ALIGNED)
        if HAS_G:
            gk = _load(G, g_offset, cols, inside, FULL, ALIGNED)
            g_offset += ldg
        else:
            gk = gv - w
        mean = mean + pk * w                               # _weighted_rows' arithmetic
        grad = grad + pk * gk
        signs += (gk > 0).to(tl.int32) - (gk < 0).to(tl.int32)
        w_offset += ldw
    agree = tl.abs(signs)
    passed = agree >= need
    mask = tl.where(passed, 1.0, 0.0)
    if SOFT:
        mask = tl.where(passed, 1.0, agree.to(tl.float32) / num_clients)
    _store(out, cols, mean - eta * (grad * mask), inside, FULL)
    tl.store(mask_parts + pid, _sum(tl.where(inside, mask, 0.0).to(tl.float64), axis=0))


@triton.jit
def _fedgma_kernel(W, G, ldw, ldg, K, num_clients, P, p, g, need, eta, out, mask_parts,
                   HAS_G: tl.constexpr, SOFT: tl.constexpr, BLOCK: tl.constexpr,
                   ALIGNED: tl.constexpr):
    """out = mean - eta * mask * sum_k p_k g_k with mask from |sum_k sign(g_kj)| >= need
    (soft: the agreement / K below it); without G, g_k = g - w_k. Partial mask sum per program."""
    pid = tl.program_id(0)
    if (pid + 1) * BLOCK <= P:
        _fedgma_block(W, G, ldw, ldg, K, num_clients, P, p, g, need, eta, out, mask_parts, pid,
                      HAS_G, SOFT, BLOCK, True, ALIGNED)
    else:
        _fedgma_block(W, G, ldw, ldg, K, num_clients, P, p, g, need, eta, out, mask_parts, pid,
                      HAS_G, SOFT, BLOCK, False, ALIGNED)


@triton.jit
def _fedcong_block(W, ld, K, P, p, g, need, out, took_parts, pid, BLOCK: tl.constexpr,
                   FULL: tl.constexpr, ALIGNED: tl.constexpr):
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    inside = cols < P
    gv = _load(g, 0, cols, inside, FULL, False)
    num_pos = tl.full([BLOCK], 0, tl.int32)
    num_neg = tl.full([BLOCK], 0, tl.int32)
    p_pos = tl.full([BLOCK], 0, tl.float32)
    p_neg = tl.full([BLOCK], 0, tl.float32)
    w_pos = tl.full([BLOCK], 0, tl.float32)
    w_neg = tl.full([BLOCK], 0, tl.float32)
    w_all = tl.full([BLOCK], 0, tl.float32)
    p_all = tl.full([], 0, tl.float32)                   # the weight of all clients, in order
    offset = tl.full([], 0, tl.int64)
    for k in range(K):
        pk = tl.load(p + k)
        w = _load(W, offset, cols, inside, FULL, ALIGNED)
        pw = pk * w
        above = w > gv
        below = w < gv
        num_pos += above.to(tl.int32)
        num_neg += below.to(tl.int32)
        p_pos = p_pos + tl.where(above, pk, 0.0)
        p_neg = p_neg + tl.where(below, pk, 0.0)
        w_pos = w_pos + tl.where(above, pw, 0.0)
        w_neg = w_neg + tl.where(below, pw, 0.0)
        w_all = w_all + pw
        p_all = p_all + pk
        offset += ld
    take_pos = num_pos >= need
    take_neg = num_neg >= need
    # both may qualify: the larger count wins, ties positive (an empty group never: need >= 1)
    take_neg = take_neg & ~(take_pos & (num_pos >= num_neg))
    take_pos = take_pos & ~take_neg
    num = tl.where(take_pos, w_pos, tl.where(take_neg, w_neg, w_all))
    den = tl.where(take_pos, p_pos, tl.where(take_neg, p_neg, p_all))
    _store(out, cols, num / den, inside, FULL)
    tl.store(took_parts + 2 * pid, _sum((take_pos & inside).to(tl.int32), axis=0))
    tl.store(took_parts + 2 * pid + 1, _sum((take_neg & inside).to(tl.int32), axis=0))


@triton.jit
def _fedcong_kernel(W, ld, K, P, p, g, need, out, took_parts, BLOCK: tl.constexpr,
                    ALIGNED: tl.constexpr):
    """Per column the p-weighted mean of the clients above (below) g when at least `need` are,
    the larger count winning (ties positive), else of all clients; per program the number of
    columns that took each group."""
    pid = tl.program_id(0)
    if (pid + 1) * BLOCK <= P:
        _fedcong_block(W, ld, K, P, p, g, need, out, took_parts, pid, BLOCK, True, ALIGNED)
    else:
        _fedcong_block(W, ld, K, P, p, g, need, out, took_parts, pid, BLOCK, False, ALIGNED)


@triton.jit
def _sorted_mean_kernel(W, ld, K, P, lo, hi, weight, out, KC: tl.constexpr, B: tl.constexpr,
                        MEDIAN: tl.constexpr):
    """Per column of a block of B, the rows [lo, hi) of its K values sorted ascending (NaN last,
    as torch.sort): their mean, acc = acc + weight * v_r for r = lo .. hi-1 in order (kernels.c's
    fd_sorted_mean), or with MEDIAN (v_lo + v_hi-1) / 2. A sort without sorting: each value's
    rank among its column's K (the values before it, equal ones by client id) is a permutation
    of 0 .. K-1, and v_r is the one value of rank r, summed out of the tile with -0.0 for the
    others (x + -0.0 is x), so the bits are the C kernel's."""
    pid = tl.program_id(0)
    cols = pid * B + tl.arange(0, B)
    clients = tl.arange(0, KC)[:, None]
    inside = cols < P
    real = clients < K                                      # [KC, 1]: rows past K are padding
    tile = tl.load(W + clients.to(tl.int64) * ld + cols[None, :], mask=real & inside[None, :],
                   other=0.0)
    tile_nan = tile != tile
    rank = tl.full([KC, B], 0, tl.int32)
    offset = tl.full([], 0, tl.int64)                       # i * ld, in 64 bits
    for i in range(K):
        row = tl.load(W + offset + cols, mask=inside, other=0.0)[None, :]
        row_nan = row != row
        below = (row < tile) | (tile_nan & ~row_nan)
        tied_before = ((row == tile) | (tile_nan & row_nan)) & (i < clients)
        rank += (below | tied_before).to(tl.int32)
        offset += ld
    if MEDIAN:
        low = _sum(tl.where(real & (rank == lo), tile, -0.0), axis=0)
        high = _sum(tl.where(real & (rank == hi - 1), tile, -0.0), axis=0)
        result = tl.where(lo == hi - 1, low, (low + high) / 2.0)
    else:
        result = tl.full([B], 0, tl.float32)
        for r in range(lo, hi):
            result = result + weight * _sum(tl.where(real & (rank == r), tile, -0.0), axis=0)
    tl.store(out + cols, result, mask=inside)


# -- calls: the same arguments and results as kernels.py's C wrappers (minus the library), with
# scalars as 0-d tensors on the device (no host synchronisation). --

def _vector(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=torch.float32).contiguous()


def _aligned(*stacks_KP: torch.Tensor) -> bool:
    """Every row of every stack starts on 16 bytes: the kernels may then load 4 floats at once."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 4 == 0 for t in stacks_KP)


def _programs(num_params: int) -> int:
    return max(1, triton.cdiv(num_params, BLOCK))


def mean(rows_KP: torch.Tensor, weights_K: torch.Tensor) -> torch.Tensor:
    """out_j = sum_k weights_k rows_kj."""
    num_clients, num_params = rows_KP.shape
    out_P = torch.empty(num_params, dtype=torch.float32, device=rows_KP.device)
    _mean_kernel[(_programs(num_params),)](rows_KP, rows_KP.stride(0), num_clients, num_params,
                                           _vector(weights_K, rows_KP.device), out_P,
                                           BLOCK=BLOCK, ALIGNED=_aligned(rows_KP), **OPTIONS)
    return out_P


_tiles_cache: dict = {}


def _tiles(bounds: tuple[int, ...], device: torch.device):
    """(run, block) of every tile, the aligned blocks of BLOCK columns each run touches, and
    the bounds, on the device. The layout is fixed for a run, so they are made once (per block
    size and device), not copied to the device every round."""
    key = (bounds, BLOCK, str(device))
    if key not in _tiles_cache:
        bounds_R1 = torch.tensor(bounds, dtype=torch.int64)
        start_R, stop_R = bounds_R1[:-1], bounds_R1[1:]
        nonempty_R = stop_R > start_R
        first_R = start_R // BLOCK
        count_R = torch.where(nonempty_R, (stop_R - 1) // BLOCK - first_R + 1, 0)
        run_T = torch.repeat_interleave(torch.arange(len(start_R)), count_R)
        offset_T = torch.arange(len(run_T)) - (count_R.cumsum(0) - count_R)[run_T]
        block_T = first_R[run_T] + offset_T
        _tiles_cache.clear()        # one model per process: keep only the latest layout
        _tiles_cache[key] = (run_T.to(torch.int32).to(device), block_T.to(torch.int32).to(device),
                             bounds_R1.to(device))
    return _tiles_cache[key]


def mix(rows_KP: torch.Tensor, weights_RK: torch.Tensor, bounds_R1: torch.Tensor) -> torch.Tensor:
    """out_j = sum_k weights[r, k] rows_kj for the columns [bounds[r], bounds[r + 1]) of run r."""
    num_clients, num_params = rows_KP.shape
    device = rows_KP.device
    run_T, block_T, bounds_dev = _tiles(tuple(bounds_R1.tolist()), device)
    out_P = torch.empty(num_params, dtype=torch.float32, device=device)
    if len(run_T):
        _mix_kernel[(len(run_T),)](rows_KP, rows_KP.stride(0), num_clients,
                                   _vector(weights_RK, device), run_T, block_T,
                                   bounds_dev, out_P,
                                   BLOCK=BLOCK, ALIGNED=_aligned(rows_KP), **OPTIONS)
    return out_P


def fedmom(rows_KP, weights_K, global_P, previous_P, momentum: float, server_lr: float = 1.0):
    """(mean + m (w - w_prev), ||that - w||^2 as a 0-d float64 tensor); server_lr != 1:
    w + lr (mean - w) in place of the mean."""
    num_clients, num_params = rows_KP.shape
    device = rows_KP.device
    out_P = torch.empty(num_params, dtype=torch.float32, device=device)
    sq_G = torch.empty(_programs(num_params), dtype=torch.float64, device=device)
    _fedmom_kernel[(len(sq_G),)](rows_KP, rows_KP.stride(0), num_clients, num_params,
                                 _vector(weights_K, device), _vector(global_P, device),
                                 _vector(previous_P, device), float(momentum), float(server_lr),
                                 out_P, sq_G,
                                 BLOCK=BLOCK, ALIGNED=_aligned(rows_KP), **OPTIONS)
    return out_P, sq_G.sum()


def cgw(rows_KP, grads_KP, weights_K, x_K):
    """sum_k p_k w_k - sum_k x_k D_k."""
    num_clients, num_params = rows_KP.shape
    device = rows_KP.device
    out_P = torch.empty(num_params, dtype=torch.float32, device=device)
    _cgw_kernel[(_programs(num_params),)](rows_KP, grads_KP, rows_KP.stride(0), grads_KP.stride(0),
                                          num_clients, num_params, _vector(weights_K, device),
                                          _vector(x_K, device), out_P, BLOCK=BLOCK,
                                          ALIGNED=_aligned(rows_KP, grads_KP), **OPTIONS)
    return out_P


def cgw_stats(grads_KP):
    """(||D_k||^2, D_k . sum_j D_j) as float64 [K] tensors, every sum in float64."""
    num_clients, num_params = grads_KP.shape
    device = grads_KP.device
    clients_tile = min(triton.next_power_of_2(num_clients), STATS_MAX_CLIENTS)
    cols_tile = max(16, STATS_TILE // clients_tile)
    programs = max(1, triton.cdiv(num_params, cols_tile))
    sq_GK = torch.empty(programs, num_clients, dtype=torch.float64, device=device)
    dot_GK = torch.empty_like(sq_GK)
    _cgw_stats_kernel[(programs,)](grads_KP, grads_KP.stride(0), num_clients, num_params, sq_GK,
                                   dot_GK, KC=clients_tile, B=cols_tile,
                                   ONE_TILE=num_clients <= clients_tile,
                                   ALIGNED=_aligned(grads_KP), **OPTIONS)
    return sq_GK.sum(0), dot_GK.sum(0)


def fedgma(rows_KP, grads_KP, weights_K, global_P, need: int, soft: bool, server_lr: float):
    """(new global, sum of the mask as a 0-d float64 tensor); grads_KP None: g_k = w - w_k."""
    num_clients, num_params = rows_KP.shape
    device = rows_KP.device
    out_P = torch.empty(num_params, dtype=torch.float32, device=device)
    mask_G = torch.empty(_programs(num_params), dtype=torch.float64, device=device)
    has_grads = grads_KP is not None
    grads = grads_KP if has_grads else rows_KP
    _fedgma_kernel[(len(mask_G),)](rows_KP, grads, rows_KP.stride(0), grads.stride(0), num_clients,
                                   float(num_clients), num_params, _vector(weights_K, device),
                                   _vector(global_P, device), int(need), float(server_lr), out_P,
                                   mask_G, HAS_G=has_grads, SOFT=bool(soft), BLOCK=BLOCK,
                                   ALIGNED=_aligned(rows_KP, grads), **OPTIONS)
    return out_P, mask_G.sum()


def fedcong(rows_KP, weights_K, global_P, need: int):
    """(new global, columns that took the positive group, the negative group: 0-d int64)."""
    num_clients, num_params = rows_KP.shape
    device = rows_KP.device
    out_P = torch.empty(num_params, dtype=torch.float32, device=device)
    took_G2 = torch.empty(_programs(num_params), 2, dtype=torch.int32, device=device)
    _fedcong_kernel[(len(took_G2),)](rows_KP, rows_KP.stride(0), num_clients, num_params,
                                     _vector(weights_K, device), _vector(global_P, device),
                                     int(need), out_P, took_G2, BLOCK=BLOCK,
                                     ALIGNED=_aligned(rows_KP), **OPTIONS)
    took_2 = took_G2.sum(0, dtype=torch.int64)
    return out_P, took_2[0], took_2[1]


def sorted_mean(rows_KP, lo: int, hi: int, median: bool):
    """Per column, the rows [lo, hi) of its K values sorted ascending: their mean with the weight
    1 / (hi - lo) as uniform_mean_C forms it, or with ``median`` the median. K <= SORT_MAX_CLIENTS."""
    num_clients, num_params = rows_KP.shape
    device = rows_KP.device
    clients_tile = triton.next_power_of_2(num_clients)
    cols_tile = max(16, SORT_TILE // clients_tile)
    ones_R = torch.ones(hi - lo)
    weight = (ones_R / ones_R.sum())[0].item()
    out_P = torch.empty(num_params, dtype=torch.float32, device=device)
    _sorted_mean_kernel[(max(1, triton.cdiv(num_params, cols_tile)),)](
        rows_KP, rows_KP.stride(0), num_clients, num_params, int(lo), int(hi), weight, out_P,
        KC=clients_tile, B=cols_tile, MEDIAN=bool(median), **OPTIONS)
    return out_P
