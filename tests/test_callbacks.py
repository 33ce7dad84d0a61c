"""Callbacks (fedddp.callbacks, run.callbacks): events in order with their rounds, early stopping,
bits that no callback can change, failures as one line, and the W&B and MLflow loggers against
fake packages (neither is a test dependency)."""

import importlib
import os
import re
import sys
import textwrap
import types

import pytest

from fedddp import callbacks, checkpoint, checks
from fedddp.__main__ import main
from fedrun import QUICKSTART, REPO, assert_same_state, final_state, metrics, run_here

SHORT = ["run.rounds=4", "run.clients_per_round=4", "run.eval_every=2", "run.ckpt_every=2"]

MODULE = '''
import random

import numpy as np
import torch

from fedddp.callbacks import Callback

EVENTS = []


class Recorder(Callback):
    def on_run_start(self, info):
        EVENTS.append(("run_start", info["start_round"], info["rounds"], info["config"]["run"]["rounds"]))

    def on_round_start(self, round):
        EVENTS.append(("round_start", round))

    def on_evaluate(self, round, metrics):
        EVENTS.append(("evaluate", round, sorted(metrics)))

    def on_checkpoint(self, round, folder):
        EVENTS.append(("checkpoint", round, folder))

    def on_round_end(self, round, row, model):
        EVENTS.append(("round_end", round, row, model.state_dict(), model.flat()))

    def on_run_end(self, last_round, stopped):
        EVENTS.append(("run_end", last_round, stopped))


class StopAtTwo(Callback):
    def on_round_end(self, round, row, model):
        return round == 2

    def on_run_end(self, last_round, stopped):
        EVENTS.append(("run_end", last_round, stopped))


class Meddler(Callback):
    """Reads everything, changes everything it is given, and draws from every generator."""

    def on_run_start(self, info):
        info["config"]["run"]["rounds"] = 1
        info["config"]["train"]["lr"] = 10.0

    def on_evaluate(self, round, metrics):
        metrics.clear()

    def on_round_end(self, round, row, model):
        row["train_loss"] = float("nan")
        row.clear()
        model.flat().add_(1.0)
        for tensor in model.state_dict().values():
            tensor.zero_()
        torch.manual_seed(1234)
        torch.rand(100)
        np.random.seed(5)
        np.random.rand(10)
        random.seed(7)
        random.random()
        return False


class Raises(Callback):
    def __init__(self, hook="on_round_end"):
        self.hook = hook

    def on_round_start(self, round):
        if self.hook == "on_round_start" and round == 2:
            raise ValueError("bad\\nthing at round start")

    def on_round_end(self, round, row, model):
        if self.hook == "on_round_end" and round == 2:
            raise ValueError("bad thing")


class RaisesAtStart(Raises):
    def __init__(self):
        super().__init__("on_round_start")


class Broken(Callback):
    def __init__(self):
        raise RuntimeError("cannot build")


not_a_callback = 42
'''


@pytest.fixture
def cbmod(tmp_path, monkeypatch, plugin_registries, request):
    """A module of callbacks in a folder of its own, the working directory (import paths resolve
    from it); a fresh name each test, so no test sees another's events."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    name = "cb_" + re.sub(r"\W", "_", request.node.name)
    (folder / f"{name}.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    yield name
    sys.modules.pop(name, None)


def events(name: str) -> list:
    return importlib.import_module(name).EVENTS


def one_line(capsys, args: list[str], status: int, *words: str) -> str:
    got = run_here(args, check=False)
    lines = capsys.readouterr().err.strip().splitlines()
    assert got == status and len(lines) == 1, (got, lines)
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.e2e
def test_events_in_order_with_their_rounds(tmp_path, cbmod):
    out = tmp_path / "run"
    run_here(SHORT + [f"run.out_dir={out}", f"run.callbacks={cbmod}:Recorder"])
    got = events(cbmod)
    kinds = [(e[0], e[1]) for e in got]
    expected = [("run_start", 1)]
    for r in range(1, 5):
        expected.append(("round_start", r))
        if r % 2 == 0:
            expected += [("evaluate", r), ("checkpoint", r)]
        expected.append(("round_end", r))
    expected.append(("run_end", 4))
    assert kinds == expected
    assert got[0] == ("run_start", 1, 4, 4)
    assert got[-1] == ("run_end", 4, False)
    assert next(e for e in got if e[0] == "evaluate")[2] == ["test_accuracy", "test_loss"]
    folders = [checkpoint.round_dir(os.path.join(str(out), "checkpoints"), r) for r in (2, 4)]
    assert [e[2] for e in got if e[0] == "checkpoint"] == folders
    rows = [e[2] for e in got if e[0] == "round_end"]
    assert rows == metrics(out)  # the round's metrics.jsonl object, as written
    last = [e for e in got if e[0] == "round_end"][-1]
    assert_same_state(last[3], final_state(out))
    assert last[4].dim() == 1 and last[4].numel() == sum(t.numel() for t in last[3].values())


@pytest.mark.e2e
def test_early_stopping_ends_after_the_round_with_final_pt(tmp_path, cbmod):
    stopped, two = tmp_path / "stopped", tmp_path / "two"
    run_here(["run.rounds=6", "run.clients_per_round=4", "run.eval_every=2", f"run.out_dir={stopped}",
              f"run.callbacks={cbmod}:StopAtTwo"])
    assert [row["round"] for row in metrics(stopped)] == [1, 2]
    assert events(cbmod) == [("run_end", 2, True)]
    run_here(["run.rounds=2", "run.clients_per_round=4", "run.eval_every=2", f"run.out_dir={two}"])
    assert_same_state(final_state(stopped), final_state(two))  # round 2's model, as a run of 2 rounds


@pytest.mark.e2e
def test_a_meddling_callback_changes_no_bit(tmp_path, cbmod):
    plain, meddled = tmp_path / "plain", tmp_path / "meddled"
    run_here(SHORT + [f"run.out_dir={plain}"])
    run_here(SHORT + [f"run.out_dir={meddled}", f"run.callbacks={cbmod}:Meddler,{cbmod}:Recorder"])
    assert_same_state(final_state(plain), final_state(meddled))
    drop = ("time_s", "train_s", "train_imbalance_s", "communicate_s", "aggregate_s", "evaluate_s", "checkpoint_s")
    same = [{k: v for k, v in row.items() if k not in drop} for row in metrics(plain)]
    assert [{k: v for k, v in row.items() if k not in drop} for row in metrics(meddled)] == same
    # the Recorder after the Meddler still sees the untouched row and model
    seen = [e[2] for e in events(cbmod) if e[0] == "round_end"]
    assert [{k: v for k, v in row.items() if k not in drop} for row in seen] == same
    assert_same_state([e for e in events(cbmod) if e[0] == "round_end"][-1][3], final_state(plain))


@pytest.mark.e2e
@pytest.mark.parametrize("attr, words", [("Raises", ["on_round_end raised ValueError: bad thing"]),
                                         ("RaisesAtStart", ["on_round_start raised ValueError: bad thing at round"]),
                                         ("Broken", ["Broken raised RuntimeError: cannot build"])])
def test_a_raising_callback_is_one_line_exit_7(tmp_path, cbmod, capsys, attr, words):
    out = tmp_path / "run"
    line = one_line(capsys, SHORT + [f"run.out_dir={out}", f"run.callbacks={cbmod}:{attr}"], 7, "run.callbacks",
                    f"{cbmod}:{attr}", *words)
    assert "Traceback" not in line
    assert not (out / "final.pt").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("path, words", [("no_such_module:Thing", ["cannot import 'no_such_module'"]),
                                         ("{mod}:Missing", ["has no attribute 'Missing'"]),
                                         ("{mod}:not_a_callback", ["is a int", "callback"]),
                                         ("NoColon", ["not an import path"])])
def test_an_unknown_callback_is_one_line_exit_2(tmp_path, cbmod, capsys, path, words):
    path = path.format(mod=cbmod)
    one_line(capsys, SHORT + [f"run.out_dir={tmp_path / 'run'}", f"run.callbacks={path}"], 2, "run.callbacks",
             *words)
    assert not (tmp_path / "run").exists()
    # --check refuses it alike, before any rank starts
    assert main(["--check", QUICKSTART, f"run.callbacks={path}", "run.progress=false"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "run.callbacks" in lines[0], lines


def test_a_toml_list_of_callbacks_and_the_example(monkeypatch, plugin_registries):
    monkeypatch.chdir(REPO)
    cfg = checks.load({"run": {"callbacks": ["examples.my_plugin:EarlyStop", "fedddp.callbacks:Callback"]}})
    assert callbacks.paths(cfg.run.callbacks) == ["examples.my_plugin:EarlyStop", "fedddp.callbacks:Callback"]
    stop = callbacks.Runner(cfg.run.callbacks).callbacks[0][1]
    answers = [stop.on_round_end(r, {"test_accuracy": acc}, None) for r, acc in
               enumerate([0.5, None, 0.6, 0.6, 0.55, 0.6], 1)]
    assert answers == [False, False, False, False, False, True]


def fake(name: str, calls: list, *functions: str) -> types.ModuleType:
    module = types.ModuleType(name)
    for function in functions:
        setattr(module, function, lambda *args, _f=function, **kwargs: calls.append((_f, args, kwargs)))
    return module


@pytest.mark.e2e
def test_the_wandb_logger_logs_every_number_per_round(tmp_path, monkeypatch, plugin_registries):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake("wandb", calls, "init", "log", "finish"))
    monkeypatch.setenv("WANDB_PROJECT", "myproject")
    out = tmp_path / "run"
    run_here(SHORT + [f"run.out_dir={out}", "run.callbacks=fedddp.callbacks:WandbLogger"])
    assert [c[0] for c in calls] == ["init"] + ["log"] * 4 + ["finish"]
    init = calls[0][2]
    assert init["project"] == "myproject" and init["name"] == "run" and init["config"]["run.rounds"] == 4
    rows = metrics(out)
    for (_, args, kwargs), row in zip(calls[1:5], rows):
        assert kwargs["step"] == row["round"]
        assert args[0]["train_loss"] == row["train_loss"]
        assert "clients" not in args[0] and "round" not in args[0]
        assert ("test_accuracy" in args[0]) == (row["test_accuracy"] is not None)


@pytest.mark.e2e
def test_the_mlflow_logger_logs_params_and_every_number_per_round(tmp_path, monkeypatch, plugin_registries):
    calls = []
    monkeypatch.setitem(sys.modules, "mlflow", fake("mlflow", calls, "start_run", "log_params", "log_metrics",
                                                    "end_run"))
    out = tmp_path / "run"
    run_here(SHORT + [f"run.out_dir={out}", "run.callbacks=fedddp.callbacks:MlflowLogger"])
    assert [c[0] for c in calls] == ["start_run", "log_params"] + ["log_metrics"] * 4 + ["end_run"]
    assert calls[1][1][0]["run.rounds"] == "4" and calls[1][1][0]["algorithm.name"] == "fedavg"
    rows = metrics(out)
    assert [c[2]["step"] for c in calls[2:6]] == [row["round"] for row in rows]
    assert [c[1][0]["train_loss"] for c in calls[2:6]] == [row["train_loss"] for row in rows]


@pytest.mark.parametrize("logger, extra", [("WandbLogger", "wandb"), ("MlflowLogger", "mlflow")])
def test_a_missing_logger_package_names_the_extra(tmp_path, monkeypatch, capsys, plugin_registries, logger, extra):
    monkeypatch.setitem(sys.modules, extra, None)  # as if not installed (it is not a test dependency)
    errors = callbacks.check(f"fedddp.callbacks:{logger}")
    assert len(errors) == 1 and f"pip install 'fedddp[{extra}]'" in errors[0], errors
    status = main(["--check", QUICKSTART, f"run.callbacks=fedddp.callbacks:{logger}", "run.progress=false"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and f"pip install 'fedddp[{extra}]'" in lines[0], lines
