"""Run one experiment on this machine's ranks: torchrun's launcher, ending as fedddp does.

  python -m fedddp.launch CONFIG.toml [section.key=value ...] [--nproc N] [--max-restarts R]
  python -m fedddp.launch configs/quickstart.toml                     one rank per GPU (2 without)
  python -m fedddp.launch configs/feder_cifar100.toml --nproc 4 --max-restarts 3 run.ckpt_every=10

The ranks are ``python -m fedddp CONFIG [overrides]`` each, started by torch's elastic agent (what
``torchrun --standalone --nproc_per_node=N --max-restarts=R -m fedddp`` runs) inside this
process. First the config, its overrides and every client's data are checked here, as by
``python -m fedddp --check`` (--no-check skips that: data too big to load twice). Then:

- a rank's error is fedddp's one line on stderr and fedddp's exit status (2 to 7: README.md), not
  torchrun's ChildFailedError traceback and status 1. The ranks leave status and line in
  FEDDDP_STATUS_FILE (fedddp/env.py); the line a rank printed is not printed again, unless
  several ranks left one: then the run's own (the lowest rank's) is printed again, last;
- SIGTERM (what Slurm sends), SIGINT (Ctrl-C) or SIGHUP stops the ranks (the signal passed on
  to each, SIGINT as SIGTERM, which ends a rank without a line of its own; a rank still running
  after torch's shutdown timeout, 30 s, is killed), waits for them, and ends with one line and
  128 + the signal's number (143, 130, 129). The run continues from its last checkpoint
  (run.ckpt_every) with the same command and run.resume=true;
- torchrun's own log (its warnings, the failure report) is left out; --verbose keeps it.

OMP_NUM_THREADS=1 and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 are set for the ranks unless exported
(docs/launching.md). launch/local.sh is this command with its options from the environment.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import tempfile
import uuid

from .__main__ import check as fedddp_check  # first: it sets torch's allocator options

from . import env as fedddp_env
from .errors import UserError

# torch and torchrun are imported where first needed (_agent), after the check of the config:
# --help and a mistake in the config answer without the seconds torch takes to load.
PROG = "python -m fedddp.launch"
# The loggers of torchrun's agent: the banners, "Sending process ... closing signal", failures.
TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# What the ranks see unless exported: torchrun's OMP_NUM_THREADS without its banner, and a fresh
# store for each restarted group (pytorch/pytorch#135712; docs/launching.md, "Restarts").
RANK_ENV = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@functools.cache
def _agent():
    """torch's elastic agent and what it raises, imported on first use."""
    import types

    import torch
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    return types.SimpleNamespace(torch=torch, torchrun=torchrun, SignalException=SignalException,
                                 ChildFailedError=ChildFailedError)


def __getattr__(name: str):
    if name in ("torch", "torchrun", "SignalException", "ChildFailedError"):
        return getattr(_agent(), name)
    raise AttributeError(f"module 'fedddp.launch' has no attribute {name!r}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="experiment TOML (configs/...)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as for python -m fedddp")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to start (default: the visible GPUs, 2 without any)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="torchrun --max-restarts: a rank that dies brings the group back, which "
                             "continues from its last checkpoint (default 0)")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="start the ranks without checking the config and data here first")
    parser.add_argument("--verbose", action="store_true",
                        help="keep torchrun's own log, and the start line's long form")
    args = parser.parse_intermixed_args(argv)
    if args.nproc is not None and args.nproc < 1:
        parser.error("--nproc must be at least 1")
    if args.max_restarts < 0:
        parser.error("--max-restarts must be at least 0")
    return args


def default_nproc() -> int:
    """One rank per visible GPU, 2 on a machine without any."""
    return _agent().torch.cuda.device_count() or 2


def fedddp_argv(args: argparse.Namespace) -> list[str]:
    return [args.config, *args.overrides]


def torchrun_argv(args: argparse.Namespace, nproc: int) -> list[str]:
    """torchrun's command line for the ranks: ``--standalone``, spelled out (a c10d store on a
    free port of this machine)."""
    argv = ["--nnodes=1", f"--nproc_per_node={nproc}", f"--max_restarts={args.max_restarts}",
            "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", f"--rdzv_id={uuid.uuid4()}"]
    if hasattr(_agent().torchrun.LaunchConfig, "signals_to_handle"):
        # SIGINT is this module's (Stop): the ranks get SIGTERM, which ends them without a line each.
        argv.append("--signals_to_handle=SIGTERM,SIGHUP,SIGQUIT")
    return argv + ["--module", "fedddp", *(["--verbose"] if args.verbose else []), *fedddp_argv(args)]


class Stopped(BaseException):
    """A stop signal that came before the agent ran (a BaseException: the check's own
    ``except Exception`` around a user's code must not take it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stop:
    """The handler of STOP_SIGNALS: remembers the first signal and raises, as Stopped before the
    ranks start and as the agent's own SignalException after (the agent then stops its ranks with
    SIGTERM for SIGINT, else with the signal itself). A second signal is ignored: the ranks are
    being stopped already."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.launched = False

    def __call__(self, signum: int, frame) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        if not self.launched:
            raise Stopped(signum)
        forward = signal.SIGTERM if signum == signal.SIGINT else signal.Signals(signum)
        raise _agent().SignalException(f"{PROG} got {signal.Signals(signum).name}", sigval=forward)


def quiet_torchrun() -> None:
    """torchrun's agent logs through these loggers to torch's handler on stderr: not here."""
    for name in TORCH_LOGGERS:
        logger = logging.getLogger(name)
        logger.propagate = False
        logger.addHandler(logging.NullHandler())


def stopped_line(signum: int, out_dir: str | None, started: bool = True) -> str:
    """What a stopped run says: the signal, and how the run continues (from the newest complete
    checkpoint in ``out_dir``, where the check found the run's folder)."""
    said = f"fedddp: stopped by {signal.Signals(signum).name}"
    if not started:
        return f"{said} before any rank started"
    from . import checkpoint

    words = checkpoint.how_to_continue(out_dir)
    return f"{said} {words}" if words.startswith("before") else f"{said}; {words}"


def failed_line(exc) -> str:
    """A failure no rank explained (torchrun's ChildFailedError: a rank killed, or fedddp's own
    traceback above): who, how."""
    rank, failure = exc.get_first_failure()
    code = failure.exitcode
    how = (f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
           else f"exited with status {code}")
    return f"fedddp: error: rank {rank} {how}"


def launch(args: argparse.Namespace, stop: Stop) -> int:
    """The ranks under torch's elastic agent, in this process; fedddp's exit status."""
    out_dir = None
    if args.check:
        path, overrides = (None, fedddp_argv(args)) if "=" in args.config else (args.config, args.overrides)
        try:
            out_dir = fedddp_check(path, overrides).run.out_dir
        except UserError as exc:
            print(f"fedddp: error: {exc}", file=sys.stderr)
            return exc.exit_code
    for key, value in RANK_ENV.items():
        os.environ.setdefault(key, value)
    if not args.verbose:
        quiet_torchrun()
    agent = _agent()
    torchrun_args = agent.torchrun.parse_args(torchrun_argv(args, args.nproc or default_nproc()))
    fd, status_path = tempfile.mkstemp(prefix="fedddp-status.")
    os.close(fd)
    os.environ[fedddp_env.STATUS_FILE_VAR] = status_path
    try:
        stop.launched = True
        agent.torchrun.run(torchrun_args)
        return 0
    except agent.SignalException as exc:
        signum = stop.signum or exc.sigval
        # On a terminal rank 0's progress line is open (rewritten in place): ours goes below it.
        print("\n" * sys.stderr.isatty() + stopped_line(signum, out_dir), file=sys.stderr)
        return 128 + signum
    except agent.ChildFailedError as exc:
        if args.verbose:
            print(exc, file=sys.stderr)  # torchrun's report of the failed ranks
        records = fedddp_env.read_status(status_path)
        if not records:
            print(failed_line(exc) + ("" if args.verbose else f"; {PROG} --verbose shows torchrun's report"),
                  file=sys.stderr)
            return 1
        code, _, line = records[0]
        if len(records) > 1 or args.verbose:  # the run's own line, last
            print(line, file=sys.stderr)
        return code
    finally:
        os.environ.pop(fedddp_env.STATUS_FILE_VAR, None)
        os.remove(status_path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    stop = Stop()
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)
    try:
        return launch(args, stop)
    except Stopped as exc:  # before any rank started
        print(stopped_line(exc.signum, None, started=False), file=sys.stderr)
        return 128 + exc.signum


if __name__ == "__main__":
    sys.exit(main())
