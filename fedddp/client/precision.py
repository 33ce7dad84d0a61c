"""train.precision: the arithmetic of local training's forward and backward passes.

- fp32: as it always was (no context and no cast at all: the bits are unchanged);
- tf32: on CUDA, float32 matmuls and convolutions on TensorFloat-32 tensor cores while the local
  steps run (the flags are set around them and restored, so evaluation stays float32); on CPU
  nothing changes;
- bf16, side by side (client/batched.py): each forward inside the vmapped loss casts the
  client's parameters and its batch to bfloat16 once (``lowered``: one cast a tensor a pass,
  whose backward is one cast of its gradient back to float32), runs the forward and backward in
  bfloat16 without autocast, and returns its outputs in float32 (``raised``), so the loss, its
  mean and everything after the forward are float32. BatchNorm's weight and bias stay float32,
  and its statistics (batch mean and variance, the running ones) are computed in float32
  (client/masked.py), its output cast back to bfloat16 for the next layer. torch.autocast is
  what this replaces: under ``vmap(grad)`` its cast cache (leaf tensors only) never hits, so it
  cast each weight at each use, a kernel more per operation, and made side by side slower than
  fp32 on an H100 (BENCHMARKS.md);
- bf16, one after another (``train_client``): ``torch.autocast(device_type, dtype=bfloat16)``
  around each step's loss and gradient (the extra passes of SAM, GAM and FedSMOO included). On
  an ordinary module autocast casts each weight where a layer uses it, once a pass for these
  models, so the casts are already one a tensor a pass there; the arithmetic matches the side
  by side form's (convolutions and linear layers in bfloat16, the loss in float32), and the two
  agree to bfloat16's tolerance (tests/test_precision.py).

Parameters (the master weights), optimizer state, directions and report rows stay float32 on
both paths: the gradients reach the float32 tensors through the casts. SCAFFOLD option I's start
gradient, CGW's full-batch gradient and evaluation run in float32.

Where bf16 cannot pay: on CPU (no bfloat16 matrix units on most CPUs: the casts are pure extra
work) and for small models whose GPU step is bound by kernel launches rather than arithmetic
(the casts are launches too). BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_map

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


def converted(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Copies of ``tensors`` in ``dtype`` by one ``torch._foreach_copy_`` (one multi-tensor kernel
    on CUDA however many tensors, where a cast each would launch one a tensor)."""
    out = [torch.empty_like(t, dtype=dtype) for t in tensors]
    if out:
        torch._foreach_copy_(out, tensors)
    return out


def in_dtype(gradients, dtype: torch.dtype | None, which: list[bool]):
    """``gradients`` (``vmap(grad_and_value(loss))`` over ``(params_T, buffers_T, x, *rest)``,
    its gradients a list like params_T) run on the parameters where ``which`` is true and the
    batch x in ``dtype``, those gradients handed back in float32: the casts of a step, one
    foreach copy down and one up for all of its parameters. The loss sees the parameters as
    they are (``lowered`` in _forward then casts nothing); the same gradients as a cast inside
    the loss, whose backward is the cast of the bfloat16 gradient. ``gradients`` itself when
    ``dtype`` is None (fp32: nothing changes)."""
    if dtype is None:
        return gradients
    where = [i for i, low in enumerate(which) if low]

    def run(params_T, buffers_T, x, *rest):
        params_T = list(params_T)
        for i, t in zip(where, converted([params_T[i] for i in where], dtype)):
            params_T[i] = t
        grads_T, value = gradients(params_T, buffers_T, lowered(x, dtype), *rest)
        grads_T = list(grads_T)
        for i, g in zip(where, converted([grads_T[i] for i in where], torch.float32)):
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
    slower = " (on CPU it runs slower than fp32: BENCHMARKS.md)" if precision == "bf16" and cpu else ""
    return f"local training in {precision} (float32 weights, optimizer state, reports and evaluation){slower}"
