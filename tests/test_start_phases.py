"""The time before round 1, phase by phase: ``Run.start_phases`` (prepare.StartClock), the
--verbose start line's "ready in", and the C kernels' build started on a thread while the data
and model are built."""

from __future__ import annotations

import os
import re
import types

import pytest
import torch

import fedddp
from fedddp import book, prepare
from fedddp.client import parallel
from fedddp.strategies import kernels
from fedrun import QUICKSTART


def test_the_clock_charges_each_phase_the_time_since_the_last_mark(monkeypatch):
    now = iter([10.0, 10.5, 12.0, 12.25])
    monkeypatch.setattr(prepare.time, "perf_counter", lambda: next(now))
    clock = prepare.StartClock()
    clock.mark("data")
    clock.mark("model")
    clock.mark("data")  # a phase met again adds up
    assert clock.phases == {"data": 0.75, "model": 1.5}


def test_ready_words_name_the_phases_of_at_least_10_ms_in_order():
    assert book.ready_words({"data": 0.214, "model": 0.004, "warm-up": 1.5}) == \
        "ready in 1.72 s (data 0.21, warm-up 1.50)"
    assert book.ready_words({"data": 0.001}) == "ready in 0.00 s"


def test_the_verbose_start_line_says_when_the_run_was_ready(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEDDDP_VERBOSE", "1")
    # a cache of its own: an earlier run of the same shapes (another test's) would leave the
    # side-by-side timings there, and this run would read them instead of timing
    monkeypatch.setenv("FEDDDP_CACHE", str(tmp_path / "cache"))
    fedddp.run(QUICKSTART, ["run.rounds=1", "run.progress=true", "run.parallel_clients=2"], out_dir=tmp_path / "run")
    line = capsys.readouterr().err.splitlines()[0]
    found = re.search(r"; ready in ([0-9.]+) s \(([^)]*)\)$", line)
    assert found, line
    shown = dict(part.rsplit(" ", 1) for part in found.group(2).split(", "))
    # side by side on CPU with progress on: the timing both ways is a phase of its own
    assert "side by side timed" in shown, line
    assert abs(sum(map(float, shown.values())) - float(found.group(1))) < 0.01 * (len(shown) + 1), line


def _comm(device: str, local_rank: int = 0):
    return types.SimpleNamespace(device=torch.device(device), env=types.SimpleNamespace(local_rank=local_rank))


def test_the_kernel_build_starts_on_a_thread_and_fills_the_cache(tmp_path, monkeypatch):
    """The thread's build is the start line's: the library it leaves in FEDDDP_CACHE is the one
    the kernels load (same name: the same source, flags and CPU)."""
    monkeypatch.setenv("FEDDDP_CACHE", str(tmp_path))
    monkeypatch.delenv("FEDDDP_KERNELS", raising=False)
    thread = prepare._start_kernel_build(_comm("cpu"))
    assert thread is not None
    thread.join(timeout=120)
    built = [name for name in os.listdir(tmp_path) if name.endswith(".so")]
    assert len(built) == 1
    assert os.path.basename(kernels.compile_library()._name) == built[0]


def test_no_kernel_build_where_the_kernels_are_not_used(monkeypatch):
    monkeypatch.delenv("FEDDDP_KERNELS", raising=False)
    assert prepare._start_kernel_build(_comm("cpu", local_rank=1)) is None  # the node's first rank builds
    assert prepare._start_kernel_build(_comm("cuda")) is None
    monkeypatch.setenv("FEDDDP_KERNELS", "torch")
    assert prepare._start_kernel_build(_comm("cpu")) is None


@pytest.mark.e2e
def test_side_by_side_on_cpu_is_timed_once_for_the_same_shapes(tmp_path, capsys, monkeypatch):
    """The start line's timing of side by side against one after another (seconds before round 1)
    is kept in FEDDDP_CACHE: a second run of the same shapes, another learning rate included,
    reads it and says so; another batch size is timed afresh."""
    monkeypatch.setenv("FEDDDP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FEDDDP_VERBOSE", "1")
    measured = []
    measure = parallel.measure_cpu
    monkeypatch.setattr(parallel, "measure_cpu", lambda *a, **k: measured.append(1) or measure(*a, **k))
    args = ["run.rounds=1", "run.progress=true", "run.parallel_clients=3"]
    lines = []
    for i, extra in enumerate([[], ["train.lr=0.05"], ["train.batch_size=5"]]):
        fedddp.run(QUICKSTART, args + extra, out_dir=tmp_path / str(i))
        lines.append(next(line for line in capsys.readouterr().err.splitlines() if "rank(s) on cpu" in line))
    assert len(measured) == 2  # the first run and the one of another batch size
    cached = ["the timings of an earlier run of the same shapes on this CPU" in line for line in lines]
    assert cached == [False, True, False], lines
    assert all("predicted from one group timed both ways" in line for line in lines)
