"""train.precision: the arithmetic of local training's forward and backward passes.

- fp32: as it always was (no context and no cast at all: the bits are unchanged);
- tf32: on CUDA, float32 matmuls and convolutions on TensorFloat-32 tensor cores while the local
  steps run (the flags are set around them and restored, so evaluation stays float32); on CPU
  nothing changes;
- bf16, side by side (client/batched.py): before each vmapped gradient call every client's
  parameters are cast to bfloat16 in one ``torch._foreach_copy_`` and the batch in one cast, and
  the gradients (of the bfloat16 copies) come back to float32 in another foreach copy
  (``in_dtype``): a step's casts are two ops whatever the model's tensors, one multi-tensor
  kernel each on CUDA. Inside, the forward and backward run in bfloat16 without autocast, and
  the forward's outputs return in float32 (``raised``), so the loss, its mean and everything
  after the forward are float32. BatchNorm's weight and bias stay float32, and its statistics
  (batch mean and variance, the running ones) are computed in float32 (client/masked.py), its
  output cast back to bfloat16 for the next layer; a frozen model's parameters (MOON) are cast
  inside, once a pass (``lowered``). On CUDA (``CHANNELS_LAST_DEVICES``) the copies lay the 2-d
  convolutions' weights and a batch of images out channels-last (models/layout.py).
  torch.autocast is what this replaces: under ``vmap(grad)`` its cast cache (leaf tensors only)
  never hits, so it casts each weight at each use, inside each layer's op, and side by side in
  bf16 was slower than fp32 on an H100 (BENCHMARKS.md);
- bf16, one after another (``train_client``): ``torch.autocast(device_type, dtype=bfloat16)``
  around each step's loss and gradient (the extra passes of SAM, GAM and FedSMOO included). On
  an ordinary module autocast casts each weight where a layer uses it, once a pass for these
  models, so the casts are already one a tensor a pass there; the arithmetic matches the side
  by side form's (convolutions and linear layers in bfloat16, the loss in float32), and the two
  agree to bfloat16's tolerance (tests/test_precision.py).

Parameters (the master weights), optimizer state, directions and report rows stay float32 on
both paths: the gradients reach the float32 tensors through the casts. SCAFFOLD option I's start
gradient, CGW's full-batch gradient and evaluation run in float32.

Where bf16 cannot pay: on a CPU without bfloat16 units (AMX, AVX512-BF16: the casts are then
pure extra work), and for small models whose step is bound by per-operation overhead or, on a
GPU, by kernel launches rather than arithmetic (the casts are operations too). docs/running.md
has the figures.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_map

from ..models import layout

_DTYPES = {"bf16": torch.bfloat16}


@contextlib.contextmanager
def _tf32():
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = True
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


def local(precision: str, device) -> contextlib.AbstractContextManager:
    """The context a local step's forward and backward run in one after another
    (``precision``: train.precision)."""
    device_type = torch.device(device).type
    if precision == "bf16":
        # no cast cache: the extra pass of SAM shifts the parameters in place (rules._shifted),
        # and a cached bfloat16 copy would still hold the unshifted weights
        return torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=False)
    return side_by_side(precision, device)


def side_by_side(precision: str, device) -> contextlib.AbstractContextManager:
    """The context a side-by-side step runs in: TF32's flags for tf32 on CUDA, else none (bf16's
    casts are inside the loss, ``compute_dtype``)."""
    if precision == "tf32" and torch.device(device).type == "cuda":
        return _tf32()
    return contextlib.nullcontext()


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype a side-by-side forward computes in (bfloat16 for bf16), None for float32."""
    return _DTYPES.get(precision)


def lowered(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A floating tensor in ``dtype`` (one cast, differentiable); integers (labels, token ids) and
    a tensor already in ``dtype`` as they are (no op dispatched)."""
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


# Devices where a bf16 step of a model with 2-d convolutions lays their weights and the batch
# out channels-last as it casts them (models/layout.py): cuDNN's bfloat16 tensor-core kernels
# read NHWC. On CPU the stacks stay contiguous (oneDNN was not measured faster with them).
CHANNELS_LAST_DEVICES = ("cuda",)


def _copied(dests: list[torch.Tensor], sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """``dests`` filled from ``sources`` by one ``torch._foreach_copy_`` (casting as it copies:
    one multi-tensor kernel on CUDA where a cast a tensor would launch one each)."""
    if dests:
        torch._foreach_copy_(dests, sources)
    return dests


def in_dtype(gradients, dtype: torch.dtype | None, which: list[bool], conv_weights: list[bool]):
    """``gradients`` (``vmap(grad_and_value(loss))`` over ``(params_T, buffers_T, x, *rest)``,
    its gradients a list like params_T) run on the parameters where ``which`` is true and the
    batch x in ``dtype``, those gradients handed back in float32 in the parameters' layout: the
    casts of a step, one foreach copy down and one up for all of its parameters. The loss sees
    the parameters as they are (``lowered`` in _forward then casts nothing); the same gradients
    as a cast inside the loss, whose backward is the cast of the bfloat16 gradient. On a device
    of CHANNELS_LAST_DEVICES the 2-d convolutions' weights (``conv_weights``) and a batch of
    images are laid out channels-last by the same copies. ``gradients`` itself when ``dtype`` is
    None (fp32: nothing changes)."""
    if dtype is None:
        return gradients
    where = [i for i, low in enumerate(which) if low]
    convs = [conv_weights[i] for i in where]

    def run(params_T, buffers_T, x, *rest):
        channels_last = any(convs) and x.device.type in CHANNELS_LAST_DEVICES
        sources = [params_T[i] for i in where]
        params_T = list(params_T)
        dests = [layout.channels_last_empty(t, dtype, "weight") if channels_last and conv
                 else torch.empty_like(t, dtype=dtype) for t, conv in zip(sources, convs)]
        for i, t in zip(where, _copied(dests, sources)):
            params_T[i] = t
        if channels_last and x.dim() == 5 and x.is_floating_point():  # [L, N, C, H, W] images
            x = layout.channels_last_empty(x, dtype, "input").copy_(x)
        grads_T, value = gradients(params_T, buffers_T, lowered(x, dtype), *rest)
        grads_T = list(grads_T)
        ups = [torch.empty_like(t) for t in sources]  # float32, as the stacks the optimizer updates
        for i, g in zip(where, _copied(ups, [grads_T[i] for i in where])):
            grads_T[i] = g
        return grads_T, value
    return run


def raised(outputs):
    """The floating tensors of ``outputs`` (a tensor, or a tuple of them) below float32 in
    float32: a forward's logits and representations, so the loss is computed in float32."""
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point()
                    and t.dtype != torch.float32 and t.element_size() < 4 else t, outputs)


def words(precision: str, device) -> str:
    """The start line's words on train.precision ('' for fp32)."""
    if precision == "fp32":
        return ""
    cpu = torch.device(device).type != "cuda"
    if precision == "tf32" and cpu:
        return "precision tf32 (no effect on CPU: float32)"
    pays = "; on CPU it pays only with bfloat16 units (AMX, AVX512-BF16) and models larger than a small MLP " \
        "(docs/running.md)" if precision == "bf16" and cpu else ""
    return f"local training in {precision} (float32 weights, optimizer state, reports and evaluation){pays}"
