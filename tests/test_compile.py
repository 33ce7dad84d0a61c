"""run.compile: torch.compile of the side-by-side step (fedddp.client.compiled.Compiled) against
the eager step, to float32 rounding (tests/test_parallel_clients.py's TOL), with groups smaller
than B (5 clients a round at B = 3: groups of 3 and 2, padded to 3), clients that leave their
group at different steps (padded back), and a rule with an extra pass (sam); the start line with
B = 1; a compiler failure is one line and the eager step."""

from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.utils import counters

from fedddp import checks, warmup
from fedddp.client import compiled
from fedddp.comm import Comm
from fedddp.env import ProcessEnv
from fedddp.round import run

from fedrun import QUICKSTART

SINGLE = ProcessEnv(0, 1, 0, "127.0.0.1", 0, "single")
TOL = 2e-5
SMALL = ["run.clients_per_round=5", "run.rounds=2", "run.eval_every=100", "train.batch_size=16",
         "model.name=mlp", "model.hidden=16"]


def final_P(tmp_path, overrides: list[str], compile_: bool, parallel: int = 3, progress: bool = False):
    out = tmp_path / f"compile{compile_}-B{parallel}"
    cfg = checks.load(QUICKSTART, SMALL + overrides + [f"run.out_dir={out}", "run.overwrite=true",
                                                       f"run.compile={str(compile_).lower()}",
                                                       f"run.parallel_clients={parallel}",
                                                       f"run.progress={str(progress).lower()}"])
    return run(cfg, Comm(SINGLE, "cpu"))["global_P"]


@pytest.mark.slow
@pytest.mark.processes  # inductor runs the C++ compiler
@pytest.mark.parametrize("extra", [[], ["algorithm.name=fedsam"]], ids=["plain", "sam"])
@pytest.mark.e2e
def test_compiled_equals_eager(tmp_path, extra, capsys, monkeypatch):
    """... and the graph compiles in the warm-up before round 1, the one every round then uses
    (no graph compiled after it)."""
    eager_P = final_P(tmp_path, extra, False)
    capsys.readouterr()
    warm_up, graphs = warmup.warm_up, []

    def counted(run_, comm):
        words = warm_up(run_, comm)
        graphs.append(counters["stats"]["unique_graphs"])
        return words

    monkeypatch.setattr(warmup, "warm_up", counted)
    before = counters["stats"]["unique_graphs"]
    compiled_P = final_P(tmp_path, extra, True)
    assert graphs[0] > before and counters["stats"]["unique_graphs"] == graphs[0]
    err = capsys.readouterr().err
    assert err.count("side-by-side step compiled in") == 1 and "failed" not in err, err  # once a run
    scale = eager_P.abs().max().item()
    assert (eager_P - compiled_P).abs().max().item() <= TOL * scale


@pytest.mark.e2e
def test_compile_with_one_after_another_says_so(tmp_path, capsys):
    final_P(tmp_path, [], True, parallel=1, progress=True)
    assert "compile applies to side by side only" in capsys.readouterr().err


@pytest.mark.e2e
def test_a_compiler_failure_is_one_line_and_the_eager_step(tmp_path, capsys, monkeypatch):
    eager_P = final_P(tmp_path, [], False)

    def refuse(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("no backend for this model\nsecond line")
        return compiled

    monkeypatch.setattr(compiled.torch, "compile", refuse)
    capsys.readouterr()
    P = final_P(tmp_path, [], True)
    err = capsys.readouterr().err
    assert err.count("run.compile: torch.compile failed (RuntimeError: no backend for this model") == 1, err
    assert "Traceback" not in err
    assert torch.equal(P, eager_P)


@pytest.mark.slow
@pytest.mark.processes  # inductor runs the C++ compiler
@pytest.mark.e2e
def test_a_later_run_loads_the_compiled_step_from_the_cache(tmp_path, capsys, monkeypatch):
    """The compiled graphs are kept in FEDDDP_CACHE (not inductor's /tmp): a later run of the
    same step (here after torch._dynamo.reset(), as a new process starts) loads them from disk
    instead of compiling, and says so in its line."""
    monkeypatch.setenv("FEDDDP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    first = final_P(tmp_path / "first", [], True)
    assert os.listdir(tmp_path / "cache" / "inductor")
    torch._dynamo.reset()  # forget what this process compiled: only the disk is left
    hits = compiled.compile_cache_hits()
    second = final_P(tmp_path / "second", [], True)
    assert compiled.compile_cache_hits() > hits
    assert torch.equal(first, second)
    err = capsys.readouterr().err
    assert "kept in" in err and "graph(s) loaded from" in err
