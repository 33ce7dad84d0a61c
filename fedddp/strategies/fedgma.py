"""FedGMA (Tenison et al., seed 001, Alg. 1): FedAvg plus a server step along the AND-masked
client gradients.

  mask_j = 1{ |sum_k sign(g_kj)| >= p K }   (non-strict; sign(0) = 0; p = hp.params["gma_threshold"])
  grad   = sum_k p_k g_kj * mask_j
  w      = sum_k p_k w_k - eta_s grad        (eta_s = hp.server_lr)

g_k is the minibatch gradient at the client's last local step (hp.params["gma_grad"] = "last", the
paper's choice) or the update w - w_k ("delta"). hp.params["gma_mask"] = "soft" (the 2023 follow-up)
replaces the 0/1 mask by 1 where the agreement |sum_k sign(g_kj)| / K reaches p and by the
agreement itself below it (the same non-strict threshold as the hard mask).

The threshold p K is taken as the integer ceil(p K) with a 1e-9 slack, so that e.g. p = 0.28,
K = 25 (0.28 * 25 = 7.000000000000001 in floating point) asks for 7 agreeing clients.
With gma_grad = "delta" the clients send no gradient: the delta is computed from params_KP.

On CPU one fused kernel (kernels.c), on CUDA its Triton twin (triton_kernels.py), reads W and
G once and forms the mean, the weighted gradient, the sign count and the mask per column in
registers. Elsewhere the mask needs sign(g)
over [K, P]; it is computed a block of columns at a time so that the [K, B] temporaries stay in
cache (and memory stays flat for large K), G is read from memory once, and both reductions over
clients are matrix-vector products.
Legend: K sampled clients, P flat parameters, B columns in a block.
"""

from __future__ import annotations

import torch

from . import kernels
from ..params import in_unit, one_of
from .base import (Strategy, client_weights_K, column_block, min_agreeing, register,
               weighted_mean_P)


def aggregate(global_P, stacks, state, hp):
    params_KP = stacks["params_KP"]
    new_global_P, mask_sum, mask_P = _columns(global_P, params_KP, stacks, client_weights_K(stacks, hp), hp)
    if mask_P is not None:
        return new_global_P, state, {"mask_density": mask_P.mean()}
    density = (torch.as_tensor(mask_sum, dtype=torch.float64) / params_KP.shape[1]).to(params_KP.dtype)
    return new_global_P, state, {"mask_density": density}


def aggregate_span(global_P, stacks, state, hp, span):
    """Block by block over this rank's range; the mask's sum added over every block
    (Strategy.aggregate_span)."""
    params_KP, use_delta = stacks["params_KP"], hp.params["gma_grad"] == "delta"
    weights_K = client_weights_K(stacks, hp)
    new_P, mask_rows = torch.empty_like(global_P), []
    for b in span.blocks:
        block = {"params_KP": params_KP[:, b]} | ({} if use_delta else {"last_grad_KP": stacks["last_grad_KP"][:, b]})
        new_P[b], mask_sum, mask_B = _columns(global_P[b], block["params_KP"], block, weights_K, hp)
        mask_rows.append(mask_B.sum(dtype=torch.float64) if mask_B is not None
                         else torch.as_tensor(mask_sum, dtype=torch.float64))
    density = (span.total(mask_rows, 1)[0] / span.numel).to(params_KP.dtype)
    return new_P, state, {"mask_density": density}


def _columns(global_P, params_KP, stacks, weights_K, hp):
    """(the new columns, the mask's sum as a float from the fused kernel and None, or None and the
    mask [P] from the torch ops)."""
    num_clients, num_params = params_KP.shape
    use_delta = hp.params["gma_grad"] == "delta"
    soft = hp.params["gma_mask"] == "soft"
    need = min_agreeing(hp.params["gma_threshold"], num_clients)
    grads_KP = None if use_delta else stacks["last_grad_KP"]
    lib = kernels.lib(params_KP, global_P, *([] if use_delta else [grads_KP]), rule="fedgma")
    if lib is not None:
        new_global_P, mask_sum = kernels.fedgma(lib, params_KP, grads_KP, weights_K, global_P, need,
                                                soft, float(hp.server_lr))
        return new_global_P, mask_sum, None

    mean_P = weighted_mean_P(weights_K, params_KP)
    grad_P = torch.empty_like(mean_P)
    mask_P = torch.empty_like(mean_P)
    ones_K = torch.ones_like(weights_K)
    step = column_block(num_clients, params_KP.device)
    # One workspace reused by every block: fresh buffers per block cost page faults.
    workspace = torch.empty((num_clients + 2) * min(step, num_params), dtype=mean_P.dtype,
                            device=mean_P.device)
    for start in range(0, num_params, step):
        cols = slice(start, start + step)
        width = min(step, num_params - start)
        temp_KB = workspace[:num_clients * width].view(num_clients, width)
        agree_B, mean_grad_B = workspace[num_clients * width:].view(-1)[:2 * width].view(2, width)
        if use_delta:
            grads_KB = torch.sub(global_P[cols], params_KP[:, cols], out=temp_KB)  # w - w_k
        else:
            grads_KB = grads_KP[:, cols]
        torch.mv(grads_KB.T, weights_K, out=mean_grad_B)                   # sum_k p_k g_kj
        signs_KB = torch.sign(grads_KB, out=temp_KB)
        torch.mv(signs_KB.T, ones_K, out=agree_B).abs_()                   # |sum_k sign(g_kj)|
        # float 0./1. outputs and arithmetic instead of bool masks and `where`: several times
        # faster on CPU, and exact.
        mask_B = torch.ge(agree_B, need, out=mask_P[cols])
        if soft:                                           # 1 where agreeing enough, else |S|/K
            mask_B.addcmul_(torch.rsub(mask_B, 1.0), agree_B.div_(num_clients))
        torch.mul(mean_grad_B, mask_B, out=grad_P[cols])

    return torch.sub(mean_P, grad_P, alpha=float(hp.server_lr)), None, mask_P


def needs(hp) -> frozenset:
    return frozenset() if hp.params["gma_grad"] == "delta" else frozenset({"last_grad_KP"})


def check_params(params: dict) -> list[str]:
    return (in_unit(params, "gma_threshold") + one_of(params, "gma_grad", ("last", "delta"))
            + one_of(params, "gma_mask", ("hard", "soft")))


FEDGMA = register(Strategy("fedgma", aggregate, needs=frozenset({"last_grad_KP"}), needs_fn=needs,
                           doc=__doc__, takes_server_lr=True, aggregate_span=aggregate_span,
                           check_params=check_params,
                           params={"gma_threshold": 0.8, "gma_grad": "last", "gma_mask": "hard"},
                           param_docs={
                               "gma_threshold": "FedGMA: agreement threshold p of the AND-mask.",
                               "gma_grad": "FedGMA: which client gradient is masked: the one at the last local "
                                           "step (last), or the update delta w - w_k (delta).",
                               "gma_mask": "FedGMA mask: hard 0/1 AND-mask, or soft (agreement where below "
                                           "threshold)."}))
