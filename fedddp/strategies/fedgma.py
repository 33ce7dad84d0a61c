"""FedGMA (Tenison et al., seed 001, Alg. 1): FedAvg plus a server step along the AND-masked
client gradients.

  mask_j = 1{ |sum_k sign(g_kj)| >= p K }   (non-strict; sign(0) = 0; p = hp.gma_threshold)
  grad   = sum_k p_k g_kj * mask_j
  w      = sum_k p_k w_k - eta_s grad        (eta_s = hp.server_lr)

g_k is the minibatch gradient at the client's last local step (hp.gma_grad = "last", the
paper's choice) or the update w - w_k ("delta"). hp.gma_mask = "soft" (the 2023 follow-up)
replaces the 0/1 mask by 1 where the agreement |sum_k sign(g_kj)| / K reaches p and by the
agreement itself below it (the same non-strict threshold as the hard mask).

The threshold p K is taken as the integer ceil(p K) with a 1e-9 slack, so that e.g. p = 0.3,
K = 10 (0.3 * 10 = 3.0000000000000004 in floating point) asks for 3 agreeing clients.
``needs`` always holds last_grad_KP: with gma_grad = "delta" it is gathered but unused
(``Strategy.needs`` cannot depend on hp).

The mask needs sign(g) over [K, P]; it is computed a block of columns at a time so that the
[K, block] temporaries stay in cache (and memory stays flat for large K) and G is read from
memory once. Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import math

import torch

from . import Strategy, client_weights_K, register, weighted_mean_P


def column_block(num_rows: int, device: torch.device) -> int:
    """Columns per block for rules that need [K, block] temporaries: about 1 MiB of float32 per
    temporary on CPU (fits in L2), 256 MiB on an accelerator (few kernel launches)."""
    budget = 1 << 18 if device.type == "cpu" else 1 << 26
    return max(256, budget // max(num_rows, 1))


def min_agreeing(fraction: float, num_clients: int) -> int:
    """Smallest integer count >= fraction * K (with a 1e-9 slack against 0.3 * 10 > 3)."""
    return max(0, math.ceil(fraction * num_clients - 1e-9))


def aggregate(global_P, stacks, state, hp):
    params_KP = stacks["params_KP"]
    num_clients, num_params = params_KP.shape
    weights_K = client_weights_K(stacks, hp)
    mean_P = weighted_mean_P(weights_K, params_KP)
    use_delta = hp.gma_grad == "delta"
    soft = hp.gma_mask == "soft"
    need = min_agreeing(hp.gma_threshold, num_clients)

    grad_P = torch.empty_like(mean_P)
    mask_P = torch.empty_like(mean_P)
    step = column_block(num_clients, params_KP.device)
    for start in range(0, num_params, step):
        cols = slice(start, start + step)
        if use_delta:
            grads_KB = torch.sub(global_P[cols], params_KP[:, cols])      # w - w_k
        else:
            grads_KB = stacks["last_grad_KP"][:, cols]
        agree_B = torch.sign(grads_KB).sum(0).abs_()                      # |sum_k sign(g_kj)|
        mask_B = mask_P[cols]
        if soft:
            torch.where(agree_B >= need, 1.0, agree_B / num_clients, out=mask_B)
        else:
            torch.ge(agree_B, need, out=mask_B)                           # writes 0./1.
        torch.mul(weighted_mean_P(weights_K, grads_KB), mask_B, out=grad_P[cols])

    new_global_P = torch.sub(mean_P, grad_P, alpha=float(hp.server_lr))
    return new_global_P, state, {"mask_density": mask_P.mean()}


FEDGMA = register(Strategy("fedgma", aggregate, needs=frozenset({"last_grad_KP"}), doc=__doc__))
