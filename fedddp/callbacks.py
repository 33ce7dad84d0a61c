"""Callbacks: your code at a run's events, on rank 0, by import path (``run.callbacks``).

    run.callbacks = "examples.my_plugin:EarlyStop,fedddp.callbacks:WandbLogger"

Each ``module:attr`` names a class (built with no arguments) or an object; its methods (any of
``Callback``'s, the others keep the no-op default) are called on rank 0 only, in the order the
paths are listed: ``on_run_start`` once the run knows its first round, ``on_round_start`` before a
round trains, ``on_evaluate`` after a round's test evaluation, ``on_round_end`` after the round's
rows are written (and its checkpoint, if any, completed), with the metrics.jsonl row and a
read-only view of the model, ``on_checkpoint`` after a checkpoint completes, ``on_run_end`` after
final.pt. ``on_round_end`` returning True stops the run after that round: every rank learns it from
rank 0, final.pt is written and the run ends with status 0 (docs/running.md, "Callbacks and
loggers").

A callback cannot change the run's bits: it is given copies (the row, the config) and clones (the
model), and the random number generators (torch's CPU one, numpy's, Python's) are restored after
each call. What a callback raises is one line naming it (PluginError, exit 7), said when the round
ends; the run stops there.

``WandbLogger`` and ``MlflowLogger`` log every number of metrics.jsonl per round to Weights &
Biases and MLflow; they import their packages only when used (the optional extras
``fedddp[wandb]``, ``fedddp[mlflow]``).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import random
import sys

import numpy as np
import torch

from . import plugins
from .errors import ConfigError, UserError

KEY = "run.callbacks"
WHAT = "a callback: a class (built with no arguments) or an object with on_round_end and the other hooks " \
       "of fedddp.callbacks.Callback"
HOOKS = ("on_run_start", "on_round_start", "on_evaluate", "on_round_end", "on_checkpoint", "on_run_end")


class Callback:
    """The interface: subclass it and override the hooks you need (each a no-op here). Rounds are
    counted from 1. Everything a hook is given is its own copy: changing it changes nothing of the
    run."""

    def on_run_start(self, info: dict) -> None:
        """Once, before the first round: ``info`` holds ``out_dir``, ``start_round`` (> 1 when
        resuming), ``rounds`` and ``config`` (the resolved config as nested dicts, config.toml's
        values)."""

    def on_round_start(self, round: int) -> None:
        """Before round ``round`` trains."""

    def on_evaluate(self, round: int, metrics: dict) -> None:
        """After a round's evaluation (every run.eval_every rounds and the last): ``metrics`` holds
        test_loss and the task's metric (test_accuracy or test_mae), and with run.client_eval_every
        the client_eval_* keys of the round."""

    def on_round_end(self, round: int, row: dict, model: "ModelView") -> bool | None:
        """After the round's rows are written: ``row`` is the round's metrics.jsonl object,
        ``model`` a read-only view of the new global model. Return True to stop the run after
        this round (final.pt is written; early stopping)."""

    def on_checkpoint(self, round: int, folder: str) -> None:
        """After the checkpoint of round ``round`` completes in ``folder``."""

    def on_run_end(self, last_round: int, stopped: bool) -> None:
        """After final.pt (or the line of run.stop_after): the last round run, and whether a
        callback stopped the run."""


class ModelView:
    """The global model after a round, read-only: every call returns a fresh CPU copy."""

    def __init__(self, flat_P: torch.Tensor, layout):
        self._flat_P, self._layout = flat_P, layout

    def flat(self) -> torch.Tensor:
        """The flat parameter vector (fedddp.flat), a CPU clone."""
        return self._flat_P.detach().to("cpu", copy=True)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A state_dict of the model (CPU, original dtypes): what final.pt would hold."""
        return self._layout.state_dict(self._flat_P)


def paths(value: str) -> list[str]:
    """run.callbacks' import paths: comma-separated, blanks ignored."""
    return [p.strip() for p in value.split(",") if p.strip()]


def _load(path: str):
    if not plugins.is_path(path):
        raise ConfigError(f"{KEY}: {path!r} is not an import path; write module:attr, e.g. "
                          "examples.my_plugin:EarlyStop or fedddp.callbacks:WandbLogger")
    obj = plugins.get(path, KEY, WHAT)
    if not isinstance(obj, type) and not any(callable(getattr(obj, h, None)) for h in HOOKS):
        raise ConfigError(f"{KEY}: {path!r} is a {type(obj).__name__}; it must be {WHAT}")
    needs = getattr(obj, "requires", None)  # an optional package: WandbLogger, MlflowLogger
    if needs is not None:
        require(needs, getattr(obj, "install", None), path)
    return obj


def check(value: str) -> list[str]:
    """One error line per path of run.callbacks that does not import, is no callback or needs a
    package that is not installed (checks.validate: at load, by --check, on every rank)."""
    errors = []
    for path in paths(value):
        try:
            _load(path)
        except ConfigError as exc:
            errors.append(str(exc))
    return errors


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(package: str, install: str | None = None, who: str | None = None):
    """The optional package ``package``, imported; a missing one is one ConfigError line naming
    what to install (``install``, default pip install PACKAGE) for the callback ``who``."""
    install = install or f"pip install {package}"
    who = who or f"the {package} callback"
    if not _installed(package):
        raise ConfigError(f"{KEY}: {who} needs the {package} package, which is not installed: "
                          f"{install}, or remove it from run.callbacks")
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        cause = " ".join(str(exc).split())
        raise ConfigError(f"{KEY}: {who} cannot import {package} ({type(exc).__name__}: {cause}): {install}") from None


class _SavedRandomness:
    """The random number generators a run may read, restored after a callback's call."""

    def __enter__(self):
        self.torch, self.numpy, self.python = torch.get_rng_state(), np.random.get_state(), random.getstate()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None
        return self

    def __exit__(self, *exc):
        torch.set_rng_state(self.torch)
        np.random.set_state(self.numpy)
        random.setstate(self.python)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        return False


class Runner:
    """Rank 0's callbacks of a run: each event to each callback in order, under plugins.calling.
    The first failure is kept (``error``) and later events are not called; the round loop raises
    it when the round ends, after every rank has learned of it."""

    def __init__(self, value: str):
        self.error: Exception | None = None
        self.stop = False
        self.callbacks: list[tuple[str, object]] = []
        for path in paths(value):
            obj = self._guarded(path, "__init__", lambda: _load(path))
            if self.error is not None:
                break
            if isinstance(obj, type):
                obj = self._guarded(path, "__init__", obj)
            self.callbacks.append((path, obj))

    def __bool__(self) -> bool:
        return bool(self.callbacks) or self.error is not None

    def _guarded(self, path: str, hook: str, call, *args):
        if self.error is not None:
            return None
        try:
            with _SavedRandomness(), plugins.calling(KEY, f"{path}.{hook}" if hook != "__init__" else path):
                return call(*args)
        except UserError as exc:  # plugins.calling made anything else a PluginError
            self.error = exc
        return None

    def _each(self, hook: str, *make_args) -> list:
        """``hook`` on every callback, each given its own copies (``make_args``: functions)."""
        results = []
        for path, obj in self.callbacks:
            method = getattr(obj, hook, None)
            if callable(method):
                results.append(self._guarded(path, hook, method, *[make() for make in make_args]))
        return results

    def run_start(self, info: dict) -> None:
        self._each("on_run_start", lambda: copy.deepcopy(info))

    def round_start(self, round_idx: int) -> None:
        self._each("on_round_start", lambda: round_idx)

    def evaluate(self, round_idx: int, metrics: dict) -> None:
        self._each("on_evaluate", lambda: round_idx, lambda: copy.deepcopy(metrics))

    def round_end(self, round_idx: int, row: dict, flat_P: torch.Tensor, layout) -> bool:
        """True when a callback asked to stop (and none failed)."""
        results = self._each("on_round_end", lambda: round_idx, lambda: copy.deepcopy(row),
                             lambda: ModelView(flat_P, layout))
        self.stop = self.error is None and any(r is True for r in results)
        return self.stop

    def checkpoint(self, round_idx: int, folder: str) -> None:
        self._each("on_checkpoint", lambda: round_idx, lambda: folder)

    def run_end(self, last_round: int) -> None:
        self._each("on_run_end", lambda: last_round, lambda: self.stop)


def numbers(row: dict) -> dict[str, float]:
    """The numbers of a metrics.jsonl row (no lists, no nulls, no booleans), but its round."""
    return {k: float(v) for k, v in row.items()
            if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat_config(config: dict, prefix: str = "") -> dict[str, object]:
    """Nested config tables as dotted keys: run.rounds -> 20."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out |= flat_config(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


class WandbLogger(Callback):
    """Every number of metrics.jsonl to Weights & Biases, per round (its step). The project is
    WANDB_PROJECT (default fedddp), the run's name the last part of run.out_dir; wandb's other
    settings (entity, mode, API key) come from its environment variables. Needs the extra:
    pip install 'fedddp[wandb]'."""

    requires, install = "wandb", "pip install 'fedddp[wandb]'"

    def on_run_start(self, info: dict) -> None:
        self.wandb = require(self.requires, self.install, "fedddp.callbacks:WandbLogger")
        self.run = self.wandb.init(project=os.environ.get("WANDB_PROJECT", "fedddp"),
                                   name=os.path.basename(os.path.normpath(info["out_dir"])),
                                   config=flat_config(info["config"]), dir=info["out_dir"])

    def on_round_end(self, round: int, row: dict, model: ModelView) -> None:
        self.wandb.log(numbers(row), step=round)

    def on_run_end(self, last_round: int, stopped: bool) -> None:
        self.wandb.finish()


class MlflowLogger(Callback):
    """Every number of metrics.jsonl to MLflow, per round (its step), and the config's values as
    the run's parameters. The tracking URI and experiment come from MLflow's environment
    variables (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME); the run's name is the last part of
    run.out_dir. Needs the extra: pip install 'fedddp[mlflow]'."""

    requires, install = "mlflow", "pip install 'fedddp[mlflow]'"

    def on_run_start(self, info: dict) -> None:
        self.mlflow = require(self.requires, self.install, "fedddp.callbacks:MlflowLogger")
        self.mlflow.start_run(run_name=os.path.basename(os.path.normpath(info["out_dir"])))
        # MLflow keeps parameters as strings of at most 500 characters
        self.mlflow.log_params({k: str(v)[:500] for k, v in flat_config(info["config"]).items()})

    def on_round_end(self, round: int, row: dict, model: ModelView) -> None:
        self.mlflow.log_metrics(numbers(row), step=round)

    def on_run_end(self, last_round: int, stopped: bool) -> None:
        self.mlflow.end_run()
