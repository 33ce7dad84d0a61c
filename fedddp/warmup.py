"""Warm-up before round 1: the calls whose first use compiles or sets up, made on throwaway
inputs, so that round 1 costs about what a steady round costs and the progress line's first
figure means something.

- The server rule's Triton kernels (CUDA, rank 0, a gathered rule with a fused form): Triton
  compiles a kernel on its first launch for each specialisation of its integer arguments
  (equal to 1, divisible by 16) and pointers (16-byte aligned). The warm-up launches the rule
  on a report stack of the run's own width (so P, the row stride and every column offset are
  the run's) with as few rows as keep the client count's specialisation. Triton keeps the
  binaries in its cache (``TRITON_CACHE_DIR``, by default ~/.triton/cache), so a later run on
  the machine finds them built.
- The side-by-side step (CUDA, or run.compile anywhere): one gradient call of a full group's
  shape, which is when run.compile's graph compiles and the GPU's libraries pick their kernels
  (the trainer's ``warm_up``, client/trainers.py); one after another, one forward and backward of
  a full batch. With run.compile's whole step (SGD, Adam), a few compiled steps are then timed
  against a few eager steps of the same shape, and the start line says the figure, and that
  compiling does not pay where it does not; the run does what was asked either way.

Nothing the run computes changes: the model, its buffers and torch's random state are as they
were before (``torch.random.fork_rng``), the server state is a fresh one thrown away. A warm-up
that fails (a plugin's rule on made-up reports) is said in the start line and skipped; the real
call in round 1 then reports whatever is wrong.
"""

from __future__ import annotations

import time

import torch

# Where the server rule warms up: where its fused form compiles on first use (Triton on CUDA;
# the CPU's C kernels are built when the start line is written, fedddp.book.Book).
SERVER_DEVICES = ("cuda",)


def needed(rc, device) -> bool:
    """Whether the run warms up: on CUDA, or with run.compile (its graph compiles on first use) and
    clients side by side (``rc``: the run's RunConfig, run.parallel_clients resolved)."""
    return device.type == "cuda" or bool(rc.compile and rc.parallel_clients > 1)


def warm_up(run, comm) -> str:
    """The warm-up of a run (fedddp.prepare.Run) on this rank; words for the start line, or ""."""
    cfg, device = run.cfg, comm.device
    if not needed(cfg.run, device):
        return ""
    start, skipped = time.perf_counter(), []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for what, step in (("local step", _local), ("server rule", _server)):
            try:
                step(run, comm)
            except Exception as exc:  # noqa: BLE001 - made-up inputs; round 1 runs the real call
                skipped.append(f"{what}: {type(exc).__name__}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    words = f"warm-up {time.perf_counter() - start:.1f} s before round 1"
    words += f" (skipped: {', '.join(skipped)})" if skipped else ""
    return words + "".join(f"; {w}" for w in [_compiled_step_words(run)] if w)


def _compiled_step_words(run) -> str:
    """run.compile's measured figure (its compiled step against its eager one, timed while the
    local step warmed up: client/compiled.py, ``WholeStep.measure``), or ""."""
    whole_step = getattr(getattr(run.trainer, "batched", None), "whole_step", None)
    return whole_step.words if whole_step is not None else ""


def _first_client(run):
    ids = range(run.cfg.data.num_clients)
    cid = next((c for c in ids if run.data.num_samples[c] and c in run.data.train), None)
    return None if cid is None else run.data.train[cid]


def _local(run, comm) -> None:
    data = _first_client(run)
    if data is not None:  # with what round 1's clients read of the server's state (SCAFFOLD's c)
        run.trainer.warm_up(data, {k: run.server.state[k] for k in run.strategy.client_visible})


def _server(run, comm) -> None:
    """The server rule once on made-up rows, where its fused form compiles on first use."""
    if comm.device.type in SERVER_DEVICES:
        run.server.warm_up(run.cfg.num_sampled())  # a round's reports (fewer where some drop out or straggle)
