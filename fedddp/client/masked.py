"""The masked twin of a model for side-by-side training (client/batched.py): a copy on the meta
device whose BatchNorm layers normalise over each client's own samples only (the padding of a
step's batches has mask 0) and whose dropout layers multiply by masks drawn outside vmap, so
that no random operation and no in-place buffer update runs under torch.func's transforms.
``Batch`` is what one forward's layers read and write; the trainer fills it around each call."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..models import dropout


class Batch:
    """What the masked BatchNorm and dropout layers of one forward read and write: the client's
    sample mask [S] and count and its dropout masks by layer index ([S, ...] each; under vmap
    each client's own), whether the call has no padding at all (``full``: every mask all ones),
    and, in the order the layers ran, the names of the layers that computed batch statistics
    and those statistics."""

    def __init__(self):
        self.mask = self.count = None
        self.full = False
        self.drops = {}
        self.names, self.stats = [], []


class MaskedBatchNorm(nn.Module):
    """A BatchNorm layer (any dimension) over the samples of ``batch.mask`` only, with the same
    parameters and buffers (names, shapes) as the layer it stands for. It never writes its
    buffers: in training mode it appends (mean, unbiased variance) to ``batch.stats`` for the
    caller to update the running statistics outside the torch.func transforms."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, name: str, batch: Batch):
        super().__init__()
        self.eps, self.momentum, self.name, self.batch = bn.eps, bn.momentum, name, batch
        self.weight, self.bias = bn.weight, bn.bias
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            self.register_buffer(key, getattr(bn, key, None))

    def forward(self, x):
        # train.precision = bf16 (client/precision.py): the layer computes in float32 (its
        # statistics, and the weight and bias, which stay float32) and hands the next layer
        # bfloat16 again: two casts a layer each way
        if x.dtype == torch.float32:
            return self._normalised(x)
        return self._normalised(x.float()).to(x.dtype)

    def _normalised(self, x):
        shape = (1, -1) + (1,) * (x.dim() - 2)  # [C] broadcast over [S, C, ...]
        dims = [0] + list(range(2, x.dim()))
        if self.batch.full and (self.training or self.running_mean is None):
            # no padding in this call: torch's fused kernel over all the samples (1.13x faster
            # than masking on a CPU ResNet-18 step of 4 clients, BENCHMARKS.md), the statistics
            # for the running ones beside it (in float32: vmap's batch_norm refuses a bfloat16
            # input beside float32 weights besides)
            if self.training and self.running_mean is not None:
                var_C, mean_C = torch.var_mean(x.detach(), dims, correction=1)
                self.batch.names.append(self.name)
                self.batch.stats += [mean_C, var_C]
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if self.training or self.running_mean is None:  # torch's bn_training
            mask = self.batch.mask.view((-1,) + (1,) * (x.dim() - 1))
            n = self.batch.count * (x[0, 0].numel())  # the client's values per channel
            mean_C = (x * mask).sum(dims) / n
            centred = x - mean_C.view(shape)
            var_C = (centred * centred * mask).sum(dims) / n
            if self.training and self.running_mean is not None:
                self.batch.names.append(self.name)
                self.batch.stats += [mean_C.detach(), (var_C * (n / (n - 1))).detach()]
            out = centred * torch.rsqrt(var_C + self.eps).view(shape)
        else:
            out = (x - self.running_mean.view(shape)) * torch.rsqrt(self.running_var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out


class MaskedDropout(nn.Module):
    """A ``dropout.SeededDropout`` whose mask is the client's for this step, ``batch.drops``
    (drawn outside vmap as the sequential path draws it): no random operation under vmap."""

    def __init__(self, layer: dropout.SeededDropout, batch: Batch):
        super().__init__()
        self.p, self.index, self.batch = layer.p, layer.index, batch

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        mask = self.batch.drops[self.index]
        # bf16 (client/precision.py): the float32 mask would promote the layer's output to float32
        # and the next bfloat16 layer refuses it; its values (0 and 1 / (1 - p)) to bfloat16's 8 bits
        return x * (mask if mask.dtype == x.dtype else mask.to(x.dtype))


def masked_twin(model: nn.Module, batch: Batch) -> nn.Module:
    """The model with each BatchNorm layer a ``MaskedBatchNorm`` and each dropout layer a
    ``MaskedDropout``, on the meta device: functional_call supplies every parameter and
    buffer, so it holds no memory of its own."""
    twin = copy.deepcopy(model).to("meta")
    for name, module in list(twin.named_modules()):
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            masked = MaskedBatchNorm(module, name, batch)
        elif isinstance(module, dropout.SeededDropout):
            masked = MaskedDropout(module, batch)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(twin.get_submodule(parent) if parent else twin, child, masked)
    return twin
