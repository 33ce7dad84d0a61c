"""A model's state as one contiguous float32 vector, and back.

Legend: P = total flat elements, T = tensors in the layout, L = conv layers.

The layout lists the parameters in ``named_parameters`` order, then (with ``buffers=True``) the
buffers such as BatchNorm running statistics. Integer buffers (``num_batches_tracked``) travel as
float32 and are rounded back: every client of a round has seen the same count, so averaging them
is exact, and it keeps ``final.pt`` identical for any number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    is_param: bool
    is_conv: bool  # a 4-D conv kernel: the layers whose effective rank FedER measures


class FlatLayout:
    def __init__(self, model: nn.Module, buffers: bool = True):
        entries, offset = [], 0
        conv_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Conv2d)}
        named = [(n, t, True) for n, t in model.named_parameters()]
        if buffers:
            named += [(n, t, False) for n, t in model.named_buffers()]
        for name, tensor, is_param in named:
            numel = tensor.numel()
            is_conv = is_param and id(tensor) in conv_weights and tensor.dim() == 4
            entries.append(Entry(name, tuple(tensor.shape), offset, numel, is_param, is_conv))
            offset += numel
        self.entries: list[Entry] = entries
        self.numel = offset
        self._dtypes = {n: t.dtype for n, t, _ in named}
        self._param_masks: dict[torch.device, torch.Tensor] = {}

    # -- per-element indices for per-layer rules --------------------------------------------

    def conv_group_P(self) -> torch.Tensor:
        """int64 [P]: the conv layer (0..L-1) each element follows: a conv kernel is its own layer,
        any other tensor follows the last conv kernel before it in parameter order; -1 before the
        first conv. Buffers follow the layer of the parameter they belong to (same module prefix)."""
        group_of_param: dict[str, int] = {}
        groups, current = [], -1
        num_conv = 0
        for e in self.entries:
            if e.is_param:
                if e.is_conv:
                    current = num_conv
                    num_conv += 1
                group_of_param[e.name.rsplit(".", 1)[0]] = current
                groups.append(current)
            else:
                groups.append(group_of_param.get(e.name.rsplit(".", 1)[0], current))
        sizes = torch.tensor([e.numel for e in self.entries])
        return torch.repeat_interleave(torch.tensor(groups), sizes)

    def conv_runs_R3(self) -> torch.Tensor:
        """conv_group_P as runs of equal layer: int64 [R, 3] rows (start, stop, layer), covering
        [0, P) in order (at most one run per tensor; FedER's static input)."""
        return runs_R3(self.conv_group_P())

    def param_mask_P(self, device=None) -> torch.Tensor:
        """bool [P]: True on parameter elements, False on buffers (BatchNorm statistics), which no
        control variate or dual variable applies to. Built once per device: rules use it for
        every client."""
        device = torch.device(device or "cpu")
        if device not in self._param_masks:
            mask = torch.zeros(self.numel, dtype=torch.bool, device=device)
            for e in self.entries:
                if e.is_param:
                    mask[e.offset:e.offset + e.numel] = True
            self._param_masks[device] = mask
        return self._param_masks[device]

    def conv_entries(self) -> list[Entry]:
        return [e for e in self.entries if e.is_conv]

    # -- conversion ------------------------------------------------------------------------

    def tensors(self, model: nn.Module) -> list[torch.Tensor]:
        state = dict(model.named_parameters())
        state.update(dict(model.named_buffers()))
        return [state[e.name] for e in self.entries]

    @torch.no_grad()
    def flatten(self, model: nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:
        tensors = self.tensors(model)
        if out is None:
            out = torch.empty(self.numel, dtype=torch.float32, device=tensors[0].device)
        for e, t in zip(self.entries, tensors):
            out[e.offset:e.offset + e.numel].copy_(t.reshape(-1))
        return out

    @torch.no_grad()
    def unflatten_into(self, flat_P: torch.Tensor, model: nn.Module) -> None:
        for e, t in zip(self.entries, self.tensors(model)):
            chunk = flat_P[e.offset:e.offset + e.numel].view(e.shape)
            if t.dtype.is_floating_point:
                t.copy_(chunk)
            else:
                t.copy_(chunk.round())

    def flatten_grads(self, model: nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:
        """The parameters' .grad as [P] (zeros for buffers and for parameters without a grad)."""
        tensors = self.tensors(model)
        if out is None:
            out = torch.zeros(self.numel, dtype=torch.float32, device=tensors[0].device)
        for e, t in zip(self.entries, tensors):
            if e.is_param and t.grad is not None:
                out[e.offset:e.offset + e.numel].copy_(t.grad.reshape(-1))
            else:  # ``out`` may be a reused buffer: every element is written
                out[e.offset:e.offset + e.numel].zero_()
        return out

    def state_dict(self, flat_P: torch.Tensor) -> dict[str, torch.Tensor]:
        """A plain state_dict (CPU, original dtypes) from a flat vector: what final.pt holds."""
        out = {}
        for e in self.entries:
            chunk = flat_P[e.offset:e.offset + e.numel].detach().cpu().view(e.shape).clone()
            dtype = self._dtypes[e.name]
            out[e.name] = chunk if dtype.is_floating_point else chunk.round().to(dtype)
        return out


def runs_R3(group_P: torch.Tensor) -> torch.Tensor:
    """int64 [R, 3] rows (start, stop, value) of the maximal runs of equal values in group_P."""
    values_R, lengths_R = torch.unique_consecutive(group_P, return_counts=True)
    stops_R = lengths_R.cumsum(0)
    return torch.stack([stops_R - lengths_R, stops_R, values_R], dim=1)


def runs_within(runs_R3: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The runs of ``runs_R3`` cut to the columns [start, stop) and counted from ``start``: the
    runs of a range of the flat vector (empty runs dropped)."""
    cut_R3 = runs_R3.clone()
    cut_R3[:, :2] = runs_R3[:, :2].clamp(start, stop) - start
    return cut_R3[cut_R3[:, 1] > cut_R3[:, 0]]
