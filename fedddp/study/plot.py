"""Plot one metric of several runs against the round (or another key), from their metrics.jsonl.

    python -m fedddp.study.plot runs/fedavg runs/fedgma [--metric test_accuracy] [--out compare.png]
    python -m fedddp.study.plot runs/sweep --group-by algorithm.name [--metric test_accuracy]
    python -m fedddp.study.plot runs/sweep --group-by run.mode --x sim_time_s

A folder is a run's out_dir or any folder above run folders (a sweep's --out). Without
--group-by each run is one line, labelled by its folder name and algorithm. With --group-by
KEYS (comma-separated config keys, or ``auto``: the keys that differ, seeds left out, as
fedddp.study.summary groups) each group is its mean line with a band of +- one sample std over its
runs, drawn at the rounds every run of the group has a value for. Rounds without a value (test
accuracy between evaluations) are skipped; a run without the metric at all is left out with one
line on stderr. ``--x KEY`` draws against another number of metrics.jsonl, e.g. sim_time_s (the
simulated clock: sync and async runs on one time axis); a group is then drawn as steps, each
run's last value at or before each x any run of the group has, between the latest first x and
the earliest last x of its runs. Needs matplotlib (``pip install -e ".[plot]"``).
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import ConfigError
from .summary import Run, differing_keys, find_runs, group_runs, mean_std, resolve_keys


def label_of(run: Run) -> str:
    label = os.path.basename(os.path.normpath(run.folder))
    name = run.config.get("algorithm.name")
    return f"{label} ({name})" if name else label


def xy(run: Run, metric: str, x: str = "round") -> tuple[list, list[float]]:
    """(x values, metric values) of the rounds that have both."""
    rounds, values = run.series(metric)
    if x == "round":
        return rounds, values
    at = dict(zip(*run.series(x)))
    pairs = [(at[r], v) for r, v in zip(rounds, values) if r in at]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def group_curve(runs: list[Run], metric: str, x: str = "round") -> tuple[list, list[float], list[float]]:
    """(x, mean, std) over ``runs``: at the rounds all of them have a value for, or for another x
    each run's last value at or before every x of the runs' values in their common range."""
    if x == "round":
        series = [dict(zip(*run.series(metric))) for run in runs]
        rounds = sorted(set.intersection(*(set(s) for s in series)))
        stats = [mean_std([s[r] for s in series]) for r in rounds]
        return rounds, [m for m, _ in stats], [sd for _, sd in stats]
    curves = [xy(run, metric, x) for run in runs]
    low, high = max(xs[0] for xs, _ in curves), min(xs[-1] for xs, _ in curves)
    grid = sorted({v for xs, _ in curves for v in xs if low <= v <= high})
    stats = [mean_std([next(y for v, y in zip(reversed(xs), reversed(ys)) if v <= t) for xs, ys in curves])
             for t in grid]
    return grid, [m for m, _ in stats], [sd for _, sd in stats]


def curves(runs: list[Run], metric: str, group_by: str | None, warn, x: str = "round") -> list[tuple]:
    """[(label, x values, mean, std or None)] to draw; runs without the metric (or x) left out via ``warn``."""
    kept = []
    for run in runs:
        if xy(run, metric, x)[1]:
            kept.append(run)
        else:
            warn(f"skipped {run.folder}: no values of {metric}{'' if x == 'round' else ' with ' + x} "
                 f"(its metrics: {', '.join(run.metric_names()) or 'none'})")
    if not kept:
        raise ConfigError(f"no run has values of {metric!r}")
    if group_by is None:
        return [(label_of(run), *xy(run, metric, x), None) for run in kept]
    keys = differing_keys(kept) if group_by == "auto" else resolve_keys(group_by.split(","), kept)
    lines = []
    for values, members in group_runs(kept, keys).items():
        label = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in zip(keys, values)) or "all runs"
        lines.append((f"{label} (n={len(members)})", *group_curve(members, metric, x)))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedddp.study.plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders, or folders above them (a sweep's --out)")
    parser.add_argument("--metric", default="test_accuracy", help="a key of metrics.jsonl")
    parser.add_argument("--group-by", default=None,
                        help="config keys (comma-separated) or auto: one mean line and +-std band per group")
    parser.add_argument("--x", default="round", help="the x axis: round, or a key of metrics.jsonl such as "
                                                     "sim_time_s (the simulated clock)")
    parser.add_argument("--out", default="compare.png", help="image file to write")
    args = parser.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print('fedddp.study.plot: error: needs matplotlib: pip install -e ".[plot]"', file=sys.stderr)
        return 2
    try:
        lines = curves(find_runs(args.runs), args.metric, args.group_by,
                       lambda line: print(f"fedddp.study.plot: {line}", file=sys.stderr), args.x)
    except ConfigError as exc:
        print(f"fedddp.study.plot: error: {exc}", file=sys.stderr)
        return 2
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rounds, values, std in lines:
        step = "post" if args.x != "round" and std is not None else None  # a group's values hold until the next x
        (line,) = ax.plot(rounds, values, marker="." if len(rounds) < 50 else None, label=label,
                          drawstyle="steps-post" if step else "default")
        if std is not None:
            ax.fill_between(rounds, [m - s for m, s in zip(values, std)], [m + s for m, s in zip(values, std)],
                            color=line.get_color(), alpha=0.2, linewidth=0, step=step)
    if args.x == "round":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    ax.set_xlabel(args.x)
    ax.set_ylabel(args.metric)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
