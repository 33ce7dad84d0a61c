"""Run the papers' reduced sweeps and write docs/results.md from their summaries.

    python -m fedddp.study.results [SWEEP.toml ...] [--data DIR] [--parallel J] [--doc FILE] [--no-run]

Runs every sweep file (default: configs/sweeps/reduced/*.toml, in name order) with
``fedddp.study.sweep`` (finished runs are skipped, unfinished ones resumed), then writes the document:
per sweep file, its claim, the sweep file, the exact commands, the commit of the code, how many
seeds, the ``fedddp.study.summary`` table(s) and a verdict computed from the first table. Paths are
taken from the repository root (the folder above this package), where it runs.

A sweep file says what to do in header lines (``# Field: text``, continued on lines that start
with ``#`` and more than one space):

  # Claim:    the paper's claim, in words (copied into the document)
  # Prepare:  python -m MODULE ARGS  (run first, e.g. a data generator; optional)
  # Summary:  fedddp.study.summary's arguments, e.g. --metric test_accuracy --at last --by algorithm.name
            (one table per Summary line; the verdict reads the first)
  # Verdict:  key=value[&key=value], ... vs key=value, ...  (the claimed groups, then the
            baselines; keys as in the Summary's --by; one or more lines, each judged on the first table)
  # Match:    key=value[&key=value] ~ key=value[&key=value]  (optional, one or more: a claim that a
            group reaches what a reference group does, e.g. a cheap simulation of an expensive run)
  # Figure:   fedddp.study.plot's arguments, e.g. --group-by run.mode --x sim_time_s (optional; the
            figure is drawn from the sweep's runs into figures/SWEEP.png beside the document,
            which shows it with its command; needs matplotlib)

The verdict rule (RULE below): a claimed group reproduces the claim when its mean is better than
every baseline's mean by more than the larger of the two standard deviations; worse than some
baseline by more than that is behind a baseline; anything else is within the seeds' spread. Better is
higher, or lower for losses and errors (fedddp.study.summary.lower_is_better). A match (MATCH_RULE)
reproduces when the two means differ by no more than the larger of the two standard deviations.

A line ``<!-- written by hand below ... -->`` (KEPT) in the document and all that follows it are
kept when the document is rewritten: a part about other runs (a figure, its commands) lives
there.

The commit is ``git rev-parse --short HEAD``, "+dirty" when tracked files other than the
document differ from it. The runs a sweep makes are recorded with the commit when it starts
(OUT/logs/commits.json); a table names every commit its runs were made at.
Exit status: 0 written; 1 some run failed; 2 bad configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import time

from . import plot, summary, sweep
from ..atomic import atomic_write_text
from ..errors import ConfigError, UserError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEPS = "configs/sweeps/reduced"
DOC = "docs/results.md"
FIELDS = ("Paper", "Claim", "Reduced", "Hardware", "Prepare", "Summary", "Verdict", "Match", "Figure")
# This line and what follows it in the document are kept when the document is rewritten.
KEPT = "<!-- written by hand below: python -m fedddp.study.results keeps this line and what follows -->"
RULE = ("a claimed method reproduces the claim when its mean is better than every baseline's mean "
        "by more than the larger of the two standard deviations (sample std over the seeds); when "
        "it is worse than some baseline by more than that, it is behind a baseline; otherwise the "
        "difference is within the seeds' spread; either of the last two is not reproduced at this scale. Better: higher accuracy, lower "
        "loss or error.")
MATCH_RULE = ("a claimed match (a group reaching what a reference group does) reproduces when the two means "
              "differ by no more than the larger of the two standard deviations; otherwise they differ, "
              "which is not reproduced at this scale.")


def header(path: str) -> dict[str, list[str]]:
    """The ``# Field: text`` lines of a sweep file's leading comment, each field's occurrences in
    order (a continuation line, ``#`` and more than one space, joins the field above it)."""
    fields: dict[str, list[str]] = {}
    last = None
    try:
        fh = open(path)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the sweep file ({exc.strerror or exc})") from None
    with fh:
        for line in fh:
            if not line.startswith("#"):
                break
            text = line[1:].rstrip()
            match = re.match(r" ?([A-Z][a-z]+):\s*(.*)", text)
            if match and match.group(1) in FIELDS:
                last = match.group(1)
                fields.setdefault(last, []).append(match.group(2))
            elif last and text.startswith("  ") and text.strip():
                fields[last][-1] += " " + text.strip()
            else:
                last = None
    for name in ("Claim", "Summary", "Verdict"):
        if name not in fields:
            raise ConfigError(f"{path}: no '# {name}:' line in the header (see python -m fedddp.study.results --help)")
    return fields


def parse_selectors(text: str, where: str) -> list[dict[str, str]]:
    """'name=fedgam, cgw_alpha=0.1&seed=0' -> [{'name': 'fedgam'}, {'cgw_alpha': '0.1', ...}]."""
    groups = []
    for item in (t.strip() for t in text.split(",")):
        pairs = [p.partition("=") for p in item.split("&")]
        if not item or any(not sep or not key.strip() for key, sep, _ in pairs):
            raise ConfigError(f"{where}: {item!r} is not key=value[&key=value]")
        groups.append({key.strip(): value.strip() for key, _, value in pairs})
    return groups


def parse_verdict(text: str, where: str) -> tuple[list[dict], list[dict]]:
    claimed, sep, baselines = text.partition(" vs ")
    if not sep:
        raise ConfigError(f"{where}: '# Verdict:' is 'CLAIMED, ... vs BASELINE, ...', got {text!r}")
    return parse_selectors(claimed, where), parse_selectors(baselines, where)


def parse_match(text: str, where: str) -> tuple[dict, dict]:
    claimed, sep, reference = text.partition(" ~ ")
    groups = parse_selectors(claimed, where) + parse_selectors(reference, where) if sep else []
    if len(groups) != 2:
        raise ConfigError(f"{where}: '# Match:' is 'CLAIMED ~ REFERENCE' (one group each), got {text!r}")
    return groups[0], groups[1]


def summary_args(text: str, where: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--metric", default="test_accuracy")
    parser.add_argument("--at", default="last")
    parser.add_argument("--by", default=None)
    parser.add_argument("--digits", type=int, default=4)
    try:
        args, rest = parser.parse_known_args(shlex.split(text))
    except (argparse.ArgumentError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if rest:
        raise ConfigError(f"{where}: unknown summary argument(s) {' '.join(rest)}")
    summary.parse_at(args.at)
    return args


def git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout if out.returncode == 0 else ""


def commit(doc: str) -> str:
    """Short HEAD, "+dirty" when tracked files other than ``doc`` differ from it."""
    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return head + ("+dirty" if [p for p in changed if p != doc] else "")


def record_commits(out: str, names: list[str], made_at: str) -> None:
    path = os.path.join(out, "logs", "commits.json")
    known = read_commits(out)
    known.update({name: made_at for name in names})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.tmp", "w") as fh:
        json.dump(known, fh, indent=1, sort_keys=True)
    os.replace(f"{path}.tmp", path)


def read_commits(out: str) -> dict[str, str]:
    try:
        with open(os.path.join(out, "logs", "commits.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def prepare_argv(line: str, path: str) -> list[str]:
    """A '# Prepare:' line -> the command to run; only this project's modules are run."""
    argv = shlex.split(line)
    if argv[:2] != ["python", "-m"] or len(argv) < 3 or not argv[2].startswith("fedddp"):
        raise ConfigError(f"{path}: '# Prepare:' runs 'python -m fedddp...', got {line!r}")
    return [sys.executable] + argv[1:]


def run_sweep(path: str, fields: dict, parallel: int, doc: str) -> tuple[int, float, int]:
    """Prepare, then the sweep; returns (exit status, wall seconds, runs started). Its runs are
    recorded as made at the commit of the checkout when it starts."""
    made_at = commit(doc)
    start = time.perf_counter()
    for line in fields.get("Prepare", []):
        status = subprocess.run(prepare_argv(line, path)).returncode
        if status != 0:
            return status, time.perf_counter() - start, 0
    out, _, points = sweep.plan(os.path.relpath(path), [], None)
    pending = [p for p in points if p.status != "done"]
    status = sweep.main([os.path.relpath(path), "--parallel", str(parallel)]) if pending else 0
    # by folder: a run found in a folder of an older name (fedddp.study.sweep) stays there
    finished = [os.path.basename(p.out_dir) for p in pending if os.path.exists(os.path.join(p.out_dir, "final.pt"))]
    record_commits(out, finished, made_at)
    return status, time.perf_counter() - start, len(pending)


def better(metric: str, a: float, b: float) -> bool:
    return a < b if summary.lower_is_better(metric) else a > b


def matches(row: dict, keys: list[str], selector: dict[str, str]) -> bool:
    short = {k.rsplit(".", 1)[-1]: k for k in keys}
    for key, value in selector.items():
        full = key if key in keys else short.get(key)
        if full is None or summary._cell(row[full]) != value and str(row[full]) != value:
            return False
    return True


def label(selector: dict[str, str]) -> str:
    return " ".join(f"{v}" if k in ("name", "algorithm.name") else f"{k}={v}" for k, v in selector.items())


def verdict(rows: list[dict], keys: list[str], metric: str, claimed: list[dict], baselines: list[dict],
            digits: int, where: str) -> list[str]:
    """One line per claimed group: reproduced, behind a baseline, or within the spread, with its numbers."""
    def find(selector):
        found = [r for r in rows if matches(r, keys, selector)]
        if len(found) != 1:
            raise ConfigError(f"{where}: '# Verdict:' {label(selector)!r} matches {len(found)} rows of the table")
        return found[0][metric]

    def show(cell):
        return summary.format_cell(cell, digits, n=False)

    base = [(label(b), find(b)) for b in baselines]
    lines = []
    for selector in claimed:
        mine = find(selector)
        ahead = [(name, cell) for name, cell in base
                 if better(metric, mine[0], cell[0]) and abs(mine[0] - cell[0]) > max(mine[1], cell[1])]
        behind = [(name, cell) for name, cell in base
                  if better(metric, cell[0], mine[0]) and abs(mine[0] - cell[0]) > max(mine[1], cell[1])]
        strongest = min(base, key=lambda b: b[1][0]) if summary.lower_is_better(metric) else \
            max(base, key=lambda b: b[1][0])
        versus = f"{label(selector)} {show(mine)} vs {strongest[0]} {show(strongest[1])}"
        if len(base) > 1:
            versus += f" (the best of {len(base)} baselines)"
        if len(ahead) == len(base):
            lines.append(f"**reproduced**: {versus}; better than every baseline by more than both stds.")
        elif behind:
            lines.append(f"**not reproduced at this scale (behind a baseline)**: {versus}; worse than "
                         f"{', '.join(n for n, _ in behind)} by more than both stds.")
        else:
            lines.append(f"**not reproduced at this scale (within the spread)**: {versus}; better by "
                         f"more than both stds than {len(ahead)} of {len(base)} baseline(s).")
    return lines


def match(rows: list[dict], keys: list[str], metric: str, claimed: dict, reference: dict, digits: int,
          where: str) -> str:
    """One line: whether the claimed group reaches the reference group's mean (MATCH_RULE)."""
    def find(selector):
        found = [r for r in rows if matches(r, keys, selector)]
        if len(found) != 1:
            raise ConfigError(f"{where}: '# Match:' {label(selector)!r} matches {len(found)} rows of the table")
        return found[0][metric]

    mine, ref = find(claimed), find(reference)
    versus = (f"{label(claimed)} {summary.format_cell(mine, digits, n=False)} ~ {label(reference)} "
              f"{summary.format_cell(ref, digits, n=False)}")
    if abs(mine[0] - ref[0]) <= max(mine[1], ref[1]):
        return f"**reproduced (matches)**: {versus}; the means differ by no more than the larger std."
    return (f"**not reproduced at this scale (differs)**: {versus}; the means differ by "
            f"{abs(mine[0] - ref[0]):.{digits}f}, more than both stds.")


def figure(text: str, out: str, name: str, doc_dir: str) -> tuple[list[str], list[str]]:
    """A '# Figure:' line: the plot of the sweep's runs (``out``) drawn into figures/NAME.png beside
    the document; (the document's lines: its command and the image, problems)."""
    image = os.path.join(doc_dir, "figures", f"{name}.png")
    args = [out] + shlex.split(text)
    shown = " ".join(["python -m fedddp.study.plot"] + [shlex.quote(a) for a in args]
                     + ["--out", os.path.relpath(image, REPO)])
    if importlib.util.find_spec("matplotlib") is None:
        return [f"No figure here (matplotlib is not installed): `{shown}` draws it.", ""], []
    os.makedirs(os.path.dirname(image), exist_ok=True)
    with contextlib.redirect_stdout(io.StringIO()):
        status = plot.main(args + ["--out", image])
    if status != 0:
        return [f"No figure: `{shown}` failed (exit status {status}).", ""], [f"{name}: the figure failed"]
    return ["```", shown, "```", "", f"![{name}]({os.path.relpath(image, doc_dir)})", ""], []


def section(path: str, fields: dict, made_at: str, data: str, doc_dir: str = "docs") -> tuple[list[str], list[str]]:
    """The markdown of one sweep file's tables (and figure); (lines, problems) with a problem per
    unusable table. ``data``: the data root as given, shown in the sweep's command unless the file
    sets its own; ``doc_dir``: the document's folder (its figures/ holds the figures)."""
    rel = os.path.relpath(path, REPO)
    out, raw, points = sweep.plan(rel, [], None)
    lines = [f"## {os.path.splitext(os.path.basename(path))[0]}", ""]
    if "Paper" in fields:
        lines += [f"**Paper.** {fields['Paper'][0]}", ""]
    lines += [f"**Claim.** {fields['Claim'][0]}", ""]
    if "Reduced" in fields:
        lines += [f"**Reduced and replaced.** {fields['Reduced'][0]}", ""]
    if "Hardware" in fields:
        lines += [f"**Hardware.** {fields['Hardware'][0]}", ""]
    warnings: list[str] = []
    runs = summary.usable(summary.find_runs([out]) if os.path.isdir(out) else [], [], warnings.append)
    made = read_commits(out)
    names = {os.path.basename(r.folder) for r in runs}
    commits = sorted({made.get(n, "unknown (made before commits were recorded)") for n in names})
    seeds = sorted({r.config.get("run.seed") for r in runs}, key=summary.order_key)
    lines += [f"- sweep file: `{rel}` ({len(points)} runs, {len(runs)} finished)",
              f"- runs made at commit {', '.join(commits) or 'none'}; this document at commit {made_at}",
              f"- seeds: run.seed {', '.join(map(str, seeds))} (n = {len(seeds)})",
              "- commands (from the repository root; `python -m fedddp.study.results` runs them all):", "",
              "```"]
    lines += [f"{line}" for line in fields.get("Prepare", [])]
    env = "" if raw.get("data", {}).get("root") else f"FEDDDP_DATA={shlex.quote(data)} "
    lines.append(f"{env}python -m fedddp.study.sweep {rel} --parallel 2")
    tables = [summary_args(text, f"{rel}: '# Summary:'") for text in fields["Summary"]]
    lines += [f"python -m fedddp.study.summary {out} " + " ".join(f"--{k} {shlex.quote(str(v))}" for k, v in
                                                          vars(args).items() if v is not None and k != "digits")
              for args in tables]
    lines += ["```", ""]
    problems = []
    for index, args in enumerate(tables):
        metrics = [m for m in args.metric.split(",") if m]
        kept = summary.usable(runs, metrics, warnings.append, args.at)
        if not kept:
            problems.append(f"{rel}: no finished run with {args.metric}")
            lines += [f"No finished run with {args.metric} yet.", ""]
            break
        keys = summary.resolve_keys(args.by.split(","), kept) if args.by else summary.differing_keys(kept)
        rows = summary.summarise(kept, metrics, args.at, keys)
        lines += [summary.format_table(rows, keys, metrics, args.at, "md", args.digits).rstrip(), ""]
        if index == 0:
            lines += [f"Verdict ({metrics[0]}, {args.at}, mean ± std over the seeds):", ""]
            for text in fields["Verdict"]:
                claimed, baselines = parse_verdict(text, f"{rel}")
                lines += [f"- {v}" for v in verdict(rows, keys, metrics[0], claimed, baselines, args.digits, rel)]
            lines += [f"- {match(rows, keys, metrics[0], *parse_match(text, rel), args.digits, rel)}"
                      for text in fields.get("Match", [])]
            lines.append("")
    for text in fields.get("Figure", []) if runs else []:
        part, bad = figure(text, out, os.path.splitext(os.path.basename(path))[0], doc_dir)
        lines += part
        problems += bad
    return lines, problems


def write_doc(paths: list[str], doc: str, made_at: str, command: str, data: str) -> list[str]:
    lines = ["# Reduced reproductions of the papers' claims", "",
             "Written by `" + command + "` from the runs of the reduced sweeps in "
             f"`{SWEEPS}/`: every number below is computed from those runs "
             "(`fedddp.study.summary`), none is typed. Each sweep file's header says what is reduced "
             "and what replaces a data set that is not here; the full-scale sweeps are in "
             "`configs/sweeps/`. Cells are mean ± sample std (n runs) over the seeds "
             "`run.seed`, with `data.seed` fixed: the spread is training variation.", "",
             f"**Verdict rule.** {RULE[0].upper()}{RULE[1:]} {MATCH_RULE[0].upper()}{MATCH_RULE[1:]}", ""]
    problems, sections, overview = [], [], []
    for path in paths:
        part, bad = section(path, header(path), made_at, data, os.path.dirname(os.path.abspath(doc)))
        sections += part
        problems += bad
        name = os.path.splitext(os.path.basename(path))[0]
        overview += [f"- {name}: {line[2:].split(' vs ', 1)[0].split('; ', 1)[0]}" for line in part
                     if line.startswith("- **")]
    lines += ["Verdicts at a glance (each against its baselines in its section):", ""] + overview + [""] + sections
    os.makedirs(os.path.dirname(os.path.abspath(doc)), exist_ok=True)
    atomic_write_text("\n".join(lines).rstrip() + "\n" + kept_part(doc), doc)
    return problems


def kept_part(doc: str) -> str:
    """The document's hand-written part: from the KEPT line to the end ("" when it has none)."""
    try:
        with open(doc) as fh:
            text = fh.read()
    except FileNotFoundError:
        return ""
    start = text.find(KEPT)
    return "" if start < 0 else "\n" + text[start:].rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedddp.study.results", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("sweeps", nargs="*", help=f"sweep files (default: {SWEEPS}/*.toml)")
    parser.add_argument("--data", default=None,
                        help="data root of the image sets (default: $FEDDDP_DATA, else ../shared/data)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at once (default 2)")
    parser.add_argument("--doc", default=DOC, help=f"the document to write (default {DOC})")
    parser.add_argument("--no-run", action="store_true", help="write the document from the runs there are")
    args = parser.parse_args(argv)
    paths = [os.path.abspath(p) for p in args.sweeps]
    doc = os.path.abspath(args.doc)
    data = args.data or os.environ.get("FEDDDP_DATA") or ""
    data_abs = os.path.abspath(data) if data else ""  # as given: from where the command was started
    os.chdir(REPO)
    data = data or "../shared/data"  # the default, as README's: from the repository root
    os.environ["FEDDDP_DATA"] = data_abs or os.path.abspath(data)
    try:
        if args.parallel < 1:
            raise ConfigError("--parallel: must be >= 1")
        paths = paths or sorted(glob.glob(os.path.join(REPO, SWEEPS, "*.toml")))
        if not paths:
            raise ConfigError(f"no sweep files in {SWEEPS}/ (give them as arguments)")
        fields = {p: header(p) for p in paths}  # every header's mistakes before any run
        for p in paths:
            for text in fields[p]["Summary"]:
                summary_args(text, f"{p}: '# Summary:'")
            for text in fields[p]["Verdict"]:
                parse_verdict(text, p)
            for text in fields[p].get("Match", []):
                parse_match(text, p)
            for line in fields[p].get("Prepare", []):
                prepare_argv(line, p)
        failed = []
        if not args.no_run:
            for p in paths:
                status, wall_s, started = run_sweep(p, fields[p], args.parallel, os.path.relpath(doc, REPO))
                print(f"fedddp.study.results: {os.path.relpath(p, REPO)}: {started} run(s) started, "
                      f"{wall_s:.0f} s wall", flush=True)
                if status != 0:
                    failed.append(os.path.relpath(p, REPO))
        command = "python -m fedddp.study.results" + ("" if not args.sweeps else " " + " ".join(args.sweeps))
        problems = write_doc(paths, doc, commit(os.path.relpath(doc, REPO)), command, data)
    except UserError as exc:
        print(f"fedddp.study.results: error: {exc}", file=sys.stderr)
        return exc.exit_code
    for problem in problems:
        print(f"fedddp.study.results: {problem}", file=sys.stderr)
    print(f"fedddp.study.results: wrote {args.doc}")
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
