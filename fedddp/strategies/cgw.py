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
The K x K algebra runs in float64 (it is tiny); the two passes over D (Gram, correction) stay
float32. Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import torch

from . import Strategy, client_weights_K, register, weighted_mean_P


def corrective_weights_K(gram_KK: torch.Tensor, loss_K: torch.Tensor, alpha: float):
    """x_K, c and the number of zero-gradient clients from the Gram matrix (float64 math)."""
    gram_KK = gram_KK.double()
    sq_norm_K = gram_KK.diagonal()
    live_K = sq_norm_K > 0
    norm_K = torch.where(live_K, sq_norm_K, 1.0).sqrt()
    m_K = torch.where(live_K, gram_KK.sum(1), 0.0)
    bound_K = torch.where(live_K, alpha * loss_K.double() / norm_K, torch.inf)
    c = bound_K.min()
    c = torch.where(torch.isfinite(c), c, 0.0)
    spread = torch.linalg.vector_norm(m_K / norm_K)                 # sqrt(sum_j (m_j/||D_j||)^2)
    ok = spread > 0
    scale = torch.where(ok, c / torch.where(ok, spread, 1.0), 0.0)
    x_K = torch.where(live_K, scale * m_K / (norm_K * norm_K), 0.0)
    return x_K, c, (~live_K).sum()


def aggregate(global_P, stacks, state, hp):
    params_KP, grads_KP = stacks["params_KP"], stacks["full_grad_KP"]
    mean_P = weighted_mean_P(client_weights_K(stacks, hp), params_KP)
    gram_KK = grads_KP @ grads_KP.T
    x_K, c, num_zero = corrective_weights_K(gram_KK, stacks["full_loss_K"], float(hp.cgw_alpha))
    x_K = x_K.to(params_KP.dtype)
    new_global_P = mean_P.sub_(weighted_mean_P(x_K, grads_KP))      # - sum_k x_k D_k
    diagnostics = {"cgw_x": x_K, "cgw_c": c.to(params_KP.dtype),
                   "cgw_zero_grad_clients": num_zero.to(params_KP.dtype)}
    return new_global_P, state, diagnostics


CGW = register(Strategy("cgw", aggregate, needs=frozenset({"full_grad_KP", "full_loss_K"}), doc=__doc__))
