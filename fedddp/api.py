"""The one path from a config to a finished run, for ``python -m fedddp`` and ``fedddp.run``.

``execute`` resolves the process (torchrun, Slurm or one process), loads the config, joins or
starts the process group and runs the rounds; the CLI turns its errors into one line and an exit
status, ``run`` (the Python API) raises them and returns a ``Result`` on every rank, leaving
torch's global settings as it found them (docs/python_api.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Mapping

import torch

from . import checkpoint, checks, config as config_module, env, tasks
from .algorithms import build_model
from .data import build
from .outdir import check_out_dir
from .client import LocalTraining
from .prepare import refuse_before_round_one, trainer_to_check
from .resume import refuse_before_data
from .comm import Comm
from .round import run as run_rounds
from .errors import ERRORS, UserError


@dataclasses.dataclass(frozen=True)
class Result:
    """What a run leaves, the same on every rank: ``metrics`` the rows of metrics.jsonl as dicts
    (rounds of an earlier run included when resuming), ``state_dict`` the global model after the
    last round run (CPU tensors, bitwise final.pt's when the run reached run.rounds),
    ``config`` the resolved configuration and ``out_dir`` the run folder as an absolute path."""

    metrics: list[dict[str, Any]]
    state_dict: dict[str, Any]
    config: config_module.Config
    out_dir: str


def run(config: str | os.PathLike | Mapping[str, Any] | config_module.Config,
        overrides: list[str] | tuple[str, ...] = (), out_dir: str | os.PathLike | None = None) -> Result:
    """Run one experiment in this process, as ``python -m fedddp`` would, and return its Result.

    ``config`` is a TOML file or its tables as nested dicts (``{"run": {"rounds": 3}}``);
    ``overrides`` are ``section.key=value`` strings applied after it; ``out_dir`` replaces
    run.out_dir. One process without a launcher is a world of one; under torchrun or srun
    every rank calls it, in a process group of its own or one the script already initialised
    (kept). A user's mistake raises ConfigError, DataError, DivergenceError, DiskFullError or
    StalledError on every rank; the intra-op thread count, the default dtype and the random
    number generators' states are restored on return."""
    if isinstance(config, config_module.Config):
        config = dataclasses.asdict(config)
    overrides = [overrides] if isinstance(overrides, str) else list(overrides)
    if out_dir is not None:
        overrides.append(f"run.out_dir={os.fspath(out_dir)}")
    saved = _TorchGlobals()
    try:
        return execute(env.resolve(), config, overrides, result=True)
    except UserError as exc:
        # Rank 0's refusal reaches the other ranks as its exit status alone: raise the class of
        # that status, so one ``except fedddp.ConfigError`` serves every rank (status 1, a bug
        # on rank 0, has no class: its traceback is rank 0's).
        public = next((cls for cls in ERRORS if cls.exit_code == exc.exit_code), None)
        if isinstance(exc, ERRORS) or public is None:
            raise
        raise public(str(exc)) from None
    finally:
        saved.restore()


def execute(proc: env.ProcessEnv, source, overrides: list[str], result: bool = False) -> Result | None:
    """Load the config, run it on this rank and, with ``result``, collect the Result; errors
    propagate. The process group is closed at the end unless it was there before."""
    cfg = checks.load(source, overrides)

    comm = Comm(proc, cfg.run.device, cfg.run.collective_timeout_s)
    try:
        try:
            if _restarted_by_torchrun(comm) and not cfg.run.resume:
                cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=True))
                if comm.is_main:
                    print(f"fedddp: restarted by torchrun: resuming from the last checkpoint in "
                          f"{cfg.run.out_dir}", file=sys.stderr)
            outcome = run_rounds(cfg, comm)
            if not result:
                return None
            out_dir = outcome["config"].run.out_dir
            return Result(_metrics_rows(out_dir, comm), outcome["state_dict"], outcome["config"],
                          os.path.abspath(out_dir))
        except RuntimeError as exc:  # a collective timed out: a peer that stalled is named, not a traceback
            comm.explain_failure(exc)
            raise
    finally:
        comm.close()


def _metrics_rows(out_dir: str, comm) -> list[dict[str, Any]]:
    """metrics.jsonl's rows on every rank: the file is rank 0's, so its rows are broadcast rather
    than read on the other ranks, whose out_dir may not be the same folder (a node-local path on
    a cluster). Every rank holds the final global model already (it is broadcast each round)."""
    rows = None
    if comm.is_main:
        with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    return comm.broadcast_object(rows)


def _restarted_by_torchrun(comm) -> bool:
    """torchrun --max-restarts=N restarts the whole group after a rank dies: the new workers
    continue from the last checkpoint instead of starting over (docs/launching.md). The count
    is kept per node (an agent whose own workers were healthy restarts them without counting
    one), so the ranks agree first: any restarted rank makes every rank resume."""
    restarts = torch.tensor([float(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)],
                            device=comm.device)
    comm.all_reduce_sum_(restarts)
    return restarts.item() > 0


class _TorchGlobals:
    """torch's process-wide settings a run changes: the intra-op thread count (run.num_threads),
    the default dtype (pinned to float32) and the global generators (seeded with run.seed; CUDA's
    only where CUDA was initialised before the run, as an uninitialised one has no state yet),
    so a caller's later threads and random draws do not depend on having run fedddp."""

    def __init__(self):
        self.num_threads = torch.get_num_threads()
        self.dtype = torch.get_default_dtype()
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.set_num_threads(self.num_threads)
        torch.set_default_dtype(self.dtype)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def check(path, overrides: list[str], data: bool = True) -> config_module.Config:
    """``python -m fedddp --check``: the config, then (with ``data``) every client's data, in this
    process; a mistake raises the UserError the run would have raised. The refusals past the
    config are the run's own functions, called in its order, which write nothing: a refusal added
    to the run's setup is made here too."""
    cfg = checks.load(path, overrides)
    check_out_dir(cfg.run.out_dir)
    refuse_before_data(cfg.run, checkpoint.identity(cfg))
    if data:
        built = build(cfg, cfg.data.seed, range(cfg.data.num_clients))
        model = build_model(cfg, built.input_shape, built.num_classes, built.task)  # what the rules need of it
        training = LocalTraining.of(cfg, cfg.run.asked_parallel_clients())
        trainer = trainer_to_check(training, cfg.model.flat_buffers, model, tasks.get(built.task))
        refuse_before_round_one(trainer, built, range(cfg.data.num_clients), cfg.data)
    return cfg
