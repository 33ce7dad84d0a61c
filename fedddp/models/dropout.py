"""Dropout whose masks are drawn per client and step, not from torch's global generator.

``build_model`` replaces every ``nn.Dropout`` of a model by a ``SeededDropout`` (same p, same
place, no parameters or buffers, so the state_dict is unchanged). In training mode its mask for
a forward is drawn from a generator seeded by (client seed, step, layer index), the key the
client's training loop sets before each step; so the mask does not depend on which rank trains
the client, on the other clients of its side-by-side group, or on how many forwards a step runs
(SAM's extra pass at w + e uses the step's mask again). The side-by-side path
(``client/batched.py``) draws the same masks outside ``vmap``, where random operations are
refused, and pads them to the group's batch. Eval mode: no dropout, as torch's.

The arithmetic is torch's: the mask holds 0 or 1 / (1 - p) (float32) and multiplies the input
once. Draws are ``torch.rand`` on the input's device (uniform floats below 1 - p are kept),
which are the same for the same seed and shape on any CPU; the bits are not those of torch's
``F.dropout``, so a sequential run of a model with dropout differs from one before this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..sampling import _mix

_DROPOUT_STREAM = 0xD20B
_generators: dict[torch.device, torch.Generator] = {}


def mask(key: tuple[int, int], index: int, shape, p: float, device) -> torch.Tensor:
    """The scaled mask of dropout layer ``index`` at ``key`` = (client seed, step), [shape]."""
    device = torch.device(device)
    gen = _generators.get(device)
    if gen is None:
        gen = _generators[device] = torch.Generator(device=device)
    gen.manual_seed(_mix(_DROPOUT_STREAM, *key, index))
    keep = 1.0 - p
    kept = (torch.rand(tuple(shape), generator=gen, device=device) < keep).float()
    return kept.div_(keep) if keep > 0 else kept  # p = 1: zeros, as torch's dropout


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
