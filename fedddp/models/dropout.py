"""Dropout whose masks are drawn per client and step, not from torch's global generator.

``build_model`` replaces every ``nn.Dropout`` of a model by a ``SeededDropout`` (same p, same
place, no parameters or buffers, so the state_dict is unchanged). In training mode its mask for
a forward is drawn from a generator seeded by (client seed, step, layer index), the key the
client's training loop sets before each step; so the mask does not depend on which rank trains
the client, on the other clients of its side-by-side group, or on how many forwards a step runs
(SAM's extra pass at w + e uses the step's mask again). The side-by-side path
(``client/batched.py``) draws the same masks outside ``vmap``, where random operations are
refused, and pads them to the group's batch. Eval mode: no dropout, as torch's.

The mask holds 0 or 1 / (1 - p) (float32) and multiplies the input once, as torch's. Its draws
are a counter-based hash of (element, client seed, step, layer) in integer tensor ops (``masks``),
the same on any device and machine, and for a whole side-by-side group in one pass; the bits
are not those of torch's ``F.dropout``, so a run of a model with dropout differs from torch's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..sampling import _mix

_DROPOUT_STREAM = 0xD20B


_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 lanes holding 32-bit values: a bijection of
    [0, 2^32) whose output bits each depend on every input bit (the products' low 32 bits are
    kept, so int64's wrap-around is harmless)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def keys_C2(keys: list[tuple[int, int]], index: int, device) -> torch.Tensor:
    """[C, 2] int64: each (client seed, step)'s two 32-bit words for layer ``index``."""
    mixed = [_mix(_DROPOUT_STREAM, *key, index) for key in keys]
    return torch.tensor([[m & _M32, (m >> 32) & _M32] for m in mixed], dtype=torch.int64, device=device)


def masks(keys_C2_: torch.Tensor, numel: int, p: float, dtype=torch.float32) -> torch.Tensor:
    """[C, numel] scaled masks, one row per key: element e of row c is kept (1 / (1 - p)) when
    hash(e, key_c) / 2^24 < 1 - p, else 0. A counter-based draw: the same key gives the same mask
    in one client's own forward and in a side-by-side group's, and a whole group's masks, every
    step and client at once, are one pass of about twenty tensor ops (no generator per client)."""
    keep = 1.0 - p
    e_1E = torch.arange(numel, dtype=torch.int64, device=keys_C2_.device)[None]
    h = _fmix32((e_1E * 0x9E3779B1 + keys_C2_[:, :1]) & _M32)
    h = _fmix32(h ^ keys_C2_[:, 1:])
    kept = (h >> 8) < int(round(keep * (1 << 24)))  # 24 uniform bits: exact in float32
    return kept.to(dtype).div_(keep) if keep > 0 else kept.to(dtype)  # p = 1: zeros, as torch's dropout


def mask(key: tuple[int, int], index: int, shape, p: float, device) -> torch.Tensor:
    """The scaled mask of dropout layer ``index`` at ``key`` = (client seed, step), [shape]."""
    shape = tuple(shape)
    return masks(keys_C2([key], index, device), math.prod(shape), p).view(shape)


class SeededDropout(nn.Module):
    """``nn.Dropout(p)`` with its mask from ``mask(self.key, self.index, ...)``; the key is set
    per step by ``set_key``. Without a key (a forward outside fedddp's client training) it is
    torch's dropout."""

    def __init__(self, p: float, index: int):
        super().__init__()
        self.p, self.index = p, index
        self.key = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.key is None:
            return F.dropout(x, self.p, True)
        return x * mask(self.key, self.index, x.shape, self.p, x.device)

    def extra_repr(self) -> str:
        return f"p={self.p}, index={self.index}"


def seeded(model: nn.Module) -> nn.Module:
    """``model`` with each ``nn.Dropout`` replaced in place by a ``SeededDropout`` numbered in
    module order. Only nn.Dropout itself: a subclass may have a forward of its own, and the
    channel-wise forms (Dropout2d, ...) are other classes."""
    found = [(name, m) for name, m in model.named_modules() if type(m) is nn.Dropout]
    for index, (name, m) in enumerate(found):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, SeededDropout(m.p, index))
    return model


def layers(model: nn.Module) -> list[SeededDropout]:
    return [m for m in model.modules() if isinstance(m, SeededDropout)]


def set_key(layers_: list[SeededDropout], key: tuple[int, int] | None) -> None:
    """The (client seed, step) whose masks the next forwards use; None: torch's dropout."""
    for layer in layers_:
        layer.key = key
