"""run.compile for side-by-side training (client/batched.py): the whole step (``WholeStep``: the
rule's gradients and direction, the BatchNorm statistics and the optimizer update, for SGD and
Adam) or, for the other optimizers, the gradient function alone (``Compiled``) through
``torch.compile``, called at one padded shape so one graph serves every step, round and group;
on CUDA captured as a CUDA graph (``compile_mode``). Compiled graphs are kept in fedddp's cache
folder; a compiler failure is said in one line (the eager step, the reference, then runs)."""

from __future__ import annotations

import os
import sys
import time

import torch

from ..strategies.kernels import cache_dir as kernels_cache_dir


def pad(t: torch.Tensor, rows: int, width: int | None = None, fill_first: bool = False) -> torch.Tensor:
    """``t`` [L, ...] padded to ``rows`` rows (copies of row 0 when ``fill_first``, else zeros) and,
    given ``width``, its second dimension to ``width`` (zeros)."""
    if width is not None and t.shape[1] < width:
        t = torch.cat([t, t.new_zeros((t.shape[0], width - t.shape[1]) + tuple(t.shape[2:]))], dim=1)
    if t.shape[0] < rows:
        extra = (rows - t.shape[0],) + tuple(t.shape[1:])
        t = torch.cat([t, t[:1].expand(extra) if fill_first else t.new_zeros(extra)])
    return t


def compile_cache_hits() -> int:
    """Compiled graphs this process has loaded from torch.compile's disk caches (inductor's FX
    graphs, AOTAutograd's forward and backward)."""
    from torch._dynamo.utils import counters  # here: importing dynamo costs a run without compile time

    return counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]


def compile_mode(device) -> str | None:
    """torch.compile's mode for a step on ``device``: on CUDA "reduce-overhead", the compiled
    step captured as a CUDA graph over static buffers (its shapes are fixed: one launch a step
    instead of one a kernel, which is what a step of many small clients is bound by); elsewhere
    inductor's default (CUDA graphs need CUDA)."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else None


def replay_outputs_freed(device) -> bool:
    """Whether a compiled call's outputs are overwritten by its next call on ``device``: a CUDA
    graph's replay ("reduce-overhead", ``compile_mode``) writes them into the graph's memory pool,
    and CUDA graph trees free a prior iteration's outputs when the next one begins."""
    return compile_mode(device) == "reduce-overhead"


class Persistent:
    """Copies of a compiled call's outputs that outlive its next call (``replay_outputs_freed``),
    so that a step's outputs can be the next step's inputs: buffers allocated once for each named
    list of outputs, written by one ``torch._foreach_copy_`` a dtype and call (a foreach op over
    tensors of one dtype is one launch; after the replay, in stream order, so the buffers can be
    that call's inputs too)."""

    def __init__(self):
        self.buffers: dict[tuple, list[torch.Tensor]] = {}

    def __call__(self, *outputs: dict) -> tuple[dict, ...]:
        """Each of ``outputs`` (name -> list of tensors) with its tensors' copies in its place."""
        pairs: dict[torch.dtype, tuple[list, list]] = {}
        held = []
        for i, named in enumerate(outputs):
            held.append({})
            for name, tensors in named.items():
                buffers = self.buffers.get((i, name))
                if buffers is None or len(buffers) != len(tensors):
                    buffers = self.buffers[(i, name)] = [torch.empty_like(t) for t in tensors]
                held[-1][name] = buffers
                for buffer, t in zip(buffers, tensors):
                    dests, sources = pairs.setdefault(t.dtype, ([], []))
                    dests.append(buffer)
                    sources.append(t)
        for dests, sources in pairs.values():
            torch._foreach_copy_(dests, sources)
        return tuple(held)


def _say_compiling(device) -> None:
    if device.type == "cpu":  # said before the silence, not after it
        print("fedddp: run.compile: compiling the side-by-side step; on CPU that can take minutes (seconds "
              "from the cache of an earlier run) and rarely pays (BENCHMARKS.md)", file=sys.stderr, flush=True)


def _failed_note(exc: Exception) -> str:
    first = " ".join(str(exc).split())[:200]
    return f"run.compile: torch.compile failed ({type(exc).__name__}: {first}); side by side runs eagerly"


def _compiled_line(seconds: float, cache_hits: int) -> str:
    where = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    cached = f", {cache_hits} graph(s) loaded from {where}" if cache_hits else f"; kept in {where} for later runs"
    return f"fedddp: run.compile: side-by-side step compiled in {seconds:.1f} s (once a run{cached})"


def _use_cache_dir() -> None:
    # compiled graphs kept beside the C kernels (FEDDDP_CACHE, default ~/.cache/fedddp), not in
    # inductor's default /tmp: a later run, a sweep's next run, a Slurm job on another node with
    # the same home folder loads them instead of compiling again. Importing torch._dynamo (torch.func
    # does) writes inductor's default into the variable: only another value is the user's choice.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(kernels_cache_dir(), "inductor")


# the clock of the warm-up's step timing (``WholeStep.measure``); tests replace it
clock = time.perf_counter
# compiled and eager calls timed in the warm-up, after one untimed call of each
TIMED_CALLS = 3


def speed_words(compiled_s: float, eager_s: float) -> str:
    """The start line's words for a compiled step of ``compiled_s`` seconds against the eager
    step's ``eager_s``; where compiling does not pay, that it does not."""
    ratio = eager_s / compiled_s if compiled_s > 0 else float("inf")
    ms = lambda s: f"{s * 1e3:.1f}" if s >= 1e-3 else f"{s * 1e3:.2f}"  # noqa: E731 - 2 figures below 1 ms
    words = f"run.compile: step {ms(compiled_s)} ms compiled against {ms(eager_s)} ms eager ({ratio:.2f}x)"
    if ratio < 1.0:
        words += "; it does not pay here: run.compile=false is faster"
    return words


class WholeStep:
    """run.compile with SGD or Adam: ``torch.compile`` of the whole side-by-side step ``fn``
    (``BatchedTrainer._whole``: gradients, the rule's direction, running statistics, optimizer
    update, all rows masked by which clients still step), called with every group padded to the
    same rows and width, so one graph serves the run. A pure function of its arguments: a
    compiler failure leaves them as they were, said in one line (``note``), and the caller runs
    the eager form."""

    def __init__(self, fn):
        _use_cache_dir()
        self.fn, self.compiled, self.words = fn, None, ""
        self.seconds, self.note, self.failed, self.cache_hits = None, "", False, 0
        self.persist = Persistent()  # what of a call's outputs the caller keeps past the next call

    def __call__(self, *args, device):
        """``fn(*args)`` compiled, or None (the caller runs ``fn`` eagerly)."""
        if self.failed:
            return None
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=False, mode=compile_mode(device))
            _say_compiling(device)
        start, hits = time.perf_counter(), compile_cache_hits()
        try:
            if device.type == "cuda":  # a new step: the previous replay's outputs are the inputs now
                torch.compiler.cudagraph_mark_step_begin()
            out = self.compiled(*args)
        except Exception as exc:  # noqa: BLE001 - any failure of the compiler: the eager step is the reference
            self.failed, self.note = True, _failed_note(exc)
            print(f"fedddp: {self.note}", file=sys.stderr, flush=True)
            return None
        if self.seconds is None:
            self.seconds, self.cache_hits = time.perf_counter() - start, compile_cache_hits() - hits
            print(_compiled_line(self.seconds, self.cache_hits), file=sys.stderr, flush=True)
        return out

    def measure(self, args: tuple, device) -> str:
        """The compiled step against the eager one on ``args`` (after each one's first calls),
        TIMED_CALLS of each, as the start line's words (kept in ``words``); "" where it did not
        compile. Only times: what the run computes does not depend on it."""
        if self(*args, device=device) is None:
            return ""
        if replay_outputs_freed(device):  # CUDA graph trees run a graph's first call eagerly, record the second
            self(*args, device=device)
        self.fn(*args)
        timed = []
        for call in (lambda: self(*args, device=device), lambda: self.fn(*args)):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = clock()
            for _ in range(TIMED_CALLS):
                call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timed.append((clock() - start) / TIMED_CALLS)
        self.words = speed_words(*timed)
        return self.words


class Compiled:
    """run.compile: ``torch.compile`` of the side-by-side gradient function, called with every
    per-client tensor padded to B clients (copies of the first; mask 0, count 1) and the batch to
    train.batch_size samples (mask 0), so the shapes, and the one graph, stay the same across
    steps, rounds and a last group smaller than B. Compiled on the first call, its time kept in
    ``seconds`` (one line says it); a model torch.compile cannot take runs eagerly from then on,
    said in one line (``note``), never a traceback."""

    def __init__(self, fn, rows: int, batch_size: int):
        """``rows``: B, the clients every call is padded to; ``batch_size``: train.batch_size,
        the samples every call is padded to (0: full-batch steps, padded to the call's ``widest``)."""
        _use_cache_dir()
        self.fn, self.rows = torch.compile(fn, dynamic=False), int(rows)
        self.width = batch_size if batch_size > 0 else None
        self.seconds, self.note, self.failed = None, "", False

    def __call__(self, params_T, buffers_T, x, y, mask, count, drops, inputs, widest: int = 0):
        """The gradients, (objective, (loss, stats)) of the clients given, or None (run eagerly).
        ``widest``: with full-batch steps, the width to pad to (the most samples of a client)."""
        if self.failed:
            return None
        L, rows, width = x.shape[0], max(self.rows, x.shape[0]), max(self.width or widest, x.shape[1])
        per_client = lambda ts: [pad(t, rows, fill_first=True) for t in ts]  # noqa: E731
        args = (per_client(params_T), per_client(buffers_T), pad(x, rows, width), pad(y, rows, width),
                pad(mask, rows, width), torch.cat([count, count.new_ones(rows - L)]),
                {k: pad(v, rows, width) for k, v in drops.items()},
                {k: per_client(v) for k, v in inputs.items()})
        if self.seconds is None:
            _say_compiling(x.device)
        start, hits = time.perf_counter(), compile_cache_hits()
        try:
            grads_T, (objective, (loss_L, stats)) = self.fn(*args)
        except Exception as exc:  # noqa: BLE001 - any failure of the compiler: the eager step is the reference
            self.failed, self.note = True, _failed_note(exc)
            print(f"fedddp: {self.note}", file=sys.stderr, flush=True)
            return None
        if self.seconds is None:
            self.seconds = time.perf_counter() - start
            self.cache_hits = compile_cache_hits() - hits
            print(_compiled_line(self.seconds, self.cache_hits), file=sys.stderr, flush=True)
        return [g[:L] for g in grads_T], (objective[:L], (loss_L[:L], tuple(t[:L] for t in stats)))
