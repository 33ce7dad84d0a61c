"""The warm-up before round 1 (fedddp.warmup): on CUDA, or with run.compile, the first calls of
the local step and of the server rule's fused form run on throwaway inputs. Here it is switched
on for CPU runs (its server part on CPU tensors too) and must change no bit of the run: model,
buffers, server state and torch's random state are left as they were. (That the graph compiled
in it is the one the rounds use: tests/test_compile.py.)"""

from __future__ import annotations

import pytest
import torch

from fedddp import checks, warmup
from fedddp.comm import Comm
from fedddp.env import ProcessEnv
from fedddp.round import run

from fedrun import QUICKSTART

SINGLE = ProcessEnv(0, 1, 0, "127.0.0.1", 0, "single")
SMALL = ["run.clients_per_round=5", "run.rounds=2", "run.eval_every=100", "train.batch_size=16",
         "model.name=mlp", "model.hidden=16", "run.progress=true"]
CASES = [["run.parallel_clients=1", "algorithm.name=fedgma"],
         ["run.parallel_clients=3", "algorithm.name=fedmom", "algorithm.server_momentum=0.9"],
         ["run.parallel_clients=3", "algorithm.name=fedprox", "model.name=test_parallel_clients:dropout_mlp"],
         # BatchNorm statistics that stay on the model from client to client: the warm-up's forward
         # in training mode must not leave its own there
         ["run.parallel_clients=1", "algorithm.name=cgw", "model.name=test_parallel_clients:dropout_batch_norm_mlp",
          "train.batch_size=15", "model.flat_buffers=false"]]


def final_P(tmp_path, overrides: list[str]) -> torch.Tensor:
    cfg = checks.load(QUICKSTART, SMALL + overrides + [f"run.out_dir={tmp_path}", "run.overwrite=true"])
    return run(cfg, Comm(SINGLE, "cpu"))["global_P"]


@pytest.mark.parametrize("extra", CASES, ids=[" ".join(case) for case in CASES])
@pytest.mark.e2e
def test_the_warm_up_changes_no_bit(tmp_path, extra, capsys, monkeypatch):
    cold_P = final_P(tmp_path / "cold", extra)
    assert "warm-up" not in capsys.readouterr().err  # CPU without run.compile: none
    monkeypatch.setattr(warmup, "needed", lambda rc, device: True)
    monkeypatch.setattr(warmup, "SERVER_DEVICES", ("cpu",))
    ran = []
    for name in ("_local", "_server"):
        step = getattr(warmup, name)
        monkeypatch.setattr(warmup, name, lambda run_, comm, step=step, name=name: (ran.append(name), step(run_, comm)))
    warm_P = final_P(tmp_path / "warm", extra)
    err = capsys.readouterr().err
    assert ran == ["_local", "_server"] and "s before round 1" in err and "skipped" not in err, err
    assert torch.equal(cold_P, warm_P)


def test_a_failing_warm_up_is_said_and_skipped(tmp_path, capsys, monkeypatch):
    """A warm-up on made-up inputs that raises (a plugin rule might) is named in the start line;
    the run goes on and gives the bits it gives without one."""
    cold_P = final_P(tmp_path / "cold", CASES[0])
    monkeypatch.setattr(warmup, "needed", lambda rc, device: True)

    def refuse(run_, comm):
        raise ValueError("made-up reports")

    monkeypatch.setattr(warmup, "_local", refuse)
    warm_P = final_P(tmp_path / "warm", CASES[0])
    assert "(skipped: local step: ValueError)" in capsys.readouterr().err
    assert torch.equal(cold_P, warm_P)
