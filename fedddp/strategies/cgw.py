"""Corrective gradient weights, CGW (Mousazadeh et al., seed 000, eqs. 13, 24-29).

Client k reports D_k, the full-batch gradient of its mean loss at its trained model, and L_k,
that loss. With D = sum_j D_j (j = k included: eq. 6, m_i = D_i . D) and alpha = hp.cgw_alpha:
  m_k = D_k . D                       (m = G 1 for the Gram matrix G = D D^T, one matmul)
  c   = min_k alpha L_k / ||D_k||     (eq. 13; ||D_k||^2 = diag G)
  x_k = c / sqrt(sum_j (m_j / ||D_j||)^2) * m_k / ||D_k||^2     (eq. 29)
  w   = sum_k p_k w_k - sum_k x_k D_k                              (eq. 8)
so that sum_k (x_k ||D_k||)^2 = c^2 (eq. 24) and sign(x_k) = sign(m_k) (negative weights are
intended: they take back part of a dissenting client's contribution).

A client with ||D_k|| = 0 has no direction to weigh (eq. 29 divides by it): it gets x_k = 0 and
is left out of c and of the sums (it adds nothing to D either); the count is a diagnostic. If
every client is zero, or the m_k all vanish, the correction is zero: never NaN. alpha = 0
gives x = 0 exactly, so the result is FedAvg's vector bit for bit.
The K x K algebra runs in float64 (it is tiny); the two passes over D (Gram, then the average
and the correction together, fused on CPU) stay float32. Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import torch

from . import Strategy, client_weights_K, column_block, kernels, register, weighted_mean_P


# Up to this many clients the Gram matrix G = D D^T (one matmul, K^2 P multiply-adds) gives
# the norms and m = G 1; above it, m = D (sum_k D_k) and the row norms are formed directly
# (3 K P multiply-adds over column blocks, D read from memory once): the Gram matmul turns
# compute-bound as K grows (1 CPU thread, ResNet-18 size: equal at K = 32, 2.6x slower at
# K = 100).
GRAM_MAX_CLIENTS = 16


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
    spread = torch.linalg.vector_norm(m_K / norm_K)                 # sqrt(sum_j (m_j/||D_j||)^2)
    ok = spread > 0
    scale = torch.where(ok, c / torch.where(ok, spread, 1.0), 0.0)
    x_K = torch.where(live_K, scale * m_K / (norm_K * norm_K), 0.0)
    return x_K, c, (~live_K).sum()


def norms_and_agreement_K(grads_KP: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(||D_k||^2, m_k = D_k . sum_j D_j) for every client, float32 sums per block of columns
    added up in float64."""
    num_clients, num_params = grads_KP.shape
    if num_clients <= GRAM_MAX_CLIENTS:
        gram_KK = grads_KP @ grads_KP.T
        return gram_KK.diagonal(), gram_KK.sum(1)
    step = column_block(num_clients, grads_KP.device)
    ones_1K = torch.ones(1, num_clients, dtype=grads_KP.dtype, device=grads_KP.device)
    num_blocks = -(-num_params // step)
    # per block: row 0 the norms ||D_kB||, row 1 the dot products D_kB . D_B (summed at the end)
    parts_N2K = torch.empty(num_blocks, 2, num_clients, dtype=grads_KP.dtype,
                            device=grads_KP.device)
    sum_1B = torch.empty(1, min(step, num_params), dtype=grads_KP.dtype, device=grads_KP.device)
    for block, start in enumerate(range(0, num_params, step)):
        grads_KB = grads_KP[:, start:start + step]
        width = grads_KB.shape[1]
        total_1B = torch.mm(ones_1K, grads_KB, out=sum_1B[:, :width])    # D_B = sum_k D_kB
        torch.mv(grads_KB, total_1B[0], out=parts_N2K[block, 1])
        torch.linalg.vector_norm(grads_KB, dim=1, out=parts_N2K[block, 0])
    parts_N2K = parts_N2K.double()
    return parts_N2K[:, 0].square().sum(0), parts_N2K[:, 1].sum(0)


def aggregate(global_P, stacks, state, hp):
    params_KP, grads_KP = stacks["params_KP"], stacks["full_grad_KP"]
    weights_K = client_weights_K(stacks, hp)
    sq_norm_K, m_K = norms_and_agreement_K(grads_KP)
    x_K, c, num_zero = corrective_weights_K(sq_norm_K, m_K, stacks["full_loss_K"],
                                            float(hp.cgw_alpha))
    x_K = x_K.to(params_KP.dtype)
    lib = kernels.lib(params_KP, grads_KP, rule="cgw")
    if lib is not None:   # the average and the correction in one pass over W and D
        new_global_P = kernels.cgw(lib, params_KP, grads_KP, weights_K, x_K)
    else:
        # - sum_k x_k D_k, added into the average in place (no second [P] output): x = 0 adds
        # exact zeros, so alpha = 0 still returns FedAvg's vector bit for bit
        new_global_P = weighted_mean_P(weights_K, params_KP).addmv_(grads_KP.T, x_K, alpha=-1.0)
    diagnostics = {"cgw_x": x_K, "cgw_c": c.to(params_KP.dtype),
                   "cgw_zero_grad_clients": num_zero.to(params_KP.dtype)}
    return new_global_P, state, diagnostics


CGW = register(Strategy("cgw", aggregate, needs=frozenset({"full_grad_KP", "full_loss_K"}), doc=__doc__))
