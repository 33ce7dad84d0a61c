"""Peak resident memory per rank with SCAFFOLD's per-client state in RAM versus memory-mapped.

SCAFFOLD keeps c_k (P floats) for every client that has trained, on its owner rank. With
run.client_state = memory these live in RAM; with mmap in sparse files under
out_dir/client_state, a row mapped only while its client trains. This runs the seed-002 CNN
(P = 582,026 on 28x28 inputs: 2.3 MB of state per client) with 1,000 clients on small synthetic
MNIST-like IDX files (tests/fedrun.make_mnist_like, in a temporary folder), a few clients per
round, and reports each rank's peak RSS (VmHWM) at the end of the run, next to FedAvg (no client
state) as the baseline. Every configuration runs in fresh processes (real torchrun for 2 ranks).

    python bench/client_state_memory.py [--clients 1000] [--per-round 25] [--rounds 2] [--ranks 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(argv: list[str]) -> None:
    """One rank: run fedddp in this process, then print its peak and current RSS."""
    from fedddp.__main__ import main
    code = main(argv)
    status = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                status[key] = int(value.split()[0]) * 1024
    print("RESULT " + json.dumps({"rank": int(os.environ.get("RANK", 0)), "code": code, **status}), flush=True)


def launch(nproc: int, overrides: list[str]) -> list[dict]:
    script = os.path.abspath(__file__)
    cmd = [sys.executable, script, "--child"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        script, "--child"]
    proc = subprocess.run(cmd + ["run.progress=false"] + overrides, cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(results) != nproc or any(r["code"] != 0 for r in results):
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    if "--child" in sys.argv:
        child([a for a in sys.argv[1:] if a != "--child"])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--samples", type=int, default=6000, help="synthetic images (80 %% train)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from fedrun import make_mnist_like

    mb = 1 / 2 ** 20
    with tempfile.TemporaryDirectory() as tmp:
        make_mnist_like(tmp, num=args.samples)
        common = [f"data.root={tmp}", "data.name=mnist", "data.holdout_from_test=0.2", "data.partition=iid",
                  f"data.num_clients={args.clients}", "model.name=cnn", f"run.rounds={args.rounds}",
                  f"run.clients_per_round={args.per_round}", "train.batch_size=16", "train.lr=0.05",
                  f"run.eval_every={args.rounds}", "run.ckpt_every=0"]
        print(f"SCAFFOLD, CNN (P = 582,026: 2.22 MiB of c_k per client), {args.clients} clients, "
              f"{args.per_round} per round, {args.rounds} rounds; peak RSS (VmHWM) per rank, MiB\n")
        print("| ranks | algorithm | client_state | clients with state (all ranks) | state MiB (all ranks) "
              "| peak RSS per rank | over FedAvg per rank |")
        print("|---|---|---|---|---|---|---|")
        for nproc in args.ranks:
            base = None
            for name, kind in (("fedavg", "memory"), ("scaffold", "memory"), ("scaffold", "mmap")):
                out = os.path.join(tmp, f"{name}-{kind}-{nproc}")
                results = launch(nproc, common + [f"algorithm.name={name}", f"run.client_state={kind}",
                                                  f"run.out_dir={out}"])
                peaks = [r["VmHWM"] for r in results]
                with open(os.path.join(out, "metrics.jsonl")) as fh:
                    trained = {c for line in fh for c in json.loads(line)["clients"]}
                num_state = len(trained) if name == "scaffold" else 0
                state_mb = num_state * 582_026 * 4 * mb
                base = base or peaks
                over = " / ".join(f"{(p - b) * mb:+.0f}" for p, b in zip(peaks, base))
                print(f"| {nproc} | {name} | {kind} | {num_state} | {state_mb:.0f} | "
                      f"{' / '.join(f'{p * mb:.0f}' for p in peaks)} | {over} |", flush=True)
        print(f"\nAt full participation every one of the {args.clients} clients holds c_k: "
              f"{args.clients * 582_026 * 4 * mb:.0f} MiB of RAM over all ranks with client_state = memory; "
              "with mmap it is on disk and one client's row at a time is resident.")


if __name__ == "__main__":
    main()
