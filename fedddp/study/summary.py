"""Tables of mean +- std over seeds, from finished runs: the form of a paper's table.

    python -m fedddp.study.summary runs/sweep [DIR ...] [--metric test_accuracy[,test_loss]]
                             [--at last|best|mean-last-K|rounds-A-B|time-T] [--by key,...] [--format md|csv]

A DIR is a run's out_dir or any folder above run folders (a sweep's --out). Runs are grouped by
the config keys whose values differ between them, except the seeds (run.seed, data.seed) and
keys that say how a run is run rather than what it computes (out_dir, resume, checkpointing,
progress, data.root, ...); ``--by`` names the grouping keys instead (dotted, or the last part when
it is unique, or the only such key that varies: ``--by name,dirichlet_alpha``). Each cell is
mean +- sample std (n runs) of one number per run:

  last          the metric at the last round that has a value (the final evaluation)
  best          its best value over the rounds (lowest for losses, MAE and seconds, else highest)
  mean-last-K   the mean of its last K values
  rounds-A-B    the mean of its values in rounds A to B (seed 000's Table 1: rounds-171-200)
  time-T        its last value at simulated time T or before (metrics.jsonl's sim_time_s, seconds
                on the clock of data.client_speed: the model a server holds at T, as last
                evaluated), so runs of different speeds, sync and async, compare on one clock; a
                run whose clock ended before T has none

Rows are in the order of their values, numbers by size (eta 0.003, 0.01, 0.03, 0.1). A column
of a rule's own parameter (algorithm.params.NAME) names the rule in the rows of runs whose rule
has no such parameter (a baseline: ``fedavg``), or is blank there when the table has an
algorithm.name column. The markdown table leaves out the key columns that are the same in every
row and says their value in a line below it (csv keeps every column); a group of one run has no
std: ``n/a`` (csv: an empty cell).

A run without final.pt (unfinished) or without a value of the metric is left out with one line
on stderr. Exit status 2 when nothing is left to summarise or an argument is wrong.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import sys
import tomllib
from dataclasses import dataclass

from ..errors import ConfigError

SEED_KEYS = ("run.seed", "data.seed")
# How a run was run, not what it computes: never a reason to put two runs in different groups.
HOW_KEYS = frozenset({"run.out_dir", "run.resume", "run.overwrite", "run.progress", "run.stop_after",
                      "run.ckpt_every", "run.client_state", "run.tensorboard", "data.root", "data.download"})


@dataclass
class Run:
    folder: str
    config: dict[str, object]  # dotted key -> value, from the run's config.toml
    rows: list[dict]  # metrics.jsonl, one dict per round
    finished: bool  # final.pt exists

    def series(self, metric: str) -> tuple[list[int], list[float]]:
        """(rounds, values) of the rounds that have a number for ``metric``."""
        points = [(r["round"], float(r[metric])) for r in self.rows
                  if isinstance(r.get(metric), (int, float)) and not isinstance(r.get(metric), bool)]
        return [p[0] for p in points], [p[1] for p in points]

    def metric_names(self) -> list[str]:
        return [k for k in (self.rows[0] if self.rows else {}) if k != "round"]


def flatten(tables: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in tables.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def read_run(folder: str) -> Run:
    config_path, metrics_path = os.path.join(folder, "config.toml"), os.path.join(folder, "metrics.jsonl")
    try:
        with open(config_path, "rb") as fh:
            cfg = flatten(tomllib.load(fh))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{config_path}: cannot read the run's config ({exc})") from None
    try:
        with open(metrics_path) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    except FileNotFoundError:
        rows = []
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{metrics_path}: cannot read ({exc})") from None
    return Run(folder, cfg, rows, os.path.exists(os.path.join(folder, "final.pt")))


def find_runs(paths: list[str]) -> list[Run]:
    """Every run folder (one holding config.toml) at or below each path, in path then name order."""
    runs = []
    for path in paths:
        if not os.path.isdir(path):
            raise ConfigError(f"{path}: not a folder (give run folders or a sweep's --out folder)")
        found = []
        for folder, subdirs, files in os.walk(path):
            subdirs[:] = sorted(d for d in subdirs if d not in ("checkpoints", "client_state"))
            if "config.toml" in files and ("metrics.jsonl" in files or "checkpoints" in subdirs):
                found.append(folder)
                subdirs[:] = []  # a run folder holds no further runs
        if not found:
            raise ConfigError(f"{path}: no runs found (a run's folder holds config.toml and metrics.jsonl)")
        runs += [read_run(f) for f in sorted(found, key=natural_key)]
    return runs


def natural_key(text: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


class OtherRule(str):
    """The value of a rule's own parameter (algorithm.params.NAME) in a run whose rule has no such
    parameter: that rule's name. Its runs form a group of their own per rule (a baseline next to
    the tuned rule), named by the rule rather than by None."""


def value_in(run: Run, key: str):
    """The run's value of a config key (None when its config lacks it); see OtherRule."""
    if key not in run.config and key.startswith("algorithm.params.") and "algorithm.name" in run.config:
        return OtherRule(run.config["algorithm.name"])
    return run.config.get(key)


def order_key(value) -> tuple:
    """Numbers by size (0.003 before 0.01: as text 0.01 came first), then text in natural order,
    then absent values."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return 0, float(value), []
    return (2, 0.0, []) if value is None else (1, 0.0, natural_key(str(value)))


def shown(keys: list[str], values: tuple) -> list[str]:
    """A group's values as its row shows them: an OtherRule blank when the rule's name is a column
    of its own, an absent value blank."""
    return ["" if value is None or isinstance(value, OtherRule) and "algorithm.name" in keys else _cell(value)
            for value in values]


def lower_is_better(metric: str) -> bool:
    return metric.endswith(("loss", "mae", "_s")) or "error" in metric


def parse_at(at: str) -> tuple[str, float, int]:
    """'last' | 'best' | 'mean-last-K' | 'rounds-A-B' | 'time-T' -> (kind, K or A or T, B)."""
    if at in ("last", "best"):
        return at, 1, 0
    if (match := re.fullmatch(r"mean-last-(\d+)", at)) and int(match.group(1)) > 0:
        return "mean-last", int(match.group(1)), 0
    if (match := re.fullmatch(r"rounds-(\d+)-(\d+)", at)) and 1 <= int(match.group(1)) <= int(match.group(2)):
        return "rounds", int(match.group(1)), int(match.group(2))
    if match := re.fullmatch(r"time-(\d+(?:\.\d*)?)", at):
        return "time", float(match.group(1)), 0
    raise ConfigError(f"--at: {at!r} is not last, best, mean-last-K (K >= 1, e.g. mean-last-30), "
                      "rounds-A-B (1 <= A <= B, e.g. rounds-171-200) or time-T (simulated seconds, e.g. time-600)")


def reduce(rounds: list[int], values: list[float], metric: str, at: str) -> float | None:
    """One number per run from its metric's values in round order (non-empty); None when
    rounds-A-B holds none of them."""
    kind, k, last = parse_at(at)
    if kind == "last":
        return values[-1]
    if kind == "best":
        return min(values) if lower_is_better(metric) else max(values)
    if kind == "rounds":
        values = [v for r, v in zip(rounds, values) if k <= r <= last]
        return sum(values) / len(values) if values else None
    return sum(values[-k:]) / len(values[-k:])


def value_of(run: Run, metric: str, at: str) -> float | None:
    """One number of ``run`` (``reduce``); for time-T its metric's last value in a round whose
    sim_time_s is <= T, None when it has none or its clock ended before T."""
    kind, t, _ = parse_at(at)
    rounds, values = run.series(metric)
    if kind != "time":
        return reduce(rounds, values, metric, at) if values else None
    clock = dict(zip(*run.series("sim_time_s")))
    if not clock or max(clock.values()) < t:
        return None
    before = [v for r, v in zip(rounds, values) if r in clock and clock[r] <= t]
    return before[-1] if before else None


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1 in the denominator; 0 for a single value, shown
    as n/a by ``format_cell``)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def differing_keys(runs: list[Run]) -> list[str]:
    """Config keys whose values differ between the runs, seeds and how-to-run keys left out, in
    config order."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k in run.config if k not in keys]
    return [k for k in keys if k not in SEED_KEYS and k not in HOW_KEYS
            and len({repr(run.config.get(k)) for run in runs}) > 1]


def resolve_keys(names: list[str], runs: list[Run]) -> list[str]:
    """--by names -> dotted config keys; a bare name must be the last part of exactly one key,
    or of exactly one key whose value differs between the runs (``name``: algorithm.name when
    only the algorithms differ)."""
    known = list(dict.fromkeys(k for run in runs for k in run.config))
    keys = []
    for name in names:
        matches = [name] if name in known else [k for k in known if k.rsplit(".", 1)[-1] == name]
        varying = [k for k in matches if len({repr(run.config.get(k)) for run in runs}) > 1]
        matches = varying if len(matches) > 1 and len(varying) == 1 else matches
        if len(matches) != 1:
            what = "matches " + ", ".join(matches) if matches else "is no config key"
            raise ConfigError(f"--by: {name!r} {what}; give a dotted key such as algorithm.name")
        keys.append(matches[0])
    return keys


def group_runs(runs: list[Run], keys: list[str]) -> dict[tuple, list[Run]]:
    """Runs grouped by their values of ``keys`` (``value_in``), groups in ``order_key`` order."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault(tuple(value_in(run, k) for k in keys), []).append(run)
    return dict(sorted(groups.items(), key=lambda item: [order_key(v) for v in item[0]]))


def usable(runs: list[Run], metrics: list[str], warn, at: str = "last") -> list[Run]:
    """The finished runs that have every metric (in rounds A-B for rounds-A-B); each other run is
    one line through ``warn``."""
    kept = []
    for run in runs:
        missing = [m for m in metrics if value_of(run, m, at) is None]
        if not run.finished:
            warn(f"skipped {run.folder}: unfinished (no final.pt)")
        elif missing:
            when = f" by simulated time {parse_at(at)[1]:g} (its sim_time_s)" if at.startswith("time-") else ""
            warn(f"skipped {run.folder}: no values of {', '.join(missing)}{when} "
                 f"(its metrics: {', '.join(run.metric_names()) or 'none'})")
        else:
            kept.append(run)
    return kept


def summarise(runs: list[Run], metrics: list[str], at: str, keys: list[str]) -> list[dict]:
    """One row per group: the group's key values, then per metric (mean, std, n)."""
    rows = []
    for values, members in group_runs(runs, keys).items():
        row = dict(zip(keys, values))
        for metric in metrics:
            per_run = [value_of(run, metric, at) for run in members]
            row[metric] = (*mean_std(per_run), len(per_run))
        rows.append(row)
    return rows


def _cell(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def format_cell(cell: tuple[float, float, int], digits: int, n: bool = True) -> str:
    """(mean, std, n) -> 'mean ± std (n)'; one run has no std: n/a."""
    std = f"{cell[1]:.{digits}f}" if cell[2] > 1 else "n/a"
    return f"{cell[0]:.{digits}f} ± {std}" + (f" ({cell[2]})" if n else "")


def format_table(rows: list[dict], keys: list[str], metrics: list[str], at: str, fmt: str,
                 digits: int = 4) -> str:
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(keys + [f"{m}_{stat}" for m in metrics for stat in ("mean", "std", "n")])
        for row in rows:
            writer.writerow(shown(keys, tuple(row[k] for k in keys))
                            + [x for m in metrics for x in (repr(row[m][0]), repr(row[m][1]) if row[m][2] > 1 else "",
                                                            row[m][2])])
        return out.getvalue()
    cells = [shown(keys, tuple(row[k] for k in keys)) for row in rows]
    # a key the same in every row says nothing about the rows: one line below the table says it
    same = [i for i, _ in enumerate(keys) if len({c[i] for c in cells}) == 1]
    varied = [i for i in range(len(keys)) if i not in same]
    header = [keys[i] for i in varied] + [f"{m} ({at})" for m in metrics]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row, texts in zip(rows, cells):
        lines.append("| " + " | ".join([texts[i] for i in varied] + [format_cell(row[m], digits) for m in metrics])
                     + " |")
    if same and rows:
        lines += ["", "Every row: " + ", ".join(f"{keys[i]} = {cells[0][i] or 'none'}" for i in same) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedddp.study.summary", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("dirs", nargs="+", help="run folders, or folders above them (a sweep's --out)")
    parser.add_argument("--metric", default="test_accuracy",
                        help="metrics.jsonl key(s), comma-separated (default test_accuracy)")
    parser.add_argument("--at", default="last", help="last, best, mean-last-K, rounds-A-B or time-T (default last)")
    parser.add_argument("--by", default=None, help="grouping keys, comma-separated (default: the keys "
                                                   "that differ, seeds left out)")
    parser.add_argument("--format", default="md", choices=("md", "csv"))
    parser.add_argument("--digits", type=int, default=4, help="decimals in the md table")
    args = parser.parse_args(argv)

    def warn(line: str) -> None:
        print(f"fedddp.study.summary: {line}", file=sys.stderr)

    try:
        parse_at(args.at)
        metrics = [m for m in args.metric.split(",") if m]
        runs = usable(find_runs(args.dirs), metrics, warn, args.at)
        if not runs:
            raise ConfigError(f"no finished run with {', '.join(metrics)} in {', '.join(args.dirs)}")
        keys = resolve_keys(args.by.split(","), runs) if args.by else differing_keys(runs)
        rows = summarise(runs, metrics, args.at, keys)
    except ConfigError as exc:
        print(f"fedddp.study.summary: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(format_table(rows, keys, metrics, args.at, args.format, args.digits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
