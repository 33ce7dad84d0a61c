"""Plot one metric of several runs against the round, from their metrics.jsonl.

    python -m fedddp.plot runs/fedavg runs/fedgma [--metric test_accuracy] [--out compare.png]

Each run is labelled by its folder name and its algorithm (from the run's config.toml). Rounds
without a value (e.g. test accuracy between evaluations) are skipped. Needs matplotlib
(``pip install -e ".[plot]"``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib


def read_run(folder: str, metric: str) -> tuple[str, list[int], list[float]]:
    path = os.path.join(folder, "metrics.jsonl")
    try:
        with open(path) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    except FileNotFoundError:
        raise ValueError(f"{path} not found (is {folder} a run's out_dir?)") from None
    if rows and metric not in rows[0]:
        raise ValueError(f"{path} has no metric {metric!r} "
                         f"(valid: {', '.join(k for k in rows[0] if k != 'round')})")
    label = os.path.basename(os.path.normpath(folder))
    try:
        with open(os.path.join(folder, "config.toml"), "rb") as fh:
            label += f" ({tomllib.load(fh)['algorithm']['name']})"
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        pass
    points = [(r["round"], r[metric]) for r in rows if isinstance(r.get(metric), (int, float))]
    return label, [p[0] for p in points], [p[1] for p in points]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedddp.plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders (each a run.out_dir)")
    parser.add_argument("--metric", default="test_accuracy", help="a key of metrics.jsonl")
    parser.add_argument("--out", default="compare.png", help="image file to write")
    args = parser.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('fedddp.plot: error: needs matplotlib: pip install -e ".[plot]"', file=sys.stderr)
        return 2
    fig, ax = plt.subplots(figsize=(6, 4))
    for folder in args.runs:
        try:
            label, rounds, values = read_run(folder, args.metric)
        except ValueError as exc:
            print(f"fedddp.plot: error: {exc}", file=sys.stderr)
            return 2
        ax.plot(rounds, values, marker="." if len(rounds) < 50 else None, label=label)
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
