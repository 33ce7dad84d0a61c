"""Channels-last memory layout for convolutions run side by side (client/batched.py).

``torch.func.vmap`` runs a batched 2-d convolution as one grouped convolution: the input
[L, N, C, H, W] (L clients) becomes [N, L*C, H, W] (the client dimension folded into the
channels) and the weight [L, O, C, kh, kw] becomes [L*O, C, kh, kw]. cuDNN's bfloat16 tensor-core
kernels read channels-last (NHWC) tensors; handed NCHW ones they transpose them first. The
layouts below are the stacked tensors' memory orders in which those folded forms are
channels-last views, so no copy is made between the stacks and the kernel.
"""

from __future__ import annotations

import torch

# The memory order of a stacked tensor's dimensions, outermost first: the input [L, N, C, H, W]
# as N, H, W, L, C (its fold [N, L*C, H, W] then has the channels innermost); the weight
# [L, O, C, kh, kw] as L, O, kh, kw, C (its fold [L*O, C, kh, kw] likewise).
ORDERS = {"input": (1, 3, 4, 0, 2), "weight": (0, 1, 3, 4, 2)}


def channels_last_empty(like: torch.Tensor, dtype: torch.dtype, role: str) -> torch.Tensor:
    """An uninitialised tensor shaped like ``like`` (a stacked 2-d convolution ``role``: "input"
    or "weight", 5 dimensions) in ``dtype``, laid out in ``ORDERS[role]``; a copy into it (one
    cast and relayout, ``torch._foreach_copy_`` or ``copy_``) gives the channels-last form."""
    order = ORDERS[role]
    if like.dim() != len(order):
        raise ValueError(f"a stacked 2-d convolution {role} has {len(order)} dimensions, got {like.dim()}")
    physical = torch.empty([like.shape[d] for d in order], dtype=dtype, device=like.device)
    return physical.permute(sorted(range(len(order)), key=order.__getitem__))


def folded(t: torch.Tensor, role: str) -> torch.Tensor:
    """The form vmap's grouped convolution hands the kernel: input [L, N, C, H, W] ->
    [N, L*C, H, W], weight [L, O, C, kh, kw] -> [L*O, C, kh, kw] (a view where the layout allows,
    else a copy, as torch's reshape)."""
    if role == "input":
        return t.movedim(0, 1).reshape(t.shape[1], t.shape[0] * t.shape[2], *t.shape[3:])
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])
