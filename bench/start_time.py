"""How long a run takes to start: ``python -c "import torch"`` against a one-round quickstart.

Alternates the two commands (so both see the same load on a shared machine), after one
untimed quickstart that builds the fused kernels into their cache if they are not there yet.
Reports the median wall time of each, the median of the per-pair differences, and the CPU time
(user + system) of each, which the machine's other work disturbs less; the load average is
printed beside the figures. The quickstart runs with --verbose, whose start line ends "ready in
X s (data a, model b, ...)": the run's own time before round 1 after its imports, whose median
is printed too; --start-phases adds each phase's median.

    python bench/start_time.py [--repeats 7] [--start-phases]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPORT_TORCH = [sys.executable, "-c", "import torch"]


def quickstart(out_dir: str) -> list[str]:
    return [sys.executable, "-m", "fedddp", "--verbose", "configs/quickstart.toml", "run.rounds=1", f"run.out_dir={out_dir}",
            "run.overwrite=true"]


def timed(cmd: list[str], phases: list | None = None) -> tuple[float, float]:
    """(wall s, user + system CPU s) of one command; ``phases`` gets the run's start phases
    ({"ready": total, phase: s, ...}) from its --verbose start line."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if phases is not None:
        phases.append(ready_phases(done.stderr))
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def ready_phases(stderr: str) -> dict[str, float]:
    """The start line's "ready in X s (name s, ...)" as {"ready": X, name: s, ...}; {} without it."""
    found = re.search(r"ready in ([0-9.]+) s(?: \(([^)]*)\))?", stderr)
    if not found:
        return {}
    phases = {"ready": float(found.group(1))}
    for part in (found.group(2) or "").split(", "):
        name, _, seconds = part.rpartition(" ")
        if name:
            phases[name] = float(seconds)
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--start-phases", action="store_true", help="each start phase's median (of the runs showing it)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = os.path.join(tmp, "quickstart")
        timed(quickstart(out_dir))  # builds or loads the kernel cache; not counted
        torch_runs, run_runs, phases = [], [], []
        load_before = os.getloadavg()[0]
        for _ in range(args.repeats):
            torch_runs.append(timed(IMPORT_TORCH))
            run_runs.append(timed(quickstart(out_dir), phases))
        load_after = os.getloadavg()[0]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    print(f"{args.repeats} alternating pairs; 1-minute load average {load_before:.2f} before, {load_after:.2f} after\n")
    print("| command | wall s (median) | CPU s (median) |")
    print("|---|---|---|")
    print(f"| python -c \"import torch\" | {med([w for w, _ in torch_runs]):.2f} "
          f"| {med([c for _, c in torch_runs]):.2f} |")
    print(f"| python -m fedddp --verbose configs/quickstart.toml run.rounds=1 | {med([w for w, _ in run_runs]):.2f} "
          f"| {med([c for _, c in run_runs]):.2f} |")
    wall_diff = med([r[0] - t[0] for t, r in zip(torch_runs, run_runs)])
    cpu_diff = med([r[1] - t[1] for t, r in zip(torch_runs, run_runs)])
    print(f"\none-round quickstart minus import torch (median of the pairs): {wall_diff:+.2f} s wall, "
          f"{cpu_diff:+.2f} s CPU")
    ready = [p["ready"] for p in phases if p]
    if ready:
        print(f"the run's time before round 1 after its imports (the start line's \"ready in\"), median: "
              f"{med(ready):.2f} s")
    if args.start_phases:
        names = list(dict.fromkeys(name for p in phases for name in p if name != "ready"))
        print("phases of at least 10 ms, median of the runs showing them: " +
              (", ".join(f"{n} {med([p[n] for p in phases if n in p]):.2f} s" for n in names) or "none"))


if __name__ == "__main__":
    main()
