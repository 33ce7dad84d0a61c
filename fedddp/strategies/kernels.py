"""The fused CPU kernels of kernels.c, compiled on first use and called through ctypes.

On one CPU thread a chain of torch ops pays a pass over memory (or cache) per op, and a rule
such as FedCong needs about ten; the C kernels make one pass over the stacked reports with all
per-column sums in registers (see kernels.c). They are built with the machine's C compiler
(``$CC``, else ``cc``) into ``$FEDDDP_CACHE`` (default ``~/.cache/fedddp``), under a name that
hashes the source, the flags and the CPU, so a cache shared by different nodes never hands one
a binary built for another's instruction set. Compilation takes well under a second and is
atomic (a temporary file renamed into place), so ranks or jobs racing on it are safe.

``lib(*tensors)`` returns the library when every tensor is a float32 CPU tensor whose columns
are contiguous, else None: the rules then run their torch-op form, which is also the form used
on CUDA (and the fallback, announced once on stderr, where no compiler works). Setting
``FEDDDP_KERNELS=torch`` forces the torch-op form everywhere (the tests compare the two).
Both forms are deterministic; they may differ from each other in the last bits, since they sum
in different orders, and a run records which one it used (see ``describe``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile

import torch

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.c")
# -ffp-contract=off: no fused multiply-add, so the bits do not depend on the CPU's instruction
# set; -march=native only widens the vectors (columns are independent).
FLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fPIC", "-shared"]
NATIVE = ["-march=native"]

_F, _I64, _I32 = ctypes.c_float, ctypes.c_int64, ctypes.c_int32
_PTR, _DPTR, _LPTR = ctypes.c_void_p, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_int64)
SIGNATURES = {
    "fd_mix": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR],
    "fd_fedmom": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _F, _PTR, _DPTR],
    "fd_cgw": [_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR],
    "fd_fedgma": [_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I32, _I32, _F, _PTR, _DPTR],
    "fd_fedcong": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I32, _PTR, _LPTR],
}

_loaded: ctypes.CDLL | None = None
_failure: str | None = None


def _cpu_signature() -> str:
    """The CPU's feature flags (Linux), else the platform's name for it."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def cache_dir() -> str:
    return os.environ.get("FEDDDP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fedddp")


def compile_library(native: bool = True) -> ctypes.CDLL:
    """Build (or find in the cache) and load kernels.c; native=False leaves out -march=native
    (the baseline instruction set: the tests compare its bits with the native build's)."""
    with open(SOURCE, "rb") as fh:
        source = fh.read()
    compiler = os.environ.get("CC", "cc")
    targets = (NATIVE, []) if native else ([],)
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS + targets[0]).encode(), compiler.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    folder = cache_dir()
    path = os.path.join(folder, f"kernels-{key}.so")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            errors = ""
            for extra in targets:  # a compiler without -march=native still builds it
                done = subprocess.run([compiler, *FLAGS, *extra, "-o", tmp, SOURCE],
                                      capture_output=True, text=True)
                if done.returncode == 0:
                    break
                errors = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            else:
                raise OSError(f"{compiler} failed: {errors[0]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    library = ctypes.CDLL(path)
    for name, argtypes in SIGNATURES.items():
        fn = getattr(library, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return library


def _library() -> ctypes.CDLL | None:
    global _loaded, _failure
    if _loaded is None and _failure is None:
        try:
            _loaded = compile_library()
        except (OSError, subprocess.SubprocessError) as exc:
            _failure = str(exc)
            print(f"fedddp: fused CPU kernels unavailable ({_failure}); server rules use torch "
                  "ops (slower aggregation). Install a C compiler or set CC.", file=sys.stderr)
    return _loaded


def enabled() -> bool:
    return os.environ.get("FEDDDP_KERNELS", "c") != "torch"


def lib(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The compiled kernels if they apply to these tensors (float32, CPU, unit column stride)."""
    if not enabled():
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or (t.dim() and t.stride(-1) != 1):
            return None
    return _library()


def describe(device: torch.device) -> str:
    """Which form the server rules take on this device, for the run's log."""
    if device.type != "cpu" or not enabled():
        return "torch ops"
    return "fused C kernels" if _library() is not None else "torch ops (no C compiler)"


# -- calls: torch tensors in, fresh [P] output out; rows_KP may be a strided view (row stride
# ld >= P), vectors must be contiguous. The scratch of the tail chunk is the only allocation. --

def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("fedddp: out of memory for a server-rule kernel's scratch buffer")


def _vector(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def mix(lib, rows_KP: torch.Tensor, weights_RK: torch.Tensor, bounds_R1: torch.Tensor) -> torch.Tensor:
    """out_j = sum_k weights[r, k] rows_kj for the columns [bounds[r], bounds[r + 1]) of run r."""
    num_clients, num_params = rows_KP.shape
    weights_RK, bounds_R1 = _vector(weights_RK), bounds_R1.to(torch.int64).contiguous()
    out_P = torch.empty(num_params, dtype=torch.float32)
    _check(lib.fd_mix(rows_KP.data_ptr(), num_clients, rows_KP.stride(0), weights_RK.data_ptr(),
                      bounds_R1.data_ptr(), weights_RK.shape[0], out_P.data_ptr()))
    return out_P


def fedmom(lib, rows_KP, weights_K, global_P, previous_P, momentum: float):
    """(mean + m (w - w_prev), ||that - w||^2 as a float)."""
    num_clients, num_params = rows_KP.shape
    weights_K, global_P, previous_P = _vector(weights_K), _vector(global_P), _vector(previous_P)
    out_P, sq_norm = torch.empty(num_params, dtype=torch.float32), ctypes.c_double()
    _check(lib.fd_fedmom(rows_KP.data_ptr(), num_clients, rows_KP.stride(0), num_params,
                         weights_K.data_ptr(), global_P.data_ptr(), previous_P.data_ptr(),
                         momentum, out_P.data_ptr(), ctypes.byref(sq_norm)))
    return out_P, sq_norm.value


def cgw(lib, rows_KP, grads_KP, weights_K, x_K):
    """sum_k p_k w_k - sum_k x_k D_k."""
    num_clients, num_params = rows_KP.shape
    weights_K, x_K = _vector(weights_K), _vector(x_K)
    out_P = torch.empty(num_params, dtype=torch.float32)
    _check(lib.fd_cgw(rows_KP.data_ptr(), grads_KP.data_ptr(), num_clients, rows_KP.stride(0),
                      grads_KP.stride(0), num_params, weights_K.data_ptr(), x_K.data_ptr(),
                      out_P.data_ptr()))
    return out_P


def fedgma(lib, rows_KP, grads_KP, weights_K, global_P, need: int, soft: bool, server_lr: float):
    """(new global, sum of the mask); grads_KP None: the gradient is the delta w - w_k."""
    num_clients, num_params = rows_KP.shape
    weights_K, global_P = _vector(weights_K), _vector(global_P)
    out_P, mask_sum = torch.empty(num_params, dtype=torch.float32), ctypes.c_double()
    grads_ptr, grads_ld = (None, 0) if grads_KP is None else (grads_KP.data_ptr(), grads_KP.stride(0))
    _check(lib.fd_fedgma(rows_KP.data_ptr(), grads_ptr, num_clients, rows_KP.stride(0), grads_ld,
                         num_params, weights_K.data_ptr(), global_P.data_ptr(), need, int(soft),
                         server_lr, out_P.data_ptr(), ctypes.byref(mask_sum)))
    return out_P, mask_sum.value


def fedcong(lib, rows_KP, weights_K, global_P, need: int):
    """(new global, columns that took the positive group, the negative group)."""
    num_clients, num_params = rows_KP.shape
    weights_K, global_P = _vector(weights_K), _vector(global_P)
    out_P, took = torch.empty(num_params, dtype=torch.float32), (ctypes.c_int64 * 2)()
    _check(lib.fd_fedcong(rows_KP.data_ptr(), num_clients, rows_KP.stride(0), num_params,
                          weights_K.data_ptr(), global_P.data_ptr(), need,
                          out_P.data_ptr(), took))
    return out_P, took[0], took[1]
