"""The fused CPU kernels of kernels.c, compiled on first use and called through ctypes, and the
choice, per rule and per machine, between them and the rules' torch-op form.

On one CPU thread a chain of torch ops pays a pass over memory (or cache) per op, and a rule
such as FedCong needs about ten; the C kernels make one pass over the stacked reports with all
per-column sums in registers or L1 (see kernels.c). They are built with the machine's C compiler
(``$CC``, else ``cc``) into ``$FEDDDP_CACHE`` (default ``~/.cache/fedddp``), under a name that
hashes the source, the flags and the CPU, so a cache shared by different nodes never hands one
a binary built for another's instruction set. Compilation takes well under a second and is
atomic (a temporary file renamed into place), so ranks or jobs racing on it are safe.

Which form is faster depends on the CPU (vector width, memory system) and on torch's BLAS, so
each rule's form is measured, not assumed: on first use a probe times both forms of every rule
on a [16, 300007] stack (about a second in all, most of it FedMedian's and FedTrimmedAvg's
torch sorts) and keeps the faster (the kernel unless the torch ops win by more than 25%, see
TORCH_MARGIN); the choice is cached beside the built
library (same CPU hash) with the torch version it was measured against. FedMom, FedGMA and
CGW take their kernel only where FedAvg does, so that their neutral settings keep giving
FedAvg's vector bit for bit. ``FEDDDP_KERNELS=c``,
``=triton`` or ``=torch`` forces one form for every rule where it applies (the tests compare
them); tensors it does not apply to (CUDA for c, CPU for triton outside the interpreter) run
the torch ops.

On CUDA the fused form is the Triton kernels of triton_kernels.py (Triton ships with CUDA
builds of torch), imported on first use; without triton the rules run their torch ops there.
``FEDDDP_KERNELS=triton`` also sends CPU tensors through the Triton kernels when Triton's
interpreter is on (``TRITON_INTERPRET=1`` before triton is imported): how the tests check them
without a GPU.

``lib(*tensors, rule=...)`` returns the fused form for these tensors: the C library (float32
CPU tensors whose columns are contiguous, where the rule's chosen form is the kernel), the
triton_kernels module (such CUDA tensors), else None: the rule then runs its torch-op form
(also the fallback, announced once on stderr, where no compiler works, where kernels.c is
missing from an incomplete install, or where triton does not import). The wrappers below (mean, mix, fedmom, ...) take either form. Every form is
deterministic; they may differ from each other in the last bits, since they sum in different
orders, and the run's start line records which one each rule used and why (``describe``).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

from ..config import AlgorithmConfig
from ..flat import runs_R3
from ..registry import SERVER_RULES

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.c")
# -ffp-contract=off: no fused multiply-add, so the bits do not depend on the CPU's instruction
# set; -march=native only widens the vectors (columns are independent).
FLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fPIC", "-shared"]

_F, _I64, _I32 = ctypes.c_float, ctypes.c_int64, ctypes.c_int32
_PTR, _DPTR, _LPTR = ctypes.c_void_p, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_int64)
SIGNATURES = {
    "fd_mix": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR],
    "fd_fedmom": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _F, _F, _PTR, _DPTR],
    "fd_cgw": [_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR],
    "fd_cgw_stats": [_PTR, _I64, _I64, _I64, _PTR, _PTR],
    "fd_fedgma": [_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I32, _I32, _F, _PTR, _DPTR],
    "fd_fedcong": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I32, _PTR, _LPTR],
    "fd_sorted_mean": [_PTR, _I64, _I64, _I64, _I64, _I64, _F, _I32, _PTR],
}
# Most clients the column sorts of FedMedian and FedTrimmedAvg hold (kernels.c's and
# triton_kernels.py's SORT_MAX_CLIENTS): more take the rules' torch ops.
SORT_MAX_CLIENTS = 256

_loaded: ctypes.CDLL | None = None
_failure: str | None = None
_why_unavailable = "no C compiler"       # for the start line, once _failure is set


class SourceMissing(OSError):
    """kernels.c is not beside this module: the install is incomplete (a package built
    without its package data), which a C compiler would not cure."""
_triton_module = None                    # fedddp.strategies.triton_kernels, once imported
_triton_failure: str | None = None


def cpu_signature() -> str:
    """The CPU's feature flags (Linux), else the platform's name for it."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def cpu_description() -> str:
    """The CPU's model name and widest vector instruction set, e.g. "AMD EPYC; AVX2 + FMA"."""
    model = None
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("model name", "Model", "CPU part")):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()  # processor() may start uname: last
    flags = set(cpu_signature().split(":")[-1].split())
    for flag, isa in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sve", "SVE"),
                      ("asimd", "NEON"), ("sse2", "SSE2")):
        if flag in flags:
            return f"{model}; {isa}" + (" + FMA" if "fma" in flags and flag.startswith("avx") else "")
    return f"{model}; {platform.machine()}"


def cache_dir() -> str:
    return os.environ.get("FEDDDP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fedddp")


def compile_library(march: str | None = "native", lanes: int | None = None) -> ctypes.CDLL:
    """Build (or find in the cache) and load kernels.c for ``-march=<march>``; None: the
    compiler's baseline instruction set (the tests compare the bits of several builds). A
    compiler without -march=native still builds the baseline. ``lanes`` overrides the
    register-chunk kernels' lane count (for A/B measurements, bench/aggregate.py --lanes)."""
    try:
        with open(SOURCE, "rb") as fh:
            source = fh.read()
    except FileNotFoundError:
        raise SourceMissing(f"{SOURCE} is missing") from None
    compiler = os.environ.get("CC", "cc")
    flags = FLAGS + ([f"-DLANES={lanes}"] if lanes else [])
    targets = ([f"-march={march}"], []) if march else ([],)
    key = hashlib.sha256(b"\0".join([source, " ".join(flags + targets[0]).encode(), compiler.encode(),
                                     cpu_signature().encode()])).hexdigest()[:16]
    folder = cache_dir()
    path = os.path.join(folder, f"kernels-{key}.so")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            errors = ""
            for extra in targets:  # a compiler without -march=native still builds it
                done = subprocess.run([compiler, *flags, *extra, "-o", tmp, SOURCE],
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
    library.fd_lanes.argtypes, library.fd_lanes.restype = [], ctypes.c_int
    return library


def _library() -> ctypes.CDLL | None:
    global _loaded, _failure, _why_unavailable
    if _loaded is None and _failure is None:
        try:
            _loaded = compile_library()
        except SourceMissing as exc:
            _failure, _why_unavailable = str(exc), "kernels.c missing: this fedddp install is incomplete"
            print(f"fedddp: fused CPU kernels unavailable ({_failure}): this fedddp install is "
                  "incomplete (built without its package data); server rules use torch ops (slower "
                  "aggregation). Reinstall fedddp from a wheel or checkout that has it.", file=sys.stderr)
        except (OSError, subprocess.SubprocessError) as exc:
            _failure, _why_unavailable = str(exc), "no C compiler"
            print(f"fedddp: fused CPU kernels unavailable ({_failure}); server rules use torch "
                  "ops (slower aggregation). Install a C compiler or set CC.", file=sys.stderr)
    return _loaded


def _triton():
    """triton_kernels, imported on first use (triton is slow to import); None without triton."""
    global _triton_module, _triton_failure
    if _triton_module is None and _triton_failure is None:
        try:
            from . import triton_kernels
            _triton_module = triton_kernels
        except (ImportError, RuntimeError) as exc:
            _triton_failure = f"{type(exc).__name__}: {exc}".splitlines()[0]
            print(f"fedddp: Triton kernels unavailable ({_triton_failure}); server rules on the GPU "
                  "use torch ops (slower aggregation). Install triton (it ships with CUDA builds "
                  "of torch).", file=sys.stderr)
    return _triton_module


def _interpreted_triton():
    """triton_kernels when FEDDDP_KERNELS=triton may run them on CPU tensors: Triton's
    interpreter was on when they were defined. Else None, said once on stderr."""
    if os.environ.get("TRITON_INTERPRET") != "1" and _triton_module is None:
        module = None                    # not even imported: no interpreter to run them
    else:
        module = _triton()
    if module is not None and module.INTERPRETED:
        return module
    if "triton-cpu" not in _warned:
        _warned.add("triton-cpu")
        print("fedddp: FEDDDP_KERNELS=triton runs CPU tensors through the Triton kernels only under "
              "Triton's interpreter; server rules on CPU use torch ops. Set TRITON_INTERPRET=1 "
              "before fedddp imports triton.", file=sys.stderr)
    return None


# -- which form each rule takes -----------------------------------------------------------------

# The rules with a fused kernel; every other rule's averages go through weighted_mean_P, which
# takes FedAvg's form.
RULES = ("fedavg", "feder", "fedmom", "cgw", "fedgma", "fedcong", "fedmedian", "fedtrimmedavg")
# Rules whose neutral setting must return FedAvg's vector bit for bit: their kernel forms the
# mean as fd_mix does, their torch-op form through weighted_mean_P (FedAvg's form), so they may
# take the kernel only where FedAvg does.
NEUTRAL_IS_FEDAVG = ("fedmom", "cgw", "fedgma")
# A 19 MB stack: past L2, as real stacks are. Not a power of two: rows 2^k floats apart share
# cache sets and made the row-streaming kernels look slower than on any real model.
PROBE_CLIENTS, PROBE_PARAMS = 16, 300_007
# The kernel is kept unless the torch-op form is faster by more than this: within it the two are
# equal to the probe's accuracy (on a 2-core machine at load average 4, successive probes put
# FedAvg's torch/kernel speed ratio anywhere from 0.8 to 1.3), and the kernel's bits are the
# same on every CPU (BLAS's are not).
TORCH_MARGIN = 1.25
# A cheap rule (FedAvg: ~0.5 ms a call) is timed until both forms have had this many seconds,
# up to PROBE_MAX_REPEATS calls each: the best of a few calls of a short one is noise.
PROBE_BUDGET, PROBE_MAX_REPEATS = 0.04, 30

_forms: dict[str, tuple[str, str]] | None = None   # rule -> ("c" | "torch", why)
_probing: str | None = None                         # the form the probe is timing, or forced
_warned: set[str] = set()                           # FEDDDP_KERNELS values already reported


@contextlib.contextmanager
def forced(form: str):
    """Every call inside takes ``form`` (c or torch): a plugin server rule runs in torch ops."""
    global _probing
    saved, _probing = _probing, form
    try:
        yield
    finally:
        _probing = saved


def _mode() -> str:
    """"c", "triton" or "torch" when forced (FEDDDP_KERNELS, the probe timing one form, or ``forced``),
    else "auto"."""
    if _probing is not None:
        return _probing
    mode = os.environ.get("FEDDDP_KERNELS", "auto")
    if mode in ("c", "triton", "torch"):
        return mode
    if mode not in ("auto", "") and mode not in _warned:
        _warned.add(mode)
        print(f"fedddp: FEDDDP_KERNELS={mode!r} is not one of c, triton, torch, auto; using auto "
              "(each rule's faster form). Set FEDDDP_KERNELS=c, =triton or =torch to force one.",
              file=sys.stderr)
    return "auto"


def _probe_inputs():
    K, P = PROBE_CLIENTS, PROBE_PARAMS
    gen = torch.Generator().manual_seed(0)
    global_P = torch.randn(P, generator=gen)
    params_KP = torch.rand(K, P, generator=gen).sub_(0.5).mul_(0.01).add_(global_P)
    grads_KP = torch.rand(K, P, generator=gen).sub_(0.5)
    group_P = torch.arange(P) * 8 // P                  # 8 conv groups in runs, as in a model
    stacks = {"params_KP": params_KP, "num_samples_K": torch.arange(10.0, 10.0 + K),
              "train_loss_K": torch.rand(K, generator=gen), "last_grad_KP": grads_KP,
              "full_grad_KP": grads_KP, "full_loss_K": 0.5 + torch.rand(K, generator=gen),
              "eff_rank_KL": 3 * torch.rand(K, 8, generator=gen), "conv_runs_R3": runs_R3(group_P)}
    hp = AlgorithmConfig(server_lr=1.0, params={"server_momentum": 0.9, "cong_alpha": 0.7, "gma_threshold": 0.8,
                                                "gma_grad": "last", "gma_mask": "hard", "cgw_alpha": 0.1,
                                                "trim_beta": 0.2})
    return global_P, stacks, hp


def probe(rules=RULES, repeats: int = 3) -> dict[str, tuple[str, str]]:
    """Times both forms of each rule, alternating them (best of at least `repeats` calls each,
    after a warm-up), and returns rule -> (chosen form, why). On one thread the clock is the
    process's CPU time, which leaves out the time other jobs on a shared machine take."""
    global _probing
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    global_P, stacks, hp = _probe_inputs()
    forms = {}
    for rule in rules:
        strategy = SERVER_RULES[rule]
        state = strategy.init_state(global_P, hp)
        seconds = {"c": math.inf, "torch": math.inf}
        spent, rep = 0.0, 0
        # at least `repeats` timed calls per form; cheap calls more, up to PROBE_BUDGET each rule
        while rep <= repeats or (spent < PROBE_BUDGET and rep <= PROBE_MAX_REPEATS):
            rep += 1
            for form in seconds:
                _probing = form
                try:
                    start = clock()
                    strategy.aggregate(global_P, stacks, state, hp)
                    elapsed = clock() - start
                finally:
                    _probing = None
                spent += elapsed
                if rep > 1:                              # the first call warms up
                    seconds[form] = min(seconds[form], elapsed)
        speedup = seconds["torch"] / max(seconds["c"], 1e-9)
        if speedup >= 1.0:
            forms[rule] = ("c", f"probe: {speedup:.1f}x the torch-op form's speed")
        elif speedup * TORCH_MARGIN >= 1.0:
            forms[rule] = ("c", f"probe: {speedup:.2f}x the torch-op form's speed, a tie "
                                f"within {TORCH_MARGIN - 1:.0%}: the kernel's bits do not "
                                "depend on the CPU")
        else:
            forms[rule] = ("torch", f"probe: {1 / speedup:.1f}x the C kernel's speed")
    if "fedavg" in forms and forms["fedavg"][0] == "torch":
        for rule in NEUTRAL_IS_FEDAVG:
            if forms.get(rule, ("torch",))[0] == "c":
                forms[rule] = ("torch", "follows fedavg, so that its neutral setting gives "
                                        "FedAvg's bits; " + forms[rule][1])
    return forms


def _forms_path(library: ctypes.CDLL) -> str:
    return library._name[:-len(".so")] + ".forms.json"


def forms() -> dict[str, tuple[str, str]]:
    """rule -> (form, why) on this machine in auto mode: the cached probe, else a new one."""
    global _forms
    if _forms is not None:
        return _forms
    library = _library()
    if library is None:
        _forms = {rule: ("torch", _why_unavailable) for rule in RULES}
        return _forms
    path = _forms_path(library)
    try:
        with open(path) as fh:
            cached = json.load(fh)
        if cached.get("torch") == torch.__version__ and set(cached["forms"]) == set(RULES):
            _forms = {rule: (form, why + ", cached")
                      for rule, (form, why) in cached["forms"].items()}
            return _forms
    except (OSError, ValueError, KeyError, TypeError):
        pass
    _forms = probe()
    tmp = None
    try:                         # atomic, as the library: jobs racing on it are safe
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as fh:
            json.dump({"torch": torch.__version__, "forms": _forms}, fh, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass                     # a read-only cache: the choice is just not kept
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
    return _forms


def lib(*tensors: torch.Tensor, rule: str | None = None):
    """The fused form for these tensors (float32, unit column stride, one device): on CPU the
    compiled C kernels if this rule's form is the kernel (rule None: whenever they apply), or
    under FEDDDP_KERNELS=triton the interpreted Triton kernels; on CUDA the Triton kernels
    (triton_kernels). None: the rule's torch ops."""
    mode = _mode()
    if mode == "torch":
        return None
    device = tensors[0].device
    for t in tensors:
        if t.device != device or t.dtype != torch.float32 or (t.dim() and t.stride(-1) != 1):
            return None
    if device.type == "cuda":
        return _triton() if mode in ("auto", "triton") else None
    if device.type != "cpu":
        return None
    if mode == "triton":
        return _interpreted_triton()
    library = _library()
    if library is None or mode == "c" or rule is None:
        return library
    return library if forms()[rule][0] == "c" else None


def describe(device: torch.device, rule: str | None = None) -> str:
    """Which form the server rules (or one rule) take on this device and why, for the run's
    start line; on CPU it builds the kernels and runs the probe if they are not cached."""
    if rule is not None and ":" in rule:
        return "torch ops (a plugin server rule runs in torch ops on every device)"
    mode = _mode()
    if mode == "torch":
        return "torch ops (FEDDDP_KERNELS=torch)"
    if device.type == "cuda":
        if mode == "c":
            return "torch ops (FEDDDP_KERNELS=c: the C kernels run on CPU tensors only)"
        if _triton() is None:
            return f"torch ops (Triton unavailable: {_triton_failure})"
        if rule is not None and rule not in RULES:
            return "fused Triton kernel for its averages, as fedavg (float32 reports)"
        return "fused Triton kernel" + ("s" if rule is None else "") + " (float32 reports)"
    if device.type != "cpu":
        return "torch ops"
    if mode == "triton":
        if _interpreted_triton() is None:
            return "torch ops (FEDDDP_KERNELS=triton without TRITON_INTERPRET=1)"
        return "fused Triton kernels in Triton's interpreter (FEDDDP_KERNELS=triton)"
    if _library() is None:
        return f"torch ops ({_why_unavailable})"
    if mode == "c":
        return "fused C kernels (FEDDDP_KERNELS=c)"
    chosen = forms()
    if rule is not None:
        if rule not in chosen:       # the rule's averages take FedAvg's form
            form, why = chosen["fedavg"]
            why = "as fedavg, " + why
        else:
            form, why = chosen[rule]
        return f"{'fused C kernel' if form == 'c' else 'torch ops'} ({why})"
    by_form = {f: [r for r in RULES if chosen[r][0] == f] for f in ("c", "torch")}
    parts = [f"{name} for {', '.join(by_form[f])}" for f, name in (("c", "fused C kernels"),
                                                                    ("torch", "torch ops"))
             if by_form[f]]
    return "; ".join(parts) + " (faster in a probe on this CPU)"


# -- calls: torch tensors in, fresh [P] output out; rows_KP may be a strided view (row stride
# ld >= P), vectors must be contiguous. Scratch buffers (tail chunks, CGW's statistics) are the
# only other allocations. `lib` is what lib() returned: the C library, or the triton_kernels
# module, whose functions take the same arguments and return scalars as 0-d device tensors
# (Python numbers from C): the rules take either through torch.as_tensor. --

def _is_triton(lib) -> bool:
    return not isinstance(lib, ctypes.CDLL)


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("fedddp: out of memory for a server-rule kernel's scratch buffer")


def _vector(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float32 and t.is_contiguous():   # the common case, without ~8 us of ops
        return t
    return t.to(torch.float32).contiguous()


def mean(lib, rows_KP: torch.Tensor, weights_K: torch.Tensor) -> torch.Tensor:
    """out_j = sum_k weights_k rows_kj: fd_mix with one run, its bounds a ctypes array (a
    torch.tensor costs ~16 us, a tenth of a small model's whole average)."""
    if _is_triton(lib):
        return lib.mean(rows_KP, weights_K)
    num_clients, num_params = rows_KP.shape
    weights_K = _vector(weights_K)
    out_P = torch.empty(num_params, dtype=torch.float32)
    _check(lib.fd_mix(rows_KP.data_ptr(), num_clients, rows_KP.stride(0), weights_K.data_ptr(),
                      ctypes.addressof((ctypes.c_int64 * 2)(0, num_params)), 1, out_P.data_ptr()))
    return out_P


def mix(lib, rows_KP: torch.Tensor, weights_RK: torch.Tensor, bounds_R1: torch.Tensor) -> torch.Tensor:
    """out_j = sum_k weights[r, k] rows_kj for the columns [bounds[r], bounds[r + 1]) of run r."""
    if _is_triton(lib):
        return lib.mix(rows_KP, weights_RK, bounds_R1)
    num_clients, num_params = rows_KP.shape
    weights_RK, bounds_R1 = _vector(weights_RK), bounds_R1.to(torch.int64).contiguous()
    out_P = torch.empty(num_params, dtype=torch.float32)
    _check(lib.fd_mix(rows_KP.data_ptr(), num_clients, rows_KP.stride(0), weights_RK.data_ptr(),
                      bounds_R1.data_ptr(), weights_RK.shape[0], out_P.data_ptr()))
    return out_P


def fedmom(lib, rows_KP, weights_K, global_P, previous_P, momentum: float, server_lr: float = 1.0):
    """(mean + m (w - w_prev), ||that - w||^2 as a float); server_lr != 1: w + lr (mean - w) in
    place of the mean."""
    if _is_triton(lib):
        return lib.fedmom(rows_KP, weights_K, global_P, previous_P, momentum, server_lr)
    num_clients, num_params = rows_KP.shape
    weights_K, global_P, previous_P = _vector(weights_K), _vector(global_P), _vector(previous_P)
    out_P, sq_norm = torch.empty(num_params, dtype=torch.float32), ctypes.c_double()
    _check(lib.fd_fedmom(rows_KP.data_ptr(), num_clients, rows_KP.stride(0), num_params,
                         weights_K.data_ptr(), global_P.data_ptr(), previous_P.data_ptr(),
                         momentum, server_lr, out_P.data_ptr(), ctypes.byref(sq_norm)))
    return out_P, sq_norm.value


def cgw(lib, rows_KP, grads_KP, weights_K, x_K):
    """sum_k p_k w_k - sum_k x_k D_k."""
    if _is_triton(lib):
        return lib.cgw(rows_KP, grads_KP, weights_K, x_K)
    num_clients, num_params = rows_KP.shape
    weights_K, x_K = _vector(weights_K), _vector(x_K)
    out_P = torch.empty(num_params, dtype=torch.float32)
    _check(lib.fd_cgw(rows_KP.data_ptr(), grads_KP.data_ptr(), num_clients, rows_KP.stride(0),
                      grads_KP.stride(0), num_params, weights_K.data_ptr(), x_K.data_ptr(),
                      out_P.data_ptr()))
    return out_P


def cgw_stats(lib, grads_KP):
    """(||D_k||^2, D_k . sum_j D_j) as float64 [K] tensors, every sum in float64."""
    if _is_triton(lib):
        return lib.cgw_stats(grads_KP)
    num_clients, num_params = grads_KP.shape
    sq_norm_K = torch.empty(num_clients, dtype=torch.float64)
    m_K = torch.empty(num_clients, dtype=torch.float64)
    _check(lib.fd_cgw_stats(grads_KP.data_ptr(), num_clients, grads_KP.stride(0), num_params,
                            sq_norm_K.data_ptr(), m_K.data_ptr()))
    return sq_norm_K, m_K


def fedgma(lib, rows_KP, grads_KP, weights_K, global_P, need: int, soft: bool, server_lr: float):
    """(new global, sum of the mask); grads_KP None: the gradient is the delta w - w_k."""
    if _is_triton(lib):
        return lib.fedgma(rows_KP, grads_KP, weights_K, global_P, need, soft, server_lr)
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
    if _is_triton(lib):
        return lib.fedcong(rows_KP, weights_K, global_P, need)
    num_clients, num_params = rows_KP.shape
    weights_K, global_P = _vector(weights_K), _vector(global_P)
    out_P, took = torch.empty(num_params, dtype=torch.float32), (ctypes.c_int64 * 2)()
    _check(lib.fd_fedcong(rows_KP.data_ptr(), num_clients, rows_KP.stride(0), num_params,
                          weights_K.data_ptr(), global_P.data_ptr(), need,
                          out_P.data_ptr(), took))
    return out_P, took[0], took[1]


def sorted_mean(lib, rows_KP, lo: int, hi: int, median: bool):
    """Per column, the rows [lo, hi) of its K values sorted ascending: their mean, summed in
    order with the weight 1 / (hi - lo) as uniform_mean_C forms it (float32 ones over their
    sum), or with ``median`` the median ((v_lo + v_hi-1) / 2). K <= SORT_MAX_CLIENTS."""
    if _is_triton(lib):
        return lib.sorted_mean(rows_KP, lo, hi, median)
    num_clients, num_params = rows_KP.shape
    ones_R = torch.ones(hi - lo)
    weight = (ones_R / ones_R.sum())[0].item()
    out_P = torch.empty(num_params, dtype=torch.float32)
    status = lib.fd_sorted_mean(rows_KP.data_ptr(), num_clients, rows_KP.stride(0), num_params,
                                lo, hi, weight, int(median), out_P.data_ptr())
    if status != 0:
        raise ValueError(f"fedddp: fd_sorted_mean refused K = {num_clients}, rows [{lo}, {hi})")
    return out_P
