"""Submit one fedddp run to Slurm through submitit: one task (rank) per GPU, requeued on
preemption or time-out, resuming from the last checkpoint.

  python -m fedddp.slurm CONFIG.toml [section.key=value ...] [launcher flags]

  python -m fedddp.slurm configs/feder_cifar100.toml --nodes 1 --gpus-per-node 4 \\
      --partition PARTITION --account ACCOUNT --time 24:00:00 --output runs/slurm/%j
  python -m fedddp.slurm configs/quickstart.toml run.rounds=5 --local --gpus-per-node 0 --tasks-per-node 2

(``python launch/submit.py`` in a checkout is the same command.) Cluster settings are launcher
flags, never part of the experiment config. --dry-run checks as below, then prints the task's
command, submitit's parameters and the sbatch script submitit would write, and submits nothing
(no sbatch needed: a preview on a laptop). The config, its overrides and every client's data
are checked here, before anything is queued, as by ``python -m fedddp --check`` (fedddp's one
line and status: 2 config, 3 data; --no-data-check checks the config alone, for data only the
compute nodes see). With --wait a failed run ends with its rank's line and fedddp's status (6: a
rank stopped answering).

Requeue: Slurm sends USR2 to the tasks before the time limit or on preemption (--signal-delay
seconds ahead); submitit calls ``Trainer.checkpoint`` on rank 0, which resubmits the same run
with ``run.resume=true``, and requeues the job. The requeued run continues from the newest
complete checkpoint, so set ``run.ckpt_every`` (what was done since it is redone, identically).

fedddp.study.sweep --slurm submits its job arrays with this module's executor and task. Part of the
package (not a script beside it) so that an installed fedddp has it, and so that submitit
pickles the task by reference: a worker needs fedddp installed, nothing else.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
import tempfile

from .__main__ import check as fedddp_check, main as fedddp_main  # first: it sets torch's allocator options

import submitit

from . import config as fedddp_config
from . import env as fedddp_env
from .errors import ConfigError, UserError

RESUME = "run.resume=true"
# How a task's failure reads in submitit's error text: the status and fedddp's line.
FAILED = re.compile(r"fedddp exited with status (\d+): (.*)")


class Trainer(submitit.helpers.Checkpointable):
    """A submitit task: one rank of one fedddp run. ``argv`` is what ``python -m fedddp``
    would get (config path, then dotted overrides)."""

    def __init__(self, argv: list[str]):
        self.argv = list(argv)

    def __call__(self) -> int:
        export_rendezvous()
        var = fedddp_env.STATUS_FILE_VAR
        with tempfile.TemporaryDirectory() as folder:
            own = var not in os.environ
            # In a job, the job's folder, where --wait finds it even after a task that
            # ended without returning (a rank that finds another stalled exits at once).
            job = submitit.JobEnvironment() if os.environ.get("SUBMITIT_EXECUTOR") else None
            path = os.environ.setdefault(var, status_path(job.paths.folder, job.job_id) if job
                                         else os.path.join(folder, "status"))
            try:
                status = fedddp_main(self.argv)
            finally:
                if own:
                    del os.environ[var]
            line = _status_line(path) if status != 0 else ""
        if status != 0:  # submitit reports the job failed, with this text; --wait reads it back
            raise RuntimeError(f"fedddp exited with status {status}: {line or 'see this task stderr'}")
        return status

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on rank 0 when the job is preempted or times out: the same run,
        continued from its last checkpoint. (The round loop writes checkpoints itself, at
        run.ckpt_every; nothing is saved from a signal handler.)"""
        argv = [a for a in self.argv if not a.startswith("run.resume=")] + [RESUME]
        return submitit.helpers.DelayedSubmission(Trainer(argv))


def status_path(folder, job_id: str) -> str:
    return os.path.join(str(folder), f"{job_id}_status.tsv")


def _status(path: str) -> tuple[int, str] | None:
    """(status, fedddp's line) from a status file (fedddp.env.read_status), or None without one."""
    records = fedddp_env.read_status(path)
    return (records[0][0], records[0][2]) if records else None


def _status_line(path: str) -> str:
    found = _status(path)
    return found[1] if found else ""


def rendezvous_env(job: submitit.JobEnvironment, environ=os.environ) -> dict[str, str]:
    """torchrun's variables for this task, from submitit's view of the job. Works for Slurm
    tasks and for submitit's LocalExecutor, which sets no SLURM_* variables at all."""
    # The master is the first node of the job; with one node, loopback needs no name lookup.
    addr = job.hostnames[0] if job.num_nodes > 1 else "127.0.0.1"
    # Derived from the job id: every task agrees without talking, two jobs on a node differ.
    digits = "".join(ch for ch in str(job.raw_job_id) if ch.isdigit()) or "0"
    port = environ.get("MASTER_PORT") or str(20000 + int(digits) % 20000)
    return {"RANK": str(job.global_rank), "WORLD_SIZE": str(job.num_tasks),
            "LOCAL_RANK": str(job.local_rank), "MASTER_ADDR": addr, "MASTER_PORT": port}


def export_rendezvous() -> None:
    """Inside a submitit job, set torchrun's variables for fedddp.env; outside one (a task
    called directly, e.g. to debug it) leave the environment as it is."""
    if os.environ.get("SUBMITIT_EXECUTOR"):
        os.environ.update(rendezvous_env(submitit.JobEnvironment()))


def minutes(text: str) -> int:
    """Slurm-style time: MINUTES, HH:MM:SS, HH:MM (hours:minutes) or D-HH[:MM[:SS]]."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if not days and len(parts) == 1:
        total = parts[0]
    else:
        parts += [0] * (3 - len(parts))
        total = parts[0] * 60 + parts[1] + (parts[2] + 59) // 60
    return total + int(days or 0) * 24 * 60


PROG = "python -m fedddp.slurm"


def parse_args(argv: list[str], prog: str = PROG) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="experiment TOML (configs/...)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as for python -m fedddp")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=4, help="GPUs per node (0: a CPU job)")
    parser.add_argument("--tasks-per-node", type=int, default=None,
                        help="ranks per node (default: one per GPU, 1 without GPUs)")
    parser.add_argument("--cpus-per-task", type=int, default=8)
    parser.add_argument("--mem-gb", type=int, default=None, help="memory per node")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--account", default=None)
    parser.add_argument("--qos", default=None)
    parser.add_argument("--constraint", default=None)
    parser.add_argument("--time", default="24:00:00", help="time limit per attempt (Slurm syntax)")
    parser.add_argument("--max-requeues", type=int, default=10,
                        help="how many time-outs submitit requeues before giving up")
    parser.add_argument("--signal-delay", type=int, default=120,
                        help="seconds before the limit at which the job is told to stop")
    parser.add_argument("--output", default="runs/slurm/%j",
                        help="submitit folder (logs, pickles); %%j becomes the job id")
    parser.add_argument("--name", default=None, help="job name (default: the config's file name)")
    parser.add_argument("--local", action="store_true",
                        help="run on this machine with submitit's LocalExecutor (tests, debugging)")
    parser.add_argument("--wait", action="store_true", help="wait for the job and report its end")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the task's command, submitit's parameters and the sbatch script; submit nothing")
    parser.add_argument("--no-data-check", dest="data_check", action="store_false",
                        help="check the config alone before queueing, not the data (data that only "
                             "the compute nodes see)")
    return parser.parse_intermixed_args(argv)


def checked_argv(args: argparse.Namespace) -> tuple[list[str], fedddp_config.Config]:
    """The run's command line, checked now, with paths made absolute: a requeued task may
    start in another directory."""
    cfg = fedddp_check(args.config, args.overrides, data=args.data_check)
    overrides = [a for a in args.overrides if not a.startswith("run.out_dir=")]
    argv = [os.path.abspath(args.config)] + overrides + [f"run.out_dir={os.path.abspath(cfg.run.out_dir)}"]
    return argv, cfg


def make_executor(args: argparse.Namespace) -> submitit.AutoExecutor:
    if not args.local and shutil.which("sbatch") is None:
        raise ConfigError("sbatch not found: submit from a Slurm login node, or pass --local to run "
                          "the job on this machine")
    executor = submitit.AutoExecutor(folder=args.output, cluster="local" if args.local else "slurm",
                                     slurm_max_num_timeout=args.max_requeues)
    executor.update_parameters(**executor_params(args))
    return executor


def executor_params(args: argparse.Namespace) -> dict:
    """submitit's parameters of the job: AutoExecutor's shared ones, and slurm_* for Slurm's own."""
    tasks = args.tasks_per_node or max(args.gpus_per_node, 1)
    params = dict(name=args.name or os.path.splitext(os.path.basename(args.config))[0],
                  nodes=args.nodes, gpus_per_node=args.gpus_per_node, tasks_per_node=tasks,
                  cpus_per_task=args.cpus_per_task, timeout_min=minutes(args.time))
    if args.mem_gb is not None:
        params["mem_gb"] = args.mem_gb
    if not args.local:
        params["slurm_signal_delay_s"] = args.signal_delay
        for flag in ("partition", "account", "qos", "constraint"):
            if getattr(args, flag):
                params[f"slurm_{flag}"] = getattr(args, flag)
    return params


def sbatch_script(args: argparse.Namespace, array: int | None = None) -> str:
    """The sbatch script submitit writes for the job (a job array of ``array`` tasks), made by
    submitit's own function from the same parameters, submitting nothing."""
    from submitit.slurm import slurm as submitit_slurm  # its private helpers: the script, exactly

    names = submitit_slurm.SlurmExecutor._equivalence_dict()
    params = {key.removeprefix("slurm_") if key.startswith("slurm_") else names[key]: value
              for key, value in executor_params(args).items()}
    if "mem" in params:
        params["mem"] = submitit_slurm._convert_mem(params["mem"])
    folder = os.path.abspath(args.output)
    command = f"{shlex.quote(sys.executable)} -u -m submitit.core._submit {shlex.quote(folder)}"
    return submitit_slurm._make_sbatch_string(command=command, folder=folder, map_count=array, **params)


def dry_run(args: argparse.Namespace, tasks: list[list[str]]) -> str:
    """What --dry-run prints for a job of one task per ``python -m fedddp`` argv in ``tasks`` (a
    job array when several)."""
    where = "submitit's LocalExecutor on this machine" if args.local else "Slurm through submitit"
    shape = f"a job array of {len(tasks)} tasks" if len(tasks) > 1 else "one job"
    lines = [f"dry run: nothing submitted; would submit {shape} to {where}"]
    lines += [f"{f'array task {i}' if len(tasks) > 1 else 'each rank'} runs: python -m fedddp {shlex.join(argv)}"
              for i, argv in enumerate(tasks)]
    params = executor_params(args) | {"slurm_max_num_timeout": args.max_requeues}
    lines.append("submitit parameters: " + ", ".join(f"{k}={v}" for k, v in params.items()))
    if not args.local:
        lines += ["sbatch script (submitit's, its array and log paths as it writes them):",
                  sbatch_script(args, len(tasks) if len(tasks) > 1 else None).rstrip()]
    return "\n".join(lines)


class RunError(Exception):
    """fedddp's own mistake found before queueing (config or data): fedddp's line and status."""

    def __init__(self, error: UserError):
        super().__init__(str(error))
        self.exit_code = error.exit_code


def submit(argv: list[str], prog: str = PROG):
    """Parse, check and submit; returns the submitit job (None with --dry-run) and the parsed flags."""
    args = parse_args(argv, prog)
    try:
        run_argv, cfg = checked_argv(args)
    except UserError as exc:
        raise RunError(exc) from None
    if cfg.run.ckpt_every == 0:
        print("submit: note: run.ckpt_every = 0: a requeued job starts again from round 1",
              file=sys.stderr)
    if args.dry_run:
        print(dry_run(args, [run_argv]))
        return None, args
    job = make_executor(args).submit(Trainer(run_argv))
    print(f"submitted job {job.job_id}: python -m fedddp {' '.join(run_argv)}")
    print(f"logs: {job.paths.stdout.parent}")
    return job, args


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """The command: 0 submitted (with --wait: done); fedddp's status for a config (2) or data (3)
    mistake found before queueing, or, with --wait, the failed run's; 1 a job that failed
    without saying why."""
    try:
        job, args = submit(sys.argv[1:] if argv is None else argv, prog)
    except RunError as exc:
        print(f"fedddp: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except UserError as exc:
        print(f"submit: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if args.wait and job is not None:
        try:
            job.results()
        except Exception as exc:  # submitit re-raises the task's failure with its log
            found = _status(status_path(job.paths.folder, job.job_id))
            if found is None and (match := FAILED.search(str(exc))) is not None:
                found = int(match.group(1)), match.group(2)
            if found is None:
                print(f"job {job.job_id} failed: {exc}", file=sys.stderr)
                return 1
            print(found[1], file=sys.stderr)
            return found[0]
        print(f"job {job.job_id} done")
    return 0


if __name__ == "__main__":
    # Through the package's module, not this __main__ copy: submitit pickles Trainer by
    # reference, and a worker can import fedddp.slurm.Trainer but not __main__.Trainer.
    from fedddp.slurm import main as package_main

    sys.exit(package_main())
