"""Seconds per round phase, and the share of round time spent outside local training.

Runs real experiments (``python -m fedddp`` / real ``torchrun``) and reads their metrics.jsonl:
the quickstart, and the seed-002 CNN on the real MNIST test split (8,000 / 2,000, 10 clients,
Dirichlet 0.3), each with 1 and 2 ranks. Round 1 is left out of the means (warm-up: first
allocations, lazy imports).

    python bench/round_phases.py [--rounds 10] [--data-root ../shared/data]
"""

from __future__ import annotations

import argparse
import json
import os
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
    args = parser.parse_args()
    workloads = [
        ("quickstart (synthetic, logistic)", "configs/quickstart.toml", []),
        ("CNN, real MNIST t10k 8k/2k, Dir(0.3)", "configs/mnist_cnn.toml", [f"data.root={args.data_root}"]),
    ]
    print(f"rounds {args.rounds} (round 1 excluded), eval every 5 rounds, no checkpoints\n")
    print("train s is the slowest rank's local training (the critical path); imbalance is slowest minus")
    print("fastest rank. 'outside training' = 1 - train / round; 'excl. eval' leaves evaluation out.\n")
    print("| workload | ranks | round s | train s | imbalance s | communicate s | aggregate s | evaluate s "
          "| outside training | excl. eval |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, config, extra in workloads:
        for nproc in (1, 2):
            with tempfile.TemporaryDirectory() as out:
                rows = run(config, nproc, out, extra + [f"run.rounds={args.rounds}", "run.eval_every=5",
                                                        "run.ckpt_every=0"])[1:]
            mean = {k: sum(r[k] for r in rows) / len(rows) for k in PHASES + ("time_s",)}
            outside = 1.0 - mean["train_s"] / mean["time_s"]
            no_eval = 1.0 - mean["train_s"] / (mean["time_s"] - mean["evaluate_s"])
            print(f"| {name} | {nproc} | {mean['time_s']:.4f} | {mean['train_s']:.4f} | "
                  f"{mean['train_imbalance_s']:.4f} | {mean['communicate_s']:.4f} | {mean['aggregate_s']:.5f} | "
                  f"{mean['evaluate_s']:.4f} | {100 * outside:.2f}% | {100 * no_eval:.2f}% |")


if __name__ == "__main__":
    main()
