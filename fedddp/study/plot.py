"""Plot one metric of several runs against the round (or another key), from their metrics.jsonl: a
quick look, or a figure for a paper.

    python -m fedddp.study.plot runs/fedavg runs/fedgma [--metric test_accuracy] [--out compare.png]
    python -m fedddp.study.plot runs/sweep --group-by algorithm.name [--metric test_accuracy]
    python -m fedddp.study.plot runs/sweep --group-by run.mode --x sim_time_s
    python -m fedddp.study.plot runs/cmp --group-by algorithm.name --label name=fedavg:FedAvg \\
        --label name=fedmom:FedMom --title "Synthetic(1, 1)" --xlabel Round --ylabel "Test accuracy" \\
        --figsize 3.5,2.6 --style seaborn-v0_8-paper --legend outside --rounds 10-40 --out cmp.pdf

A folder is a run's out_dir or any folder above run folders (a sweep's --out). Each line is a
series. Without --group-by each run is one series, named by its folder (the legend adds its
algorithm). With --group-by KEYS (comma-separated config keys, or ``auto``: the keys that differ,
seeds left out, as fedddp.study.summary groups) each group is one series, in the summary's
order (numbers by size), named as the summary names its row, key=value for each key's last part
(``name=fedavg``; a baseline without a rule's own swept parameter by its rule, ``fedavg``; the
legend adds the number of runs, ``(n=3)``), drawn as its mean line with a band of +- one sample std over its runs, at the
rounds every run of the group has a value for. Rounds without a value (test accuracy between
evaluations) are skipped; a run without the metric at all (or none in --rounds) is left out with
one line on stderr.

For a paper: --label SERIES:NAME shows a series as NAME (repeat it; the legend lists the named
series first, in the order of the --label options); --title, --xlabel, --ylabel; --figsize W,H
in inches; --style a matplotlib style (its colours, fonts and grid; without it fedddp's:
Okabe-Ito's colour-blind-safe colours). Each series has its own colour, line style and marker,
and its band is filled lightly and hatched in its colour (--bands fill: not hatched; none: no
bands), so overlapping bands stay readable, also in print and in grey. --legend best (the
default) puts the legend where it covers the fewest lines and bands, outside to the right of
the axes, below under them, none leaves it out. --rounds A-B draws rounds A to B only (group
means over the runs that have values there). The file type follows --out's extension: png (at
--dpi), pdf or svg (text kept as text, no creation date: the same runs give the same file), or
any other format matplotlib writes. ``--x KEY`` draws against another number of metrics.jsonl,
e.g. sim_time_s (the simulated clock: sync and async runs on one time axis); a group is then
drawn as steps, each run's last value at or before each x any run of the group has, between the
latest first x and the earliest last x of its runs. Needs matplotlib (``pip install -e ".[plot]"``).
The axes are labelled in words (``round``, ``test accuracy``, ``simulated time (s)``; --xlabel and
--ylabel replace them); against the round the ticks fall on evaluated rounds (at most 10: every
1, 2, 5, 10, 20, ... of the evaluation interval); a title wider than the axes is wrapped.
Exit status 2: a wrong argument, or no run with the metric.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import textwrap
from dataclasses import dataclass

from ..errors import ConfigError, close_match
from .summary import OtherRule, Run, differing_keys, find_runs, group_runs, mean_std, resolve_keys, shown

# Okabe and Ito's palette, distinct for colour-blind readers; yellow last (faint on white).
OKABE_ITO = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")
LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
HATCHES = ("//", "\\\\", "xx", "..", "++", "||", "--", "oo")
LEGENDS = ("best", "outside", "below", "none")
BANDS = ("hatch", "fill", "none")
# Axis labels of metrics.jsonl's keys (docs/running.md); another key reads as its name in words.
WORDS = {"round": "round", "test_accuracy": "test accuracy", "test_loss": "test loss", "test_mae": "test MAE",
         "train_loss": "training loss", "sim_time_s": "simulated time (s)", "sim_round_s": "simulated round length (s)",
         "time_s": "wall time of the round (s)", "epsilon": "privacy budget epsilon"}
MAX_TICKS = 10


@dataclass
class Series:
    """One line of the plot: ``key`` names it for --label (a group's key=value, ..., or a run's
    folder name), ``label`` is its default legend entry."""

    key: str
    label: str
    rounds: list[int]
    values: list[float]
    std: list[float] | None  # None: a single run, no band


def label_of(run: Run) -> str:
    label = os.path.basename(os.path.normpath(run.folder))
    name = run.config.get("algorithm.name")
    return f"{label} ({name})" if name else label


def words(key: str) -> str:
    """A metrics.jsonl key as an axis label: test_accuracy -> test accuracy, train_s -> train (s)."""
    if key in WORDS:
        return WORDS[key]
    return (f"{key[:-2]} (s)" if key.endswith("_s") else key).replace("_", " ")


def series_key(keys: list[str], values: tuple) -> str:
    """A group's series name, as the summary names its row: key=value for each key's last part,
    a baseline without a rule's own parameter by its rule (``fedavg``), blank values left out."""
    parts = [text if isinstance(value, OtherRule) else f"{key.rsplit('.', 1)[-1]}={text}"
             for key, value, text in zip(keys, values, shown(keys, values)) if text]
    return ", ".join(parts) or "all runs"


def round_ticks(rounds: list[int]) -> list[int]:
    """Ticks on evaluated rounds: all of them when few, else those that are multiples of 1, 2,
    5, 10, 20, ... times the evaluation interval (the rounds' common step), at most MAX_TICKS."""
    rounds = sorted(set(rounds))
    if len(rounds) <= MAX_TICKS:
        return rounds
    step = math.gcd(*(b - a for a, b in zip(rounds, rounds[1:])))
    every = step
    while True:
        for factor in (1, 2, 5):
            ticks = [r for r in rounds if r % (every * factor) == 0]
            if ticks and len(ticks) <= MAX_TICKS:
                return ticks
        every *= 10
        if every > rounds[-1]:  # no multiple gives 1 to MAX_TICKS of the rounds: every k-th of them
            return rounds[::math.ceil(len(rounds) / MAX_TICKS)]


def wrap_title(fig, ax, title: str) -> None:
    """The title, wrapped to the axes' width: a long one would run off the figure."""
    width = max(len(line) for line in title.splitlines() or [""])
    text = ax.set_title(title)
    for _ in range(8):  # each pass narrows in proportion to the overflow: two or three do
        fig.draw_without_rendering()
        wide, room = text.get_window_extent().width, ax.get_window_extent().width
        if wide <= room or width <= 10:
            return
        width = max(10, min(width - 1, int(width * room / wide)))
        text.set_text("\n".join(textwrap.fill(line, width) for line in title.splitlines()))


def parse_rounds(text: str) -> tuple[int, int]:
    """--rounds 'A-B' -> (A, B), 1 <= A <= B."""
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    if not match or not 1 <= int(match.group(1)) <= int(match.group(2)):
        raise ConfigError(f"--rounds: {text!r} is not A-B with 1 <= A <= B (e.g. 10-40)")
    return int(match.group(1)), int(match.group(2))


def _points(run: Run, metric: str, window: tuple[int, int] | None, x: str = "round") -> tuple[list, list[float]]:
    """(x values, metric values) of the rounds (in ``window``) that have both."""
    rounds, values = run.series(metric)
    kept = [(r, v) for r, v in zip(rounds, values) if window is None or window[0] <= r <= window[1]]
    if x == "round":
        return [r for r, _ in kept], [v for _, v in kept]
    at = dict(zip(*run.series(x)))
    pairs = [(at[r], v) for r, v in kept if r in at]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def group_curve(runs: list[Run], metric: str, window: tuple[int, int] | None = None,
                x: str = "round") -> tuple[list, list[float], list[float]]:
    """(x, mean, std) over ``runs``: at the rounds (in ``window``) all of them have a value for;
    for another x (the simulated clock), each run's last value at or before every x of the runs'
    values in their common range."""
    if x == "round":
        series = [dict(zip(*_points(run, metric, window))) for run in runs]
        rounds = sorted(set.intersection(*(set(s) for s in series)))
        stats = [mean_std([s[r] for s in series]) for r in rounds]
        return rounds, [m for m, _ in stats], [sd for _, sd in stats]
    curves = [_points(run, metric, window, x) for run in runs]
    low, high = max(xs[0] for xs, _ in curves), min(xs[-1] for xs, _ in curves)
    grid = sorted({v for xs, _ in curves for v in xs if low <= v <= high})
    stats = [mean_std([next(y for v, y in zip(reversed(xs), reversed(ys)) if v <= t) for xs, ys in curves])
             for t in grid]
    return grid, [m for m, _ in stats], [sd for _, sd in stats]


def series_of(runs: list[Run], metric: str, group_by: str | None, warn,
              window: tuple[int, int] | None = None, x: str = "round") -> list[Series]:
    """The series to draw; runs without the metric (in ``window``) left out via ``warn``."""
    kept = []
    where = f" in rounds {window[0]}-{window[1]}" if window else ""
    for run in runs:
        if _points(run, metric, window, x)[1]:
            kept.append(run)
        elif window and run.series(metric)[1]:
            warn(f"skipped {run.folder}: no values of {metric}{where}")
        else:
            warn(f"skipped {run.folder}: no values of {metric} "
                 f"(its metrics: {', '.join(run.metric_names()) or 'none'})")
    if not kept:
        raise ConfigError(f"no run has values of {metric!r}{where}")
    if group_by is None:
        return [Series(os.path.basename(os.path.normpath(run.folder)), label_of(run), *_points(run, metric, window, x),
                       None) for run in kept]
    keys = differing_keys(kept) if group_by == "auto" else resolve_keys(group_by.split(","), kept)
    lines = []
    for values, members in group_runs(kept, keys).items():
        key = series_key(keys, values)
        rounds, mean, std = group_curve(members, metric, window, x)
        if rounds:
            lines.append(Series(key, f"{key} (n={len(members)})", rounds, mean, std))
        else:  # each run has values in the window, but not at a common round
            warn(f"skipped group {key}: its runs have no round with {metric}{where} in common")
    if not lines:
        raise ConfigError(f"no group has a round with {metric!r}{where} that all its runs have")
    return lines


def curves(runs: list[Run], metric: str, group_by: str | None, warn,
           window: tuple[int, int] | None = None, x: str = "round") -> list[tuple]:
    """[(label, x values, mean, std or None)] to draw; runs without the metric left out via ``warn``."""
    return [(s.label, s.rounds, s.values, s.std) for s in series_of(runs, metric, group_by, warn, window, x)]


def apply_labels(series: list[Series], items: list[str]) -> list[tuple[Series, str]]:
    """(series, legend text) in legend order: the series named by ``items`` ('SERIES:NAME', SERIES a
    series' key or its default legend entry) first, in the order given, as NAME; the others after,
    as their default entries."""
    named: dict[int, str] = {}
    for item in items:
        # the longest series name that the item starts with, then ':' (names and values may hold ':')
        hits = [(len(name), i) for i, s in enumerate(series) for name in (s.key, s.label)
                if item.startswith(name + ":")]
        if not hits:
            known = [s.key for s in series]
            near = close_match(item.rpartition(":")[0], known)
            hint = f"; did you mean {near}?" if near else ""
            raise ConfigError(f"--label {item!r}: give SERIES:NAME with SERIES one of the plot's series: "
                              f"{', '.join(known)}{hint}")
        length, i = max(hits)
        if i in named:
            raise ConfigError(f"--label {item!r}: series {series[i].key} is already named {named[i]!r}")
        named[i] = item[length + 1:]
    return [(series[i], text) for i, text in named.items()] + \
        [(s, s.label) for i, s in enumerate(series) if i not in named]


def parse_figsize(text: str) -> tuple[float, float]:
    try:
        width, height = (float(part) for part in text.split(","))
    except ValueError:
        width = height = 0.0
    if not (0 < width < 100 and 0 < height < 100):
        raise ConfigError(f"--figsize: {text!r} is not WIDTH,HEIGHT in inches (e.g. 3.5,2.6)")
    return width, height


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedddp.study.plot", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("runs", nargs="+", help="run folders, or folders above them (a sweep's --out)")
    p.add_argument("--metric", default="test_accuracy", help="a key of metrics.jsonl")
    p.add_argument("--group-by", default=None,
                   help="config keys (comma-separated) or auto: one mean line and +-std band per group")
    p.add_argument("--out", default="compare.png", help="file to write; its extension is the format: png, pdf, "
                                                        "svg, ...")
    p.add_argument("--label", action="append", default=[], metavar="SERIES:NAME",
                   help="show a series as NAME, e.g. name=fedavg:FedAvg (repeat; sets the legend's order)")
    p.add_argument("--title", default=None, help="title above the axes")
    p.add_argument("--x", default="round", help="the x axis: round, or a key of metrics.jsonl such as "
                                                "sim_time_s (the simulated clock: sync and async runs on one axis)")
    p.add_argument("--xlabel", default=None, help="x-axis label (default: --x in words, e.g. round)")
    p.add_argument("--ylabel", default=None, help="y-axis label (default: the metric in words, e.g. test accuracy)")
    p.add_argument("--figsize", default="6,4", help="WIDTH,HEIGHT in inches (default 6,4)")
    p.add_argument("--style", default=None, help="a matplotlib style name (e.g. seaborn-v0_8-paper, ggplot) "
                                                 "or style file")
    p.add_argument("--legend", default="best", choices=LEGENDS,
                   help="best: where it covers the least; outside: right of the axes; below: under them")
    p.add_argument("--bands", default="hatch", choices=BANDS, help="the +-std bands of groups: hatched (default), "
                                                                   "plain fill, or none")
    p.add_argument("--rounds", default=None, metavar="A-B", help="draw rounds A to B only")
    p.add_argument("--dpi", type=float, default=120, help="dots per inch of a png (default 120)")
    return p


def _style(name: str | None):
    """The context that applies --style (or nothing); a name matplotlib does not know is a
    ConfigError here, before anything is drawn."""
    import contextlib

    import matplotlib.style

    if name is None:
        return contextlib.nullcontext()
    try:
        with matplotlib.style.context(name):
            pass
    except (OSError, ValueError):
        available = sorted(matplotlib.style.available)
        near = close_match(name, available)
        hint = f", did you mean {near}?" if near else ""
        raise ConfigError(f"--style: {name!r} is neither a matplotlib style nor a style file{hint} "
                          f"(available: {', '.join(available)})") from None
    return matplotlib.style.context(name)


def figure(args: argparse.Namespace, warn):
    """The figure of ``args`` (parsed by ``parser()``), not yet written: a matplotlib Figure with
    one Axes. Raises ConfigError for a wrong argument or nothing to draw."""
    import matplotlib
    import matplotlib.colors
    from matplotlib.figure import Figure

    window = parse_rounds(args.rounds) if args.rounds else None
    size = parse_figsize(args.figsize)
    style = _style(args.style)
    series = series_of(find_runs(args.runs), args.metric, args.group_by, warn, window, args.x)
    shown = apply_labels(series, args.label)
    with style:
        colours = matplotlib.rcParams["axes.prop_cycle"].by_key().get("color") if args.style else None
        colours = colours or OKABE_ITO
        fig = Figure(figsize=size, layout="constrained")
        ax = fig.add_subplot()
        handles = []
        for i, (s, text) in enumerate(shown):
            colour = colours[i % len(colours)]
            # on another x a group's value holds until its next x (group_curve): drawn as steps
            step = "post" if args.x != "round" and s.std is not None else None
            (line,) = ax.plot(s.rounds, s.values, color=colour, linestyle=LINESTYLES[i % len(LINESTYLES)],
                              marker=MARKERS[i % len(MARKERS)], markersize=4,
                              markevery=max(1, len(s.rounds) // 12), label=text,
                              drawstyle="steps-post" if step else "default")
            handle = line
            if s.std is not None and args.bands != "none":
                band = ax.fill_between(
                    s.rounds, [m - d for m, d in zip(s.values, s.std)], [m + d for m, d in zip(s.values, s.std)],
                    facecolor=matplotlib.colors.to_rgba(colour, 0.12), linewidth=0,
                    edgecolor=matplotlib.colors.to_rgba(colour, 0.6),
                    hatch=HATCHES[i % len(HATCHES)] if args.bands == "hatch" else None, step=step)
                handle = (band, line)  # the legend shows the band's fill and hatch under the line
            handles.append(handle)
        if args.x == "round":  # a tick between evaluations would mark a round without a value
            ax.set_xticks(round_ticks([r for s, _ in shown for r in s.rounds]))
        ax.set_xlabel(args.xlabel if args.xlabel is not None else words(args.x))
        ax.set_ylabel(args.ylabel if args.ylabel is not None else words(args.metric))
        if not args.style:
            ax.grid(alpha=0.3)
        texts = [text for _, text in shown]
        if args.legend == "best":
            ax.legend(handles, texts, loc="best")
        elif args.legend == "outside":
            fig.legend(handles, texts, loc="outside right upper")
        elif args.legend == "below":
            # as many columns as fit in the figure's width (at most 4): a wider legend would be cut
            for ncols in range(min(len(texts), 4), 0, -1):
                legend = fig.legend(handles, texts, loc="outside lower center", ncols=ncols)
                fig.draw_without_rendering()
                if ncols == 1 or legend.get_window_extent().width <= fig.bbox.width:
                    break
                legend.remove()
        if args.title:  # last: the legend's place sets the axes' width
            wrap_title(fig, ax, args.title)
    return fig


def save(fig, path: str, dpi: float = 120, style: str | None = None) -> None:
    """Write ``fig`` in the format of ``path``'s extension; pdf and svg keep their text as text and
    carry no creation date, so the same runs give the same bytes."""
    import matplotlib

    fmt = os.path.splitext(path)[1].lower().lstrip(".")
    metadata = {"pdf": {"CreationDate": None}, "svg": {"Date": None}}.get(fmt)
    with _style(style), matplotlib.rc_context({"pdf.fonttype": 42, "ps.fonttype": 42, "svg.fonttype": "none",
                                               "svg.hashsalt": "fedddp"}):
        fig.savefig(path, dpi=dpi, metadata=metadata)


def check_format(path: str) -> None:
    from matplotlib.figure import Figure

    fmt = os.path.splitext(path)[1].lower().lstrip(".")
    supported = Figure().canvas.get_supported_filetypes()
    if fmt not in supported:
        raise ConfigError(f"--out: {path!r}: the extension names the format; give one of "
                          f"{', '.join('.' + f for f in sorted(supported))} (e.g. .png, .pdf, .svg)")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print('fedddp.study.plot: error: needs matplotlib: pip install -e ".[plot]"', file=sys.stderr)
        return 2
    try:
        if args.dpi <= 0:
            raise ConfigError(f"--dpi: must be > 0, got {args.dpi:g}")
        check_format(args.out)
        fig = figure(args, lambda line: print(f"fedddp.study.plot: {line}", file=sys.stderr))
    except ConfigError as exc:
        print(f"fedddp.study.plot: error: {exc}", file=sys.stderr)
        return 2
    save(fig, args.out, args.dpi, args.style)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
