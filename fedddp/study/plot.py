"""Plot one metric of several runs against the round, from their metrics.jsonl.

    python -m fedddp.study.plot runs/fedavg runs/fedgma [--metric test_accuracy] [--out compare.png]
    python -m fedddp.study.plot runs/sweep --group-by algorithm.name [--metric test_accuracy]

A folder is a run's out_dir or any folder above run folders (a sweep's --out). Without
--group-by each run is one line, labelled by its folder name and algorithm. With --group-by
KEYS (comma-separated config keys, or ``auto``: the keys that differ, seeds left out, as
fedddp.study.summary groups) each group is its mean line with a band of +- one sample std over its
runs, drawn at the rounds every run of the group has a value for. Rounds without a value (test
accuracy between evaluations) are skipped; a run without the metric at all is left out with one
line on stderr. Needs matplotlib (``pip install -e ".[plot]"``).
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


def group_curve(runs: list[Run], metric: str) -> tuple[list[int], list[float], list[float]]:
    """(rounds, mean, std) over ``runs`` at the rounds all of them have a value for."""
    series = [dict(zip(*run.series(metric))) for run in runs]
    rounds = sorted(set.intersection(*(set(s) for s in series)))
    stats = [mean_std([s[r] for s in series]) for r in rounds]
    return rounds, [m for m, _ in stats], [sd for _, sd in stats]


def curves(runs: list[Run], metric: str, group_by: str | None, warn) -> list[tuple]:
    """[(label, rounds, mean, std or None)] to draw; runs without the metric left out via ``warn``."""
    kept = []
    for run in runs:
        if run.series(metric)[1]:
            kept.append(run)
        else:
            warn(f"skipped {run.folder}: no values of {metric} "
                 f"(its metrics: {', '.join(run.metric_names()) or 'none'})")
    if not kept:
        raise ConfigError(f"no run has values of {metric!r}")
    if group_by is None:
        return [(label_of(run), *run.series(metric), None) for run in kept]
    keys = differing_keys(kept) if group_by == "auto" else resolve_keys(group_by.split(","), kept)
    lines = []
    for values, members in group_runs(kept, keys).items():
        label = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in zip(keys, values)) or "all runs"
        lines.append((f"{label} (n={len(members)})", *group_curve(members, metric)))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedddp.study.plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders, or folders above them (a sweep's --out)")
    parser.add_argument("--metric", default="test_accuracy", help="a key of metrics.jsonl")
    parser.add_argument("--group-by", default=None,
                        help="config keys (comma-separated) or auto: one mean line and +-std band per group")
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
                       lambda line: print(f"fedddp.study.plot: {line}", file=sys.stderr))
    except ConfigError as exc:
        print(f"fedddp.study.plot: error: {exc}", file=sys.stderr)
        return 2
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rounds, values, std in lines:
        (line,) = ax.plot(rounds, values, marker="." if len(rounds) < 50 else None, label=label)
        if std is not None:
            ax.fill_between(rounds, [m - s for m, s in zip(values, std)], [m + s for m, s in zip(values, std)],
                            color=line.get_color(), alpha=0.2, linewidth=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    ax.set_xlabel("round")
    ax.set_ylabel(args.metric)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
