"""Peak resident memory of a run against the population's size: data.name = clients_dir (a
client's samples read from disk when it trains) beside data.name = tensors (every sample in
memory) where the in-memory run fits.

Each population has ``--samples`` samples a client of shape [1, 8, 8] (uint8 pixels, random
labels of 10 classes: memory, not learning, is measured), written once, vectorised in pieces,
under ``--folder`` (a clients_dir folder, and an .npz for the in-memory runs). Each run trains
``--per-round`` clients a round for ``--rounds`` rounds (mlp, one local epoch) in a fresh
process, which prints its peak RSS (VmHWM of /proc/self/status) at the end of the run.

    python bench/population_memory.py [--clients 1000 100000 1000000] [--in-memory-max 1000000]
                                      [--rounds 3] [--override KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE, CLASSES, TEST = (1, 8, 8), 10, 1000
PIECE = 1 << 20  # samples generated at once: the generator's memory stays flat in N


def child(argv: list[str]) -> None:
    """One run in this process, then its peak and current RSS."""
    from fedddp.__main__ import main
    started = time.perf_counter()
    code = main(argv)
    status = {"code": code, "wall_s": time.perf_counter() - started}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                status[key] = int(value.split()[0]) * 1024
    print("RESULT " + json.dumps(status), flush=True)


def make_population(folder: str, num_clients: int, samples: int, npz: bool) -> tuple[str, str | None]:
    """(clients_dir folder, .npz of the same arrays or None), written if not there yet."""
    from fedddp.data import clients_dir
    path = os.path.join(folder, f"pop{num_clients}x{samples}")
    if not os.path.isfile(os.path.join(path, clients_dir.META)):
        shutil.rmtree(path, ignore_errors=True)
        rng = np.random.default_rng(num_clients)
        x_test = rng.integers(0, 256, size=(TEST, *SHAPE), dtype=np.uint8)
        y_test = rng.integers(0, CLASSES, size=TEST, dtype=np.uint8)
        x, y = clients_dir.create(path + ".part", np.full(num_clients, samples), SHAPE, np.uint8, np.uint8,
                                  x_test, y_test, CLASSES)
        for begin in range(0, len(y), PIECE):
            end = min(begin + PIECE, len(y))
            x[begin:end] = rng.integers(0, 256, size=(end - begin, *SHAPE), dtype=np.uint8)
            y[begin:end] = rng.integers(0, CLASSES, size=end - begin, dtype=np.uint8)
        x.flush()
        y.flush()
        del x, y
        os.rename(path + ".part", path)
    if not npz:
        return path, None
    npz_path = path + ".npz"
    if not os.path.isfile(npz_path):  # the same arrays as data.name = tensors reads them
        x = np.load(os.path.join(path, clients_dir.X))
        np.savez(npz_path + ".part.npz", x_train=x, y_train=np.load(os.path.join(path, clients_dir.Y)),
                 x_test=np.load(os.path.join(path, clients_dir.X_TEST)),
                 y_test=np.load(os.path.join(path, clients_dir.Y_TEST)),
                 client_train=np.repeat(np.arange(num_clients), samples), num_classes=np.array(CLASSES))
        os.rename(npz_path + ".part.npz", npz_path)
    return path, npz_path


def measure(overrides: list[str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "run.progress=false", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(results) != 1 or results[0]["code"] != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return results[0]


def main() -> None:
    if "--child" in sys.argv:
        child([a for a in sys.argv[1:] if a != "--child"])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1000, 100_000, 1_000_000])
    parser.add_argument("--samples", type=int, default=8, help="samples a client")
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-memory-max", type=int, default=1_000_000,
                        help="largest population also run in memory (data.name = tensors)")
    parser.add_argument("--folder", default="/tmp/fedddp-population", help="where the populations are written")
    parser.add_argument("--override", nargs="*", default=[], help="config overrides for every run, e.g. "
                        "run.sampling=poisson run.participation=0.0001")
    args = parser.parse_args()
    mib = 2.0 ** 20
    print(f"{args.samples} samples a client of shape {list(SHAPE)} (uint8), {args.per_round} clients a round, "
          f"{args.rounds} rounds, mlp; peak RSS of the run's process")
    print(f"{'clients':>10} {'samples':>10} {'on disk MiB':>12} {'clients_dir peak MiB':>21} {'s':>6} "
          f"{'in memory peak MiB':>19} {'s':>6}")
    for num_clients in args.clients:
        in_memory = num_clients <= args.in_memory_max
        started, existed = time.perf_counter(), os.path.isdir(
            os.path.join(args.folder, f"pop{num_clients}x{args.samples}"))
        folder, npz = make_population(args.folder, num_clients, args.samples, in_memory)
        written = "written before" if existed else f"written in {time.perf_counter() - started:.1f} s"
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        common = [f"data.num_clients={num_clients}", f"run.clients_per_round={args.per_round}",
                  f"run.rounds={args.rounds}", f"run.eval_every={args.rounds}", "run.ckpt_every=0", "model.name=mlp",
                  "train.local_epochs=1", "train.batch_size=8",
                  "run.overwrite=true", *args.override]
        runs = os.path.join(args.folder, "runs", str(num_clients))
        on_disk = measure(["data.name=clients_dir", f"data.path={folder}", f"run.out_dir={runs}-disk", *common])
        eager = measure(["data.name=tensors", f"data.path={npz}", "data.partition=natural",
                         f"run.out_dir={runs}-memory", *common]) if in_memory else None
        eager_words = f"{eager['VmHWM'] / mib:>19.0f} {eager['wall_s']:>6.1f}" if eager else f"{'not run':>19} {'':>6}"
        print(f"{num_clients:>10,} {num_clients * args.samples:>10,} {size / mib:>12.0f} "
              f"{on_disk['VmHWM'] / mib:>21.0f} {on_disk['wall_s']:>6.1f} {eager_words}"
              f"   ({written})", flush=True)


if __name__ == "__main__":
    main()
