"""Seconds per round phase, the speed-up over one rank, and the time ranks wait for each other.

Runs real experiments (``python -m fedddp`` / real ``torchrun``, one thread per rank) and reads
their metrics.jsonl: the quickstart, and the seed-002 CNN on the real MNIST test split (8,000 /
2,000, 10 uneven clients, Dirichlet 0.3), each with 1, 2 and 4 ranks (a rank count above the
machine's cores is reported as not measured: ranks would share cores). Round 1 is left out of
the means (warm-up: first allocations, lazy imports). The load average is printed beside each
row: the machine may be shared.

A machine whose speed drifts (a shared or throttled one) can move one ratio of two runs minutes
apart by more than the effect measured, so with ``--repeats N`` the rank counts run in turn N
times (1, 2, 4, 1, 2, 4, ...): every run gets its row, each speed-up is over the 1-rank run of
its own turn, and a last line gives the median speed-up and waiting share per rank count.

    python bench/round_phases.py [--rounds 10] [--ranks 1,2,4] [--repeats 1] [--data-root ../shared/data]
        [--set algorithm.name=scaffold ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("train_s", "train_imbalance_s", "communicate_s", "aggregate_s", "evaluate_s", "checkpoint_s")


def run(config: str, nproc: int, out_dir: str, overrides: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "fedddp"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "fedddp"]
    cmd += [config, f"run.out_dir={out_dir}", "run.progress=false"] + overrides
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--data-root", default=os.path.join(REPO, "..", "shared", "data"))
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts")
    parser.add_argument("--only", choices=("quickstart", "cnn"), help="one workload")
    parser.add_argument("--repeats", type=int, default=1, help="turns of all rank counts, one after another")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every workload (repeatable)")
    args = parser.parse_args()
    rank_counts = [int(r) for r in args.ranks.split(",")]
    workloads = [
        ("quickstart (synthetic, logistic)", "configs/quickstart.toml", []),
        ("CNN, real MNIST t10k 8k/2k, Dir(0.3)", "configs/mnist_cnn.toml", [f"data.root={args.data_root}"]),
    ]
    if args.only:
        workloads = [w for w in workloads if w[1].endswith(f"{args.only}.toml") or args.only in w[1]]
    cores = len(os.sched_getaffinity(0))
    print(f"rounds {args.rounds} (round 1 excluded), eval every 5 rounds, no checkpoints, {cores} cores"
          + "".join(f", {kv}" for kv in args.set) + "\n")
    print("train s is the slowest rank's local training (the critical path); imbalance is slowest minus")
    print("fastest rank; 'waiting' = imbalance / train, the share of training the fastest rank waits.")
    print("'speed-up' = 1-rank round / this round. 'outside training' = 1 - train / round; 'excl. eval'")
    print("leaves evaluation out. 'load' = the 1-minute load average after the run.\n")
    print("| workload | ranks | round s | speed-up | train s | imbalance s | waiting | communicate s | aggregate s "
          "| evaluate s | outside training | excl. eval | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, config, extra in workloads:
        speedups, waits = {}, {}
        for _ in range(args.repeats):
            one_rank = None
            for nproc in rank_counts:
                if nproc > cores:
                    print(f"| {name} | {nproc} | not measured: needs {nproc} cores, this machine has {cores} |"
                          + " |" * 10, flush=True)
                    continue
                with tempfile.TemporaryDirectory() as out:
                    rows = run(config, nproc, out, extra + [f"run.rounds={args.rounds}", "run.eval_every=5",
                                                            "run.ckpt_every=0"] + args.set)[1:]
                mean = {k: sum(r[k] for r in rows) / len(rows) for k in PHASES + ("time_s",)}
                one_rank = mean["time_s"] if nproc == 1 else one_rank
                speedup = f"{one_rank / mean['time_s']:.2f}x" if one_rank else "-"
                outside = 1.0 - mean["train_s"] / mean["time_s"]
                no_eval = 1.0 - mean["train_s"] / (mean["time_s"] - mean["evaluate_s"])
                waiting = mean["train_imbalance_s"] / mean["train_s"]
                if one_rank:
                    speedups.setdefault(nproc, []).append(one_rank / mean["time_s"])
                waits.setdefault(nproc, []).append(waiting)
                print(f"| {name} | {nproc} | {mean['time_s']:.4f} | {speedup} | {mean['train_s']:.4f} | "
                      f"{mean['train_imbalance_s']:.4f} | {100 * waiting:.1f}% | {mean['communicate_s']:.4f} | "
                      f"{mean['aggregate_s']:.5f} | {mean['evaluate_s']:.4f} | {100 * outside:.2f}% | "
                      f"{100 * no_eval:.2f}% | {os.getloadavg()[0]:.2f} |", flush=True)
        if args.repeats > 1:
            print(f"| {name} | median of {args.repeats} | | " + ", ".join(
                f"{n} ranks {statistics.median(speedups[n]):.2f}x (waiting {100 * statistics.median(waits[n]):.1f}%)"
                for n in speedups if n > 1) + " |" + " |" * 10, flush=True)

if __name__ == "__main__":
    main()
