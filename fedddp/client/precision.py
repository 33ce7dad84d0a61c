"""train.precision: the arithmetic of local training's forward and backward passes.

- fp32: as it always was (no context at all: the bits are unchanged);
- tf32: on CUDA, float32 matmuls and convolutions on TensorFloat-32 tensor cores while the local
  steps run (the flags are set around them and restored, so evaluation stays float32); on CPU
  nothing changes;
- bf16: ``torch.autocast(device_type, dtype=torch.bfloat16)`` around each step's loss and its
  gradient (the extra passes of SAM, GAM and FedSMOO included), one after another and side by
  side. Parameters (the master weights), optimizer state, directions and report rows stay
  float32: autocast casts copies for its kernels, and the gradients reach the float32 leaves.

SCAFFOLD option I's start gradient, CGW's full-batch gradient and evaluation run in float32.
"""

from __future__ import annotations

import contextlib

import torch


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
    """The context a local step's forward and backward run in (``precision``: train.precision)."""
    device_type = torch.device(device).type
    if precision == "bf16":
        # no cast cache: the extra pass of SAM shifts the parameters in place (rules._shifted),
        # and a cached bfloat16 copy would still hold the unshifted weights
        return torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=False)
    if precision == "tf32" and device_type == "cuda":
        return _tf32()
    return contextlib.nullcontext()


def words(precision: str, device) -> str:
    """The start line's words on train.precision ('' for fp32)."""
    if precision == "fp32":
        return ""
    if precision == "tf32" and torch.device(device).type != "cuda":
        return "precision tf32 (no effect on CPU: float32)"
    return f"local training in {precision} (float32 weights, optimizer state, reports and evaluation)"
