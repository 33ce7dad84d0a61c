"""run.compile for side-by-side training (client/batched.py): the gradient function through
``torch.compile``, called at one padded shape so one graph serves every step, with its compiled
graphs kept in fedddp's cache folder and a compiler failure said in one line (the eager step,
the reference, then runs)."""

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


class Compiled:
    """run.compile: ``torch.compile`` of the side-by-side gradient function, called with every
    per-client tensor padded to B clients (copies of the first; mask 0, count 1) and the batch to
    train.batch_size samples (mask 0), so the shapes, and the one graph, stay the same across
    steps, rounds and a last group smaller than B. Compiled on the first call, its time kept in
    ``seconds`` (one line says it); a model torch.compile cannot take runs eagerly from then on,
    said in one line (``note``), never a traceback."""

    def __init__(self, fn, rows: int, batch_size: int):
        """``rows``: B, the clients every call is padded to; ``batch_size``: train.batch_size,
        the samples every call is padded to (0: full-batch steps, padded to the step's widest)."""
        # compiled graphs kept beside the C kernels (FEDDDP_CACHE, default ~/.cache/fedddp), not
        # in inductor's default /tmp: a later run, a sweep's next run, a Slurm job on another
        # node with the same home folder loads them instead of compiling again
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(kernels_cache_dir(), "inductor"))
        self.fn, self.rows = torch.compile(fn, dynamic=False), int(rows)
        self.width = batch_size if batch_size > 0 else None
        self.seconds, self.note, self.failed = None, "", False

    def __call__(self, params_T, buffers_T, x, y, mask, count, drops, inputs):
        """The gradients, (objective, (loss, stats)) of the clients given, or None (run eagerly)."""
        if self.failed:
            return None
        L, rows, width = x.shape[0], max(self.rows, x.shape[0]), max(self.width or 0, x.shape[1])
        per_client = lambda ts: [pad(t, rows, fill_first=True) for t in ts]  # noqa: E731
        args = (per_client(params_T), per_client(buffers_T), pad(x, rows, width), pad(y, rows, width),
                pad(mask, rows, width), torch.cat([count, count.new_ones(rows - L)]),
                {k: pad(v, rows, width) for k, v in drops.items()},
                {k: per_client(v) for k, v in inputs.items()})
        if self.seconds is None and x.device.type == "cpu":  # said before the silence, not after it
            print("fedddp: run.compile: compiling the side-by-side step; on CPU that can take minutes (seconds "
                  "from the cache of an earlier run) and rarely pays (BENCHMARKS.md)", file=sys.stderr, flush=True)
        start, hits = time.perf_counter(), compile_cache_hits()
        try:
            grads_T, (objective, (loss_L, stats)) = self.fn(*args)
        except Exception as exc:  # noqa: BLE001 - any failure of the compiler: the eager step is the reference
            self.failed = True
            first = " ".join(str(exc).split())[:200]
            self.note = f"run.compile: torch.compile failed ({type(exc).__name__}: {first}); side by side runs eagerly"
            print(f"fedddp: {self.note}", file=sys.stderr, flush=True)
            return None
        if self.seconds is None:
            self.seconds = time.perf_counter() - start
            self.cache_hits = compile_cache_hits() - hits
            cached = (f", {self.cache_hits} graph(s) loaded from {os.environ['TORCHINDUCTOR_CACHE_DIR']}"
                      if self.cache_hits else f"; kept in {os.environ['TORCHINDUCTOR_CACHE_DIR']} for later runs")
            print(f"fedddp: run.compile: side-by-side step compiled in {self.seconds:.1f} s (once a run{cached})",
                  file=sys.stderr, flush=True)
        return [g[:L] for g in grads_T], (objective[:L], (loss_L[:L], tuple(t[:L] for t in stats)))
