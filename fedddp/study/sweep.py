"""Run the Cartesian product of config values, one run folder per combination.

    python -m fedddp.study.sweep CONFIG [key=v1,v2 ...] [--out DIR] [--set key=value] [--dry-run] [--parallel J]
                           [--ranks N]
    python -m fedddp.study.sweep CONFIG [key=v1,v2 ...] --slurm [fedddp.slurm flags, e.g. --partition P]

    python -m fedddp.study.sweep configs/quickstart.toml algorithm.name=fedavg,fedmom run.seed=0,1,2 --out runs/cmp
    python -m fedddp.study.summary runs/cmp                     mean +- std over the seeds, per algorithm

Axes come from the config file's ``[sweep]`` table (lists of values, keyed by dotted config
keys) and from the command line (``key=v1,v2``; a key given there replaces the file's axis). A
key joining several keys with ``+`` varies them together, one list per value, e.g.
``"data.name+model.name" = [["mnist", "cnn"], ["cifar10", "resnet18"]]``. Everything else in
the file is the base config of every run; ``--set key=value`` changes it for every run without
naming the folders after it (e.g. ``--set run.device=cpu``). Each combination runs as
``python -m fedddp DIR/base.toml key=value ... run.out_dir=DIR/NAME`` (through torchrun with
--ranks N), NAME being the values of the axes that have more than one, ``key-value`` joined by
``_``, e.g. ``name-fedavg_seed-1`` (no ``:``, ``,``, ``=``, ``/`` or spaces, which Windows, scp or
make trip over: a plugin's ``module:attr`` reads ``module.attr``; ``run`` when no axis varies);
its output goes to DIR/logs/NAME.log, and each invocation (time, commit, command) to
DIR/logs/sweep.log. DIR is --out, else the base config's run.out_dir.

Rerunning the same sweep skips finished runs (final.pt present) and resumes the others from
their last checkpoint (run.resume=true), so a sweep can be extended by adding values, or
continued after a crash or a time limit. A combination whose folder does not exist takes over a
run folder in DIR with its exact settings (how-to-run keys aside): one of another name, made when
an axis had one value (so left out of the names), or before the names lost ``=`` and ``,``
(``name=fedavg,seed=1``); one line says how many. Where leaving out a single-valued axis would put
a run in a folder that holds another (a sweep submitted in parts: run.seed=0, then run.seed=1),
its folder is named with every axis (``seed-1_name-fedavg``). A folder that holds a run with other
settings is refused, never overwritten. --parallel J runs J combinations at once; on a GPU machine each gets
its own --ranks GPUs through CUDA_VISIBLE_DEVICES. --slurm submits one submitit job array, a
task per pending combination (each task: one rank per GPU, requeued with run.resume=true on
preemption or time-out, as python -m fedddp.slurm does); its flags follow fedddp.slurm's.
--dry-run lists the combinations and what would be done with each, starting nothing; with --slurm
it also prints the array's tasks, submitit's parameters and the sbatch script, submitting nothing.

SIGTERM, SIGINT (Ctrl-C) or SIGHUP is passed on to the running runs, and the sweep waits for
them to end before it exits; rerun the same command to continue.

Exit status: 0 every run done; 1 some run failed (named, with its log); 2 bad configuration;
128 + the signal's number when stopped by a signal (130 SIGINT, 143 SIGTERM).
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from .. import checks, config, slurm
from ..errors import ConfigError, UserError
from .summary import HOW_KEYS, flatten


@dataclass
class Axis:
    keys: tuple[str, ...]  # varied together
    values: list[tuple[str, ...]]  # one override string per key, per value


@dataclass
class Point:
    """One combination: its name, overrides, run folder, and what to do with it."""
    name: str
    overrides: list[str]
    out_dir: str
    status: str = "new"  # new | done (skipped) | resume (from its checkpoints) | restart
    cfg: config.Config | None = field(default=None, repr=False)
    full: str = ""  # the name with every axis, single-valued ones too (``place``)
    moved: str = ""  # why it is not in its folder ``name`` (``place``): "found" or "full"


def override_text(value, path: str) -> str:
    """A TOML scalar -> the text of a ``key=value`` override."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return repr(value) if isinstance(value, float) else str(value)
    raise ConfigError(f"{path}: sweep values are numbers, strings or booleans, got {type(value).__name__} "
                      f"{value!r}")


def axis_from(key: str, values, where: str) -> Axis:
    keys = tuple(k.strip() for k in key.split("+"))
    # a rule's own parameter is one or two levels down: algorithm.params.NAME, or
    # algorithm.params.RULE.NAME (RULE may be a module:attr path, dots and all)
    if any((k.count(".") < 2 if k.startswith("algorithm.params.") else k.count(".") != 1) or not all(k.split("."))
           for k in keys):
        raise ConfigError(f"{where}{key}: a sweep key is section.key (or several joined by +), "
                          "e.g. algorithm.name, algorithm.params.NAME or algorithm.params.RULE.NAME")
    if "run.out_dir" in keys:
        raise ConfigError(f"{where}run.out_dir: set by the sweep (one folder per combination under --out)")
    values = values if isinstance(values, list) else [values]
    if not values:
        raise ConfigError(f"{where}{key}: no values")
    rows = []
    for value in values:
        row = value if len(keys) > 1 else [value]
        if not isinstance(row, list) or len(row) != len(keys):
            raise ConfigError(f"{where}{key}: each value is a list of {len(keys)} ({', '.join(keys)}), "
                              f"got {value!r}")
        rows.append(tuple(override_text(v, f"{where}{key}") for v in row))
    return Axis(keys, rows)


def read_sweep_file(path: str) -> tuple[dict, list[Axis]]:
    """(the base config's TOML tables, the axes of its [sweep] table)."""
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    table = raw.pop("sweep", {})
    # [sweep] algorithm.name = [...] parses as nested tables; "a.b+c.d" = [...] stays one key
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict) and "+" not in key:
            flat.update({f"{key}.{k}": v for k, v in flatten(value).items()})
        else:
            flat[key] = value
    return raw, [axis_from(key, values, "sweep.") for key, values in flat.items()]


def cli_axes(items: list[str]) -> list[Axis]:
    axes = []
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"{item}: a sweep axis is key=v1,v2 (e.g. run.seed=0,1,2)")
        axes.append(axis_from(key, [v.split("+") if "+" in key else v for v in text.split(",")], ""))
    return axes


def merge_axes(file_axes: list[Axis], cli: list[Axis]) -> list[Axis]:
    """The file's axes, each replaced by a command-line axis over the same keys; new axes last."""
    by_keys = {a.keys: a for a in cli}
    axes = [by_keys.pop(a.keys, a) for a in file_axes] + list(by_keys.values())
    seen: dict[str, tuple] = {}
    for axis in axes:
        for key in axis.keys:
            if key in seen:
                raise ConfigError(f"{key}: varied by two axes ({'+'.join(seen[key])} and {'+'.join(axis.keys)})")
            seen[key] = axis.keys
    return axes


def short_names(keys: list[str]) -> dict[str, str]:
    """The last part of each key, or the whole dotted key where two keys share a last part
    (run.seed and data.seed)."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def folder_part(text: str) -> str:
    """Text safe in a folder name on every OS and in scp and make: letters, digits and . _ + -;
    a plugin's module:attr keeps its dots (examples.my_plugin.blobs), anything else becomes _."""
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text.replace(":", "."))


def folder_name(pairs: list[tuple[str, str]], short: dict[str, str]) -> str:
    """``key-value`` of the pairs whose key ``short`` names, joined by ``_``; "run" for none."""
    return "_".join(f"{folder_part(short[k])}-{folder_part(v)}" for k, v in pairs if k in short) or "run"


def expand(axes: list[Axis], out: str) -> list[Point]:
    """The Cartesian product of the axes, the first axis varying slowest; folders named by the
    axes with more than one value."""
    varied = [axis for axis in axes if len(axis.values) > 1]
    short = short_names([k for axis in varied for k in axis.keys])
    every = short_names([k for axis in axes for k in axis.keys])
    points = []
    for combo in itertools.product(*(axis.values for axis in axes)):
        pairs = [(k, v) for axis, values in zip(axes, combo) for k, v in zip(axis.keys, values)]
        name = folder_name(pairs, short)
        points.append(Point(name, [f"{k}={v}" for k, v in pairs], os.path.join(out, name),
                            full=folder_name(pairs, every)))
    names = [p.name for p in points]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"sweep: combinations repeat ({', '.join(twice[:3])}); remove repeated values")
    return points


def write_base(raw: dict, path: str, source: str) -> None:
    """The sweep file without its [sweep] table: the base config every combination overrides."""
    lines = [f"# The base config of the sweep {source} ([sweep] table removed), written by fedddp.study.sweep."]
    for section, table in raw.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {section}: expected a table such as [run]")
        lines.append(f"\n[{section}]")
        for key, value in table.items():
            # a table is [algorithm.params] or a mistake that config.load names
            lines.append(f"{key} = {config._toml_value(value)}")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


def settings_in(folder: str) -> dict | None:
    """The flat config.toml of the run in ``folder``; None without a readable one."""
    try:
        with open(os.path.join(folder, "config.toml"), "rb") as fh:
            return flatten(tomllib.load(fh))
    except (OSError, tomllib.TOMLDecodeError):
        return None


def settings_of(cfg: config.Config) -> dict:
    """``cfg`` as the flat config.toml its run writes."""
    return flatten(tomllib.loads(config.dumps(cfg)))


def differences(there: dict, here: dict) -> list[str]:
    """Keys whose value in a run's flat config ``there`` differs from the flat config ``here``
    (``settings_of``; how-to-run keys left out)."""
    return [f"{k}: {there[k]!r} there, {here[k]!r} here" for k in here
            if k in there and k not in HOW_KEYS and not config.same_setting(k, there[k], here[k])]


def settings_mismatch(folder: str, here: dict) -> list[str]:
    """Keys whose value in the run already in ``folder`` differs from the flat config ``here``
    (``settings_of``)."""
    there = settings_in(folder)
    return [] if there is None else differences(there, here)


def place(points: list[Point], out: str) -> None:
    """Each combination's folder, so that a rerun finds its run wherever an earlier sweep put it.
    Its folder ``name`` when that is new or holds its settings; else, where ``name`` holds
    another run (the name left out an axis that then had another single value: a sweep
    submitted in parts, run.seed=0 then run.seed=1), its ``full`` name, with every axis. A
    combination whose folder does not exist takes the run folder in ``out`` that no combination
    names and that holds its settings: one of an older name (``name=fedavg,seed=1``) or from when
    an axis had one value, which it then skips or resumes there. Nothing is moved or written."""
    named = {os.path.join(out, n) for p in points for n in (p.name, p.full)}
    others = {}
    for entry in sorted(os.listdir(out)) if os.path.isdir(out) else []:
        folder = os.path.join(out, entry)
        if folder not in named and (there := settings_in(folder)) is not None:
            others[folder] = there
    for point in points:
        here = settings_of(point.cfg)
        there = settings_in(point.out_dir)
        if there is not None and differences(there, here) and point.full != point.name:
            point.name, point.moved = point.full, "full"
            point.out_dir = os.path.join(out, point.full)
        if others and not os.path.exists(point.out_dir):
            found = next((f for f, there in others.items() if not differences(there, here)), None)
            if found is not None:
                del others[found]
                point.name, point.out_dir, point.moved = os.path.basename(found), found, "found"
        point.cfg = replace(point.cfg, run=replace(point.cfg.run, out_dir=point.out_dir))


def plan(config_path: str, items: list[str], out: str | None, fixed: list[str] = ()) -> tuple[str, dict, list[Point]]:
    """Check every combination's config and decide what to do with each; returns (DIR, the base
    config's tables, points). ``fixed``: key=value overrides of every run, not in the names.
    Nothing is written."""
    raw, file_axes = read_sweep_file(config_path)
    axes = merge_axes(file_axes, cli_axes(items))
    for item in fixed:
        key, sep, _ = item.partition("=")
        if not sep or key == "run.out_dir" or any(key in axis.keys for axis in axes):
            raise ConfigError(f"--set {item}: a key=value for every run (not run.out_dir, not a swept key)")
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base.toml")
        write_base(raw, base, config_path)
        if out is None:
            try:
                out = checks.load(base).run.out_dir
            except ConfigError as exc:
                raise ConfigError(str(exc).replace(base, config_path)) from None
        points = expand(axes, out)
        for point in points:
            point.overrides += list(fixed)
            try:
                point.cfg = checks.load(base, point.overrides + [f"run.out_dir={point.out_dir}"])
            except ConfigError as exc:
                raise ConfigError(f"combination {point.name}: {str(exc).replace(base, config_path)}") from None
    place(points, out)
    for point in points:
        if os.path.exists(os.path.join(point.out_dir, "final.pt")):
            point.status = "done"
        elif os.path.isdir(os.path.join(point.out_dir, "checkpoints")):
            point.status = "resume"
        elif os.path.isdir(point.out_dir) and os.listdir(point.out_dir):
            point.status = "restart"  # started, nothing to resume from: round 1 again, in place
        if point.status != "new" and (diff := settings_mismatch(point.out_dir, settings_of(point.cfg))):
            raise ConfigError(f"{point.out_dir}: holds a run with other settings ({'; '.join(diff[:3])}); "
                              "sweep into another --out, or remove that folder")
    return out, raw, points


def run_argv(base: str, point: Point) -> list[str]:
    """``python -m fedddp``'s arguments for one combination. Paths are absolute: a Slurm task
    (or its requeue) may start in another directory."""
    resume = ["run.resume=true"] if point.status in ("resume", "restart") else []
    return [os.path.abspath(base)] + point.overrides + [f"run.out_dir={os.path.abspath(point.out_dir)}"] + resume


def launcher(ranks: int) -> list[str]:
    if ranks <= 1:
        return [sys.executable, "-m", "fedddp"]
    # --standalone: a fresh rendezvous on a free port, so parallel runs never collide
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
            "-m", "fedddp"]


def gpu_slots(points: list[Point], parallel: int, ranks: int) -> list[dict[str, str]]:
    """Extra environment of each of the ``parallel`` slots: disjoint CUDA_VISIBLE_DEVICES of
    ``ranks`` GPUs each when the runs use CUDA, nothing otherwise."""
    if not any(p.cfg.run.device == "cuda" for p in points) or parallel == 1 and ranks <= 1:
        return [{} for _ in range(parallel)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g for g in visible.split(",") if g.strip()]
    else:
        import torch
        gpus = [str(i) for i in range(torch.cuda.device_count())]
    need = parallel * max(ranks, 1)
    if need > len(gpus):
        raise ConfigError(f"--parallel {parallel} x --ranks {max(ranks, 1)} needs {need} GPUs, {len(gpus)} "
                          "visible; lower --parallel")
    per = max(ranks, 1)
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[s * per:(s + 1) * per])} for s in range(parallel)]


def run_local(base: str, out: str, points: list[Point], parallel: int, ranks: int) -> int:
    todo = [p for p in points if p.status != "done"]
    slots: queue.Queue = queue.Queue()
    for env in gpu_slots(todo, parallel, ranks):
        slots.put(env)
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    lock = threading.Lock()
    failed: list[str] = []
    # SIGTERM, SIGINT or SIGHUP stops the sweep: each running run gets the signal once (they are
    # in sessions of their own, so a terminal's Ctrl-C or hangup reaches them only this way), no
    # run starts after it, and the sweep waits for them all. A run left going in the background
    # would hold its folder's lock, and rerunning the sweep would be refused there.
    running: set[subprocess.Popen] = set()
    stopped: list[int] = []
    start_lock = threading.RLock()  # a run is started or signalled, not both halfway; re-entered by a second signal

    def stop(signum, frame) -> None:
        with start_lock:
            stopped.append(signum)
            for proc in running:
                proc.send_signal(signum)

    def say(line: str) -> None:
        with lock:
            print(line, flush=True)

    def one(index: int, point: Point) -> None:
        env = slots.get()
        try:
            if stopped:
                return
            cmd = launcher(ranks) + run_argv(base, point)
            log_path = os.path.join(out, "logs", f"{point.name}.log")
            say(f"[{index}/{len(todo)}] {point.status:7s} {point.name}")
            start = time.perf_counter()
            with open(log_path, "a") as log:
                log.write("$ " + " ".join([f"{k}={v}" for k, v in env.items()] + [shlex.join(cmd)]) + "\n")
                log.flush()
                with start_lock:
                    if stopped:
                        return
                    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                            start_new_session=True)
                    running.add(proc)
                status = proc.wait()
                with start_lock:
                    running.discard(proc)
            if status == 0:
                say(f"[{index}/{len(todo)}] done    {point.name} ({time.perf_counter() - start:.1f} s)")
            elif stopped:
                say(f"[{index}/{len(todo)}] stopped {point.name} (exit {status})")
            else:
                with open(log_path) as fh:
                    last = (fh.read().strip().splitlines() or [""])[-1]
                say(f"[{index}/{len(todo)}] FAILED  {point.name} (exit {status}): {last}")
                with lock:
                    failed.append(f"{point.name} (log: {log_path})")
        finally:
            slots.put(env)

    handlers = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
        handlers = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            for future in [pool.submit(one, i, p) for i, p in enumerate(todo, 1)]:
                future.result()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if stopped:
        name = signal.Signals(stopped[0]).name
        print(f"fedddp.study.sweep: stopped by {name}; every started run has ended; rerun the same command to "
              "continue", file=sys.stderr)
        return 128 + stopped[0]
    if failed:
        print(f"fedddp.study.sweep: {len(failed)} of {len(todo)} run(s) failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    print(f"fedddp.study.sweep: {len(points)} run(s) in {out} done; summary: python -m fedddp.study.summary {shlex.quote(out)}")
    return 0


def code_version() -> str:
    """The fedddp commit that runs the sweep ("+ changes" when the checkout differs from it), or
    "unknown" outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if commit.returncode != 0:
        return "unknown"
    return commit.stdout.strip() + (" + changes" if changed.stdout.strip() else "")


def record_command(out: str, argv: list[str]) -> None:
    """One line per invocation in DIR/logs/sweep.log: when, which code, which command (the
    provenance of a table made from DIR)."""
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(os.path.join(out, "logs", "sweep.log"), "a") as fh:
        fh.write(f"{when} commit {code_version()}: python -m fedddp.study.sweep {shlex.join(argv)}\n")


def run_slurm(slurm_args, base: str, points: list[Point]) -> list:
    """One submitit job array, a task per pending combination (fedddp.slurm's executor and
    requeueing Trainer task); returns the jobs."""
    executor = slurm.make_executor(slurm_args)
    todo = [p for p in points if p.status != "done"]
    with executor.batch():
        jobs = [executor.submit(slurm.Trainer(run_argv(base, p))) for p in todo]
    for point, job in zip(todo, jobs):
        print(f"submitted {job.job_id}: {point.name}")
    return jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedddp.study.sweep", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("config", help="experiment TOML, optionally with a [sweep] table")
    parser.add_argument("axes", nargs="*", help="key=v1,v2 (section.key; a+b=x+y,z+w varies keys together)")
    parser.add_argument("--out", default=None, help="folder of the sweep's runs (default: the config's run.out_dir)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of every run, not part of the folder names (e.g. run.device=cpu)")
    parser.add_argument("--dry-run", action="store_true", help="list the combinations and what would be done (with --slurm: the sbatch script too)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (default 1)")
    parser.add_argument("--ranks", type=int, default=1, help="ranks per run; > 1 starts each through torchrun")
    parser.add_argument("--slurm", action="store_true",
                        help="submit one submitit job array; other flags are fedddp.slurm's")
    args, rest = parser.parse_known_intermixed_args(argv)
    try:
        if rest and not args.slurm:
            raise ConfigError(f"unknown flag(s) {' '.join(rest)} (fedddp.slurm flags need --slurm)")
        slurm_args = None
        if args.slurm:
            # axes written after a launcher flag land among the launcher's positionals
            slurm_args = slurm.parse_args([args.config] + rest, prog="python -m fedddp.study.sweep --slurm")
            args.axes += slurm_args.overrides
            if slurm_args.tasks_per_node is None and args.ranks > 1:  # a task per rank
                slurm_args.tasks_per_node = args.ranks
        if args.parallel < 1 or args.ranks < 1:
            raise ConfigError("--parallel and --ranks: must be >= 1")
        out, raw, points = plan(args.config, args.axes, args.out, args.set)
        if found := [p.name for p in points if p.moved == "found"]:
            print(f"fedddp.study.sweep: {len(found)} combination(s) continue in existing run folders of other "
                  f"names that hold their settings (e.g. {found[0]}: an older naming, or an axis that had one "
                  "value)", file=sys.stderr)
        if full := [p.name for p in points if p.moved == "full"]:
            print(f"fedddp.study.sweep: {len(full)} combination(s) named with every axis (e.g. {full[0]}): the "
                  "name without their single-valued axes holds another run", file=sys.stderr)
        if args.dry_run:
            for point in points:
                print(f"{point.status:7s} {point.out_dir}  {' '.join(point.overrides)}")
            pending = sum(p.status != "done" for p in points)
            print(f"fedddp.study.sweep: {len(points)} combination(s), {pending} to run, "
                  f"{len(points) - pending} done (dry run: nothing started)")
            if args.slurm and pending:
                base = os.path.join(out, "base.toml")
                print(slurm.dry_run(slurm_args, [run_argv(base, p) for p in points if p.status != "done"]))
            return 0
        base = os.path.join(out, "base.toml")
        write_base(raw, base, args.config)
        record_command(out, argv if argv is not None else sys.argv[1:])
        if args.slurm:
            run_slurm(slurm_args, base, points)
            return 0
        return run_local(base, out, points, args.parallel, args.ranks)
    except UserError as exc:
        print(f"fedddp.study.sweep: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("fedddp.study.sweep: interrupted; rerun the same command to continue", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
