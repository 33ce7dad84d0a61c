"""Corrective gradient weights, CGW (Mousazadeh et al., seed 000, eqs. 13, 24-29).

Client k reports D_k, the full-batch gradient of its mean loss at its trained model, and L_k,
that loss. With D = sum_j D_j (j = k included: eq. 6, m_i = D_i . D) and alpha = hp.params["cgw_alpha"]:
  m_k = D_k . D
  c   = min_k alpha L_k / ||D_k||     (eq. 13)
  x_k = c / sqrt(sum_j (m_j / ||D_j||)^2) * m_k / ||D_k||^2     (eq. 29)
  w   = sum_k p_k w_k - sum_k x_k D_k                              (eq. 8)
so that sum_k (x_k ||D_k||)^2 = c^2 (eq. 24) and sign(x_k) = sign(m_k) (negative weights are
intended: they take back part of a dissenting client's contribution).

Precision. Near a stationary point on non-IID data the clients' gradients nearly cancel
(||D|| << ||D_k||), and m_k must come from D itself, summed in float64: a float32 Gram matrix
(m = G 1) or a float32 D loses every digit of m at ||D|| / ||D_k|| ~ 1e-3 and below. So D, the
norms and the dot products are float64 sums of the float32 reports (one fused pass on CPU and on
CUDA, a float64 block at a time in the torch ops), and c and x are float64. A client is left out
only when ||D_k|| is exactly 0; a tiny but nonzero D_k gets a huge x_k, whose product with D_k is
still bounded by c, so rows whose x_k float32 cannot hold at full precision are applied in
float64.

A client with ||D_k|| = 0 has no direction to weigh (eq. 29 divides by it): it gets x_k = 0 and
is left out of c and of the sums (it adds nothing to D either); the count is a diagnostic. If
every client is zero, or the m_k all vanish, the correction is zero: never NaN. alpha = 0
gives x = 0 exactly, so the result is FedAvg's vector bit for bit.
Diagnostics (float64): per client (clients.jsonl) cgw_x_K, the client's average weight
cgw_weight_K (p_k) and cgw_grad_norm_K (||D_k||); per round cgw_c, cgw_zero_grad_clients.
Legend: K sampled clients, P flat parameters, B columns in a block, S scaled rows.
"""

from __future__ import annotations

import torch

from . import kernels
from ..params import at_least_zero
from .base import Span, Strategy, block_width, client_weights_K, column_block, register, weighted_mean_P

# x_k outside [2^-100, 2^100] (a gradient norm far from 1) is applied in float64: float32 would
# overflow, or lose digits to subnormals, in x_k although x_k D_k itself is bounded by c.
FLOAT32_SAFE_X = 2.0 ** 100


def corrective_weights_K(sq_norm_K: torch.Tensor, m_K: torch.Tensor, loss_K: torch.Tensor,
                         alpha: float):
    """x_K, c and the number of zero-gradient clients from ||D_k||^2 and m_k (float64 math)."""
    sq_norm_K, m_K = sq_norm_K.double(), m_K.double()
    live_K = sq_norm_K > 0
    norm_K = torch.where(live_K, sq_norm_K, 1.0).sqrt()
    m_K = torch.where(live_K, m_K, 0.0)
    bound_K = torch.where(live_K, alpha * loss_K.double() / norm_K, torch.inf)
    c = bound_K.min()
    c = torch.where(torch.isfinite(c), c, 0.0)
    agreement_K = m_K / norm_K
    # sqrt(sum_j (m_j/||D_j||)^2), scaled by its largest term first so that no square overflows
    largest = agreement_K.abs().max()
    unit = torch.where(largest > 0, largest, 1.0)
    spread = unit * torch.linalg.vector_norm(agreement_K / unit)
    ok = spread > 0
    scale = torch.where(ok, c / torch.where(ok, spread, 1.0), 0.0)
    # x_k = scale * (m_k/||D_k||) / ||D_k||: no intermediate larger than x_k itself
    x_K = torch.where(live_K, scale * agreement_K / norm_K, 0.0)
    return x_K, c, (~live_K).sum()


def norms_and_agreement_K(grads_KP: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(||D_k||^2, m_k = D_k . D) for every client in float64, D = sum_k D_k summed in float64."""
    lib = kernels.lib(grads_KP, rule="cgw")
    if lib is not None:
        return kernels.cgw_stats(lib, grads_KP)
    num_clients, num_params = grads_KP.shape
    step = column_block(2 * num_clients, grads_KP.device)     # float64: twice the bytes
    sq_norm_K = torch.zeros(num_clients, dtype=torch.float64, device=grads_KP.device)
    m_K = torch.zeros_like(sq_norm_K)
    for start in range(0, num_params, step):
        grads_KB = grads_KP[:, start:start + step].double()
        m_K.addmv_(grads_KB, grads_KB.sum(0))
        sq_norm_K.add_(grads_KB.square_().sum(1))
    return sq_norm_K, m_K


def global_stats_K(grads_KP: torch.Tensor, span: Span) -> tuple[torch.Tensor, torch.Tensor]:
    """(||D_k||^2, m_k) over the whole vector: float64 per block (norms_and_agreement_K: D's
    columns of the block summed over clients), added over every block in block order, so the
    bits do not depend on which rank held a block. One block: the one call over every column."""
    num_clients = grads_KP.shape[0]
    rows = [torch.cat(norms_and_agreement_K(grads_KP[:, b])) for b in span.blocks]
    total = span.total(rows, 2 * num_clients)
    return total[:num_clients], total[num_clients:]


def _weights(stacks, hp, span: Span):
    """x_K and the round's diagnostics from the global statistics (the same on every rank)."""
    weights_K = client_weights_K(stacks, hp)
    sq_norm_K, m_K = global_stats_K(stacks["full_grad_KP"], span)
    x_K, c, num_zero = corrective_weights_K(sq_norm_K, m_K, stacks["full_loss_K"], float(hp.params["cgw_alpha"]))
    diagnostics = {"cgw_x_K": x_K, "cgw_weight_K": weights_K.double(), "cgw_grad_norm_K": sq_norm_K.sqrt(),
                   "cgw_c": c, "cgw_zero_grad_clients": num_zero.double()}
    return weights_K, x_K, diagnostics


def _columns(params_KP, grads_KP, weights_K, x_K):
    """sum_k p_k w_k - sum_k x_k D_k over the given columns."""
    size_K = x_K.abs()
    scaled_K = (size_K > FLOAT32_SAFE_X) | ((size_K < 1.0 / FLOAT32_SAFE_X) & (size_K > 0))
    x32_K = torch.where(scaled_K, 0.0, x_K).to(params_KP.dtype)
    lib = kernels.lib(params_KP, grads_KP, rule="cgw")
    if lib is not None:   # the average and the correction in one pass over W and D
        new_global_P = kernels.cgw(lib, params_KP, grads_KP, weights_K, x32_K)
    else:
        # - sum_k x_k D_k, added into the average in place (no second [P] output): x = 0 adds
        # exact zeros, so alpha = 0 still returns FedAvg's vector bit for bit
        new_global_P = weighted_mean_P(weights_K, params_KP).addmv_(grads_KP.T, x32_K, alpha=-1.0)
    if scaled_K.any():    # rare: a gradient norm far from 1 (one host sync, only then)
        rows_S = scaled_K.nonzero()[:, 0]
        correction_P = grads_KP[rows_S].double().T @ x_K[rows_S].to(grads_KP.device)
        new_global_P = new_global_P.double().sub_(correction_P).to(params_KP.dtype)
    return new_global_P


def aggregate(global_P, stacks, state, hp):
    span = Span.whole(global_P.shape[0], block_width(stacks, global_P.shape[0]), global_P.device)
    weights_K, x_K, diagnostics = _weights(stacks, hp, span)
    return _columns(stacks["params_KP"], stacks["full_grad_KP"], weights_K, x_K), state, diagnostics


def aggregate_span(global_P, stacks, state, hp, span):
    """The statistics over every rank's blocks, then the new columns block by block over this
    rank's range (Strategy.aggregate_span)."""
    weights_K, x_K, diagnostics = _weights(stacks, hp, span)
    params_KP, grads_KP = stacks["params_KP"], stacks["full_grad_KP"]
    new_P = torch.empty_like(global_P)
    for b in span.blocks:
        new_P[b] = _columns(params_KP[:, b], grads_KP[:, b], weights_K, x_K)
    return new_P, state, diagnostics


CGW = register(Strategy("cgw", aggregate, needs=frozenset({"full_grad_KP", "full_loss_K", "aggregation_block"}),
                        doc=__doc__, aggregate_span=aggregate_span, params={"cgw_alpha": 0.1},
                        check_params=lambda params: at_least_zero(params, "cgw_alpha"),
                        param_docs={"cgw_alpha": "Corrective gradient weights: alpha in c = min_k alpha L_k / "
                                                 "||D_k|| (0 gives FedAvg)."}))
