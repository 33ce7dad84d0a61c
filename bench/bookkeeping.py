"""A round's bookkeeping at one rank: its time outside local training and evaluation, and the
host synchronisations it makes.

Everything a round does besides training its clients and evaluating the model is bookkeeping:
sampling, the clients' contexts and report rows, the exchange (nothing to send at one rank),
the server rule, the divergence checks, the metrics rows. On a GPU each value read on the host
(``.item()``, ``.tolist()``, ``float(t)``, ``nonzero``, ...) and each blocking host-to-device copy
waits for every queued kernel, so a read per client turns a round's queue into a stall per
client. Two measures, per round (round 1 left out: it pays for warm-up):

- ``outside ms``: metrics.jsonl's time_s - train_s - evaluate_s (no checkpoints are written);
- ``host reads``: counted by a TorchFunctionMode (``HostReads``: the CPU-checkable twin of a
  GPU sync), outside the trainer's ``train`` and the evaluations. With ``--device cuda`` also
  ``cuda syncs``: the synchronisations CUDA itself reports (torch.cuda.set_sync_debug_mode)
  over the same span.

    python bench/bookkeeping.py [--device cpu|cuda] [--clients 100] [--parallel 1,100] [--rounds 4]
        [--data-root ../shared/data] [--set KEY=VALUE ...]

Without MNIST under --data-root the synthetic quickstart data stands in (the line says which).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import warnings

import torch
from torch.overrides import TorchFunctionMode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# Tensor calls that read a value on the host: each waits for the device's queue on a GPU
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
              torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
              torch.Tensor.numpy, torch.Tensor.cpu, torch.equal, torch.Tensor.equal, torch.allclose,
              torch.Tensor.allclose, torch.Tensor.__array__}
# factories given host values and a device: a blocking host-to-device copy, also a wait on a GPU
UPLOADS = {torch.tensor, torch.as_tensor}


class HostReads(TorchFunctionMode):
    """Counts host reads (``HOST_READS``, and ``UPLOADS`` given a device) while not ``paused``;
    with ``cuda`` also the synchronisations CUDA reports. ``per_round``: the counts at each round's
    end (``counted_rounds``)."""

    def __init__(self, cuda: bool = False):
        super().__init__()
        self.count, self.paused, self.cuda = 0, 0, cuda
        self.syncs: list = []  # CUDA's sync warnings
        self.per_round: list[tuple[int, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused and (func in HOST_READS or (func in UPLOADS and kwargs.get("device") is not None)):
            self.count += 1
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def pause(self):
        """Local training and evaluation: not counted (nor CUDA's syncs within)."""
        self.paused += 1
        held = len(self.syncs)
        try:
            yield
        finally:
            self.paused -= 1
            del self.syncs[held:]

    def round_end(self) -> None:
        self.per_round.append((self.count, len(self.syncs)))


def _paused(mode: HostReads, fn):
    def wrapped(*args, **kwargs):
        with mode.pause():
            return fn(*args, **kwargs)
    return wrapped


@contextlib.contextmanager
def counted_rounds(cuda: bool = False):
    """A HostReads mode over a run in this process, paused in the trainers' ``train`` and in the
    evaluations, its counts taken at the end of each round's rows (Book.write_round)."""
    from fedddp import book, client_eval, round as round_loop
    from fedddp.client import trainers

    mode = HostReads(cuda)
    targets = [(trainers.OneAfterAnother, "train"), (trainers.SideBySide, "train"),
               (round_loop, "evaluate_round"), (client_eval, "evaluate_round")]
    saved = [(owner, name, owner.__dict__[name]) for owner, name in targets]
    write_round = book.Book.write_round

    def write_and_count(self, *args, **kwargs):
        write_round(self, *args, **kwargs)
        mode.round_end()

    for owner, name, fn in saved:
        setattr(owner, name, _paused(mode, fn))
    book.Book.write_round = write_and_count
    with contextlib.ExitStack() as stack:
        if cuda:
            syncs = stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
            mode.syncs = syncs
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with mode:
                yield mode
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
            for owner, name, fn in saved:
                setattr(owner, name, fn)
            book.Book.write_round = write_round


def per_round(counts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each round's own counts from the running totals, round 1 (with the setup) left out."""
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(counts, counts[1:])]


def run_here(args: list[str]) -> list[dict]:
    """``python -m fedddp ARGS`` in this process (run.out_dir set by the caller); its
    metrics.jsonl rows."""
    from fedddp.__main__ import main
    from fedddp.api import _TorchGlobals

    saved = _TorchGlobals()
    try:
        status = main(args + ["run.progress=false"])
    finally:
        saved.restore()
    if status != 0:
        raise SystemExit(f"fedddp {' '.join(args)} exited {status}")
    out_dir = next(a.split("=", 1)[1] for a in args if a.startswith("run.out_dir="))
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def workload(data_root: str, clients: int, parallel: int, rounds: int, device: str) -> tuple[str, list[str]]:
    """(its name, the arguments) of a run of ``clients`` clients, all of them every round."""
    common = [f"data.num_clients={clients}", f"run.clients_per_round={clients}", f"run.parallel_clients={parallel}",
              f"run.rounds={rounds}", "run.eval_every=1000", "run.ckpt_every=0", f"run.device={device}"]
    if os.path.isdir(os.path.join(data_root, "MNIST", "raw")):
        return "mnist_cnn", [os.path.join(REPO, "configs", "mnist_cnn.toml"), f"data.root={data_root}"] + common
    return "quickstart (synthetic)", [os.path.join(REPO, "configs", "quickstart.toml")] + common


def measure(args: list[str], cuda: bool = False) -> dict:
    """One run counted, one timed (the count's mode costs time): per steady round the host reads,
    CUDA's syncs (``cuda``) and the ms outside training and evaluation (median)."""
    with tempfile.TemporaryDirectory() as out, counted_rounds(cuda) as mode:
        run_here(args + [f"run.out_dir={out}/counted"])
    counts = per_round(mode.per_round)
    with tempfile.TemporaryDirectory() as out:
        rows = run_here(args + [f"run.out_dir={out}/timed"])[1:]
    outside = sorted(1e3 * (r["time_s"] - r["train_s"] - r["evaluate_s"]) for r in rows)
    return {"reads": [c[0] for c in counts], "syncs": [c[1] for c in counts], "outside_ms": outside[len(outside) // 2],
            "round_ms": 1e3 * sorted(r["time_s"] for r in rows)[len(rows) // 2],
            "communicate_ms": 1e3 * sorted(r["communicate_s"] for r in rows)[len(rows) // 2],
            "aggregate_ms": 1e3 * sorted(r["aggregate_s"] for r in rows)[len(rows) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--parallel", default="1,100", help="comma-separated run.parallel_clients (B)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--data-root", default=os.path.join(REPO, "..", "shared", "data"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override (repeatable)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    print(f"one rank, {args.clients} clients a round, device {args.device}, rounds {args.rounds} (round 1 excluded)"
          + "".join(f", {kv}" for kv in args.set))
    print("'outside ms' = time_s - train_s - evaluate_s, the median steady round; 'host reads' per round outside "
          "training and evaluation" + ("; 'cuda syncs': those CUDA reports over the same span" if cuda else ""))
    print("'aggregate ms': of the outside ms, the server rule's (aggregate_s, its one read included)")
    print("| workload | B | round ms | outside ms | communicate ms | aggregate ms | host reads / round |"
          + (" cuda syncs / round |" if cuda else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if cuda else ""))
    for parallel in [int(b) for b in args.parallel.split(",")]:
        name, run_args = workload(args.data_root, args.clients, parallel, args.rounds, args.device)
        m = measure(run_args + args.set, cuda)
        print(f"| {name} | {parallel} | {m['round_ms']:.1f} | {m['outside_ms']:.2f} | {m['communicate_ms']:.2f} | "
              f"{m['aggregate_ms']:.2f} | "
              f"{max(m['reads'])} |" + (f" {max(m['syncs'])} |" if cuda else ""), flush=True)


if __name__ == "__main__":
    main()
