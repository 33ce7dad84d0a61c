"""Effective rank of conv layers: EVBMF-denoised singular values, then their Shannon entropy
(FedER, seed 003, Algs. 2 and 4).

Legend: L <= M the sides of the matrix given to EVBMF, H = L its maximum rank, a = L / M.

EVBMF (Nakajima et al., "Global analytic solution of fully-observed variational Bayesian matrix
factorization", JMLR 2013; public code read, not copied: jacobgil/pytorch-tensor-decompositions
``VBMF/VBMF.py``, mahdihosseini/RMSGD ``matrix_factorization.py``):
  tau_bar = 2.5129 sqrt(a), x_bar = (1 + tau_bar)(1 + a / tau_bar)
  sigma^2 minimises the free energy on [lb, ub]:
    ub = ||Y||_F^2 / (L M),
    lb = max(s_{eH+1}^2 / (M x_bar), mean(s_{eH+1:}^2) / M), eH = min(ceil(L / (1+a)) - 1, H) - 1
    (0-based indices);
  components with s_h > sqrt(M sigma^2 x_bar) are kept and shrunk to
    d_h = s_h/2 (1 - (L+M) sigma^2/s_h^2 + sqrt((1 - (L+M) sigma^2/s_h^2)^2 - 4 L M sigma^4/s_h^4)).
Our choices: everything in float64 on the CPU; the singular values are the square roots of the
eigenvalues of Y Y^T (L x L, torch.linalg.eigvalsh; ~40x faster than an SVD of a 512 x 4608
kernel here, and within 1e-12 relative of it in float64; eigenvalues below L eps s_1^2 are
rounding and count as exact zeros); the free energy is minimised globally (the references
use scipy's bounded Brent, a local search; scipy is not a dependency): it is smooth between the
breakpoints s_h^2 / (M x_bar), where a component crosses the threshold, and jumps at them, so
the search evaluates every breakpoint in [lb, ub] and refines every basin a 256-point geometric
grid shows (``_minimise``).

Effective rank = -sum_h p_h ln p_h with p_h = d_h / sum d (natural log, no exp; no kept
component -> 0). A conv kernel C_out x C_in x kh x kw is unfolded with tensorly (mode "out":
``unfold(W, 0)``, C_out x C_in kh kw; mode "in": ``unfold(W, 1)``, C_in x C_out kh kw) and
transposed so rows <= cols; "average" (the default, as in the Toronto group's code) is the mean
of the two effective ranks.
"""

from __future__ import annotations

import math

import numpy as np
import torch

TAU_FACTOR = 2.5129   # tau_bar = 2.5129 sqrt(a): where the EVB free-energy branches meet
GRID_POINTS = 256
GOLDEN_STEPS = 80
UNFOLD_MODES = ("average", "out", "in")


def _free_energy(sigma2: np.ndarray, sq_s: np.ndarray, L: int, M: int, x_bar: float) -> np.ndarray:
    """EVB free energy (up to terms constant in sigma^2) for each sigma^2 (shape [G]); H = L so
    the residual and (L - H) log sigma^2 terms vanish."""
    a = L / M
    sigma2 = np.asarray(sigma2, dtype=np.float64).reshape(-1, 1)
    x = sq_s.reshape(1, -1) / (M * sigma2)                                    # [G, H]
    big = x > x_bar
    b = x - (1.0 + a)
    tau = 0.5 * (b + np.sqrt(np.clip(b * b - 4.0 * a, 0.0, None)))
    safe_x = np.where(x > 0, x, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        term_big = x - tau + np.log((tau + 1.0) / safe_x) + a * np.log(tau / a + 1.0)
    # x - ln x; for s_h = 0 drop its constant -ln s_h^2 (it never leaves this branch).
    term_small = np.where(x > 0, x - np.log(safe_x), np.log(M * sigma2) + 0.0 * x)
    return np.where(big, term_big, term_small).sum(axis=1)


def _minimise(fn, lb: float, ub: float, breaks: np.ndarray) -> float:
    """Global minimum of the free energy ``fn`` on [lb, ub] (0 < lb <= ub).

    Between two breakpoints (``breaks``: sigma^2 = s_h^2 / (M x_bar), where a component crosses
    the keep threshold) the energy is smooth; at one it jumps: the kept and the dropped branch
    meet only approximately at tau_bar = 2.5129 sqrt(a) (the kept one is higher there by up to
    ~0.009), and at the breakpoint itself the component is dropped. So the minimum lies at a
    breakpoint or at a stationary point between two, and two such minima can differ by less
    than a grid's discretisation error (a trained kernel: 35.6574 at the global one, 35.6586
    where refining only the best point of a 256-point grid stopped). Hence: a geometric grid
    with every breakpoint in [lb, ub] as a node, golden section on both sides of every node
    no higher than its neighbours (every basin the grid sees, all brackets at once), and the
    lowest of all the points evaluated."""
    nodes = np.unique(np.concatenate([np.geomspace(lb, ub, GRID_POINTS),
                                      breaks[(breaks > lb) & (breaks < ub)]]))
    values = fn(nodes)
    padded = np.concatenate([[np.inf], values, [np.inf]])
    low = np.flatnonzero((values <= padded[:-2]) & (values <= padded[2:]))
    # brackets [node_{i-1}, node_i] and [node_i, node_{i+1}]: no breakpoint inside either
    lo = np.concatenate([nodes[np.maximum(low - 1, 0)], nodes[low]])
    hi = np.concatenate([nodes[low], nodes[np.minimum(low + 1, len(nodes) - 1)]])
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fc, fd = fn(c), fn(d)
    for _ in range(GOLDEN_STEPS):
        left = fc <= fd                       # the minimum is in [lo, d]: drop (d, hi]
        hi, lo = np.where(left, d, hi), np.where(left, lo, c)
        c, d = np.where(left, hi - ratio * (hi - lo), d), np.where(left, c, lo + ratio * (hi - lo))
        f_new = fn(np.where(left, c, d))      # the one new point of each bracket
        fc, fd = np.where(left, f_new, fd), np.where(left, fc, f_new)
    points = np.concatenate([nodes, c, d])
    return float(points[int(np.argmin(np.concatenate([values, fc, fd])))])


def _as_float64_matrix(Y) -> np.ndarray:
    if isinstance(Y, torch.Tensor):
        Y = Y.detach().to("cpu", torch.float64).numpy()
    Y = np.asarray(Y, dtype=np.float64)
    if Y.ndim != 2:
        raise ValueError(f"evbmf needs a matrix, got shape {Y.shape}")
    return Y if Y.shape[0] <= Y.shape[1] else Y.T


def evbmf(Y) -> tuple[torch.Tensor, float]:
    """Empirical VB matrix factorisation of Y (any 2-D array; transposed so rows <= cols).
    Returns the shrunk singular values d (float64, descending, one per kept component) and the
    estimated noise variance sigma^2."""
    Y = _as_float64_matrix(Y)
    L, M = Y.shape
    H = L
    # s_h^2, descending. torch's LAPACK: numpy's eigvalsh was 10-40x slower on 256-512 sides here.
    Y_t = torch.from_numpy(Y)
    sq_s = torch.linalg.eigvalsh(Y_t @ Y_t.T).numpy()[::-1]
    # Below L eps s_1^2 an eigenvalue of Y Y^T is rounding, not signal: call it an exact zero.
    sq_s = np.where(sq_s > L * np.finfo(np.float64).eps * max(sq_s[0], 0.0), sq_s, 0.0)
    ub = float(sq_s.sum()) / (L * M)
    if not ub > 0:                                                            # Y = 0: nothing to find
        return torch.zeros(0, dtype=torch.float64), 0.0
    a = L / M
    tau_bar = TAU_FACTOR * math.sqrt(a)
    x_bar = (1.0 + tau_bar) * (1.0 + a / tau_bar)
    eH = min(math.ceil(L / (1.0 + a)) - 1, H) - 1
    lb = max(sq_s[eH + 1] / (M * x_bar), float(sq_s[eH + 1:].mean()) / M)
    lb = min(lb, ub) if lb > 0 else 1e-12 * ub   # exact low rank: no noise floor to search from
    breaks = sq_s[sq_s > 0] / (M * x_bar)
    sigma2 = _minimise(lambda v: _free_energy(v, sq_s, L, M, x_bar), lb, ub, breaks)

    threshold2 = M * sigma2 * x_bar                                           # keep s_h^2 > this
    kept = sq_s[sq_s > threshold2]
    s = np.sqrt(kept)
    r = 1.0 - (L + M) * sigma2 / kept
    d = s / 2.0 * (r + np.sqrt(np.clip(r * r - 4.0 * L * M * sigma2 ** 2 / kept ** 2, 0.0, None)))
    return torch.from_numpy(np.ascontiguousarray(d)), sigma2


def entropy(d) -> float:
    """Shannon entropy (natural log) of d normalised to sum 1; 0 for no (or zero) values."""
    d = torch.as_tensor(d, dtype=torch.float64).reshape(-1)
    d = d[d > 0]
    if d.numel() == 0:
        return 0.0
    p = d / d.sum()
    return float(-(p * p.log()).sum()) + 0.0  # + 0.0: one value gives 0.0, not -0.0


def _unfold_rank(weight: np.ndarray, mode: int) -> float:
    # Through tensorly's active backend (numpy unless someone switched it), back to numpy.
    import tensorly as tl  # late: its import takes about 0.5 s, and only FedER runs unfold kernels

    d, _ = evbmf(tl.to_numpy(tl.unfold(tl.tensor(weight), mode)))
    return entropy(d)


def layer_effective_rank(weight_4d, unfold: str = "average") -> float:
    """Effective rank of one conv kernel (C_out, C_in, kh, kw) under the chosen unfolding."""
    if unfold not in UNFOLD_MODES:
        raise ValueError(f"unfold: {unfold!r} is not one of {', '.join(UNFOLD_MODES)}")
    if isinstance(weight_4d, torch.Tensor):
        weight_4d = weight_4d.detach().to("cpu", torch.float64).numpy()
    weight = np.asarray(weight_4d, dtype=np.float64)
    if weight.ndim != 4:
        raise ValueError(f"layer_effective_rank needs a 4-D conv kernel, got shape {weight.shape}")
    if unfold == "out":
        return _unfold_rank(weight, 0)
    if unfold == "in":
        return _unfold_rank(weight, 1)
    return 0.5 * (_unfold_rank(weight, 0) + _unfold_rank(weight, 1))


def unfolding(hp) -> str:
    """The conv-kernel unfolding a run's clients compute effective ranks with: FedER's
    feder_unfold, or the mean of both modes for another server rule that reads eff_rank_KL (a
    plugin), which declares no such parameter."""
    return hp.params.get("feder_unfold", "average")


@torch.no_grad()
def effective_ranks_L(model: torch.nn.Module, layout, unfold: str = "average") -> torch.Tensor:
    """float32 [L] (CPU): the effective rank of each conv kernel of ``model``, in the order of
    ``layout.conv_entries()`` (the columns FedER's conv_group_P refers to)."""
    params = dict(model.named_parameters())
    ranks = [layer_effective_rank(params[e.name], unfold) for e in layout.conv_entries()]
    return torch.tensor(ranks, dtype=torch.float32)
