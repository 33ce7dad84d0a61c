"""Gathered against sharded aggregation (run.aggregation): per-rank peak memory, bytes sent and
received, and the aggregation's time, on W ranks.

    python bench/aggregation_scale.py                               # ResNet-18, FedGMA, W = 1 2 4, K = 8 32
    python bench/aggregation_scale.py --ranks 4 --clients 32        # the target row
    python bench/aggregation_scale.py --rule fedavg --clients 8 16 32 64 --ranks 2
    python bench/aggregation_scale.py --device cuda --ranks 1        # one GPU (NCCL needs one per rank)
    python bench/aggregation_scale.py --smoke                       # a tiny model, seconds (a test)

For each world size W it starts one torchrun of W ranks (this script with --worker); each rank
fills its M = K / W report rows of the model's flat vector (ResNet-18 with CIFAR stem and
buffers: P = 11.2M; FedGMA's rows carry params and last-step gradient, F = 2 P + scalars) with
synthetic updates, then for every K and mode runs two rounds of the round loop's own server
stages, exchange, aggregate and publish (fedddp.server): gathered (rank 0 gathers [K, F], runs
the rule, broadcasts P) or sharded (fedddp.sharded: columns exchanged point to point, the rule
on each rank's range, ranges all-gathered). Columns:

  peak MiB     the most resident memory the aggregation added on a rank over the two rounds
               (Linux VmHWM, reset before the first, less the resident memory just before it:
               the process with its model and its own report rows): rank 0's, and the largest
               over ranks. On CUDA the device's max_memory_allocated above what was allocated.
  rss MiB      rank 0's VmHWM itself, everything counted (torch, the model, its report rows)
  sent/recv    MiB per round that rank 0 and the busiest rank sent and received through the
               collectives, as gloo's algorithms move them (fedddp.comm.Comm.traffic: its
               gather goes straight to the root, its broadcast down a binomial tree)
  written MiB  rank 0's bytes written through system calls in the second round (/proc/self/io
               wchar: gloo's socket sends), a check of its "sent"
  round s      the second round's time from the trained rows to the new model on every rank
               (the slowest rank), exchange + aggregate + publish, and rank 0's
               three phases: gather (sharded: the exchange), aggregate, broadcast (the
               all-gather)

The shared 2-core development machine runs W ranks on 2 cores: W = 4 time-shares them, so its
round times measure the cores more than the algorithm; memory and bytes do not depend on it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _io_bytes() -> int:
    """Bytes written through system calls (gloo's socket sends; its receives do not count here)."""
    with open("/proc/self/io") as fh:
        fields = dict(line.split(": ") for line in fh.read().splitlines())
    return int(fields["wchar"])


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:  # "5": VmHWM back to the resident size (Linux 4.0+)
        fh.write("5")


def _model_layout(name: str):
    import torch

    from fedddp.flat import FlatLayout
    from fedddp.models import build
    torch.manual_seed(0)
    if name == "tiny":
        model = build("mlp", (60,), 10, "classification", hidden=64)
    else:
        model = build(name, (3, 32, 32), 10, "classification")
    return FlatLayout(model, buffers=True)


def _setup(args, comm, layout, K: int, mode: str):
    """The run's server in ``mode`` with the round's plan and report rows: every client's row of
    synthetic updates, K clients over the ranks as the round loop lays them out."""
    import torch

    from fedddp import algorithms, config, strategies
    from fedddp.plan import RoundPlan
    from fedddp.prepare import server_of, static_stacks
    from fedddp.report import ReportLayout
    from fedddp.sampling import assign_clients, layout_rows
    cfg = config.Config(run=config.RunConfig(aggregation=mode, aggregation_block=args.block,
                                             sampling="fixed"),
                        # the rule's own parameters at their defaults
                        algorithm=algorithms.resolved(config.AlgorithmConfig(name=args.rule)))
    strategy = strategies.get(args.rule)
    needs = strategies.ALWAYS | strategy.needs_for(cfg.algorithm)
    report = ReportLayout(needs, layout.numel, len(layout.conv_entries()))
    device = comm.device
    global_P = torch.randn(layout.numel, generator=torch.Generator().manual_seed(1)).to(device)
    reporting = list(range(K))
    per_rank = assign_clients(reporting, lambda c: 1, comm.world_size, True)
    rows_per_rank, row_order = layout_rows(reporting, comm.world_size, per_rank)
    plan = RoundPlan(1, reporting, reporting, per_rank, [[c] for c in per_rank[comm.rank]], rows_per_rank,
                     row_order, {c: 1 for c in reporting}, {c: 1 for c in reporting}, 0)
    server = server_of(comm, mode, args.block, strategy, report,
                       static_stacks(needs, layout, cfg.cohort(), cfg.run, cfg.train, device),
                       cfg.algorithm, False, (cfg.train.lr, cfg.algorithm.server_lr), global_P,
                       strategy.init_state(global_P, cfg.algorithm))
    rows_MF = server.rows(rows_per_rank)
    noise_P = torch.randn(layout.numel, generator=torch.Generator().manual_seed(2)).to(device)
    for i, cid in enumerate(per_rank[comm.rank]):
        for stack, sl in report.slices.items():
            if stack.endswith("_KP"):   # the model plus a small update; a gradient of either sign
                shifted = noise_P.roll(7919 * (cid + 1) + 104729 * (stack != "params_KP"))
                rows_MF[i, sl] = global_P + 0.01 * shifted if stack == "params_KP" else shifted
        rows_MF[i, report.scalars] = 1.0
    return server, plan, rows_MF


def _measure(args, comm, layout, K: int, mode: str) -> dict:
    import torch

    server, plan, rows_MF = _setup(args, comm, layout, K, mode)
    cuda = comm.device.type == "cuda"
    gc.collect()
    comm.barrier()
    base_rss, base_cuda = _status("VmRSS"), torch.cuda.memory_allocated() if cuda else 0
    _reset_peak()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    def clock():
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    for _ in range(2):
        traffic, io_before = dict(comm.traffic), _io_bytes()
        comm.barrier()
        t = [clock()]
        rows, reported, _ = server.exchange(plan, rows_MF)
        t.append(clock())
        server.aggregate(1, rows, reported, True, None)
        t.append(clock())
        server.publish()
        t.append(clock())
        io_bytes = _io_bytes() - io_before
        del rows
    peak = (torch.cuda.max_memory_allocated() - base_cuda) if cuda else _status("VmHWM") - base_rss
    out = {"peak": peak, "rss": _status("VmHWM"), "seconds": t[3] - t[0], "io": io_bytes,
           "sent": comm.traffic["sent"] - traffic["sent"], "received": comm.traffic["received"] - traffic["received"],
           "gather": t[1] - t[0], "aggregate": t[2] - t[1], "broadcast": t[3] - t[2]}
    del server, rows_MF
    gc.collect()
    every = torch.tensor([[out[k] for k in ("peak", "rss", "seconds", "io", "sent", "received", "gather",
                                            "aggregate", "broadcast")]],
                         dtype=torch.float64, device=comm.device).repeat(comm.world_size, 1)
    every[[r for r in range(comm.world_size) if r != comm.rank]] = 0
    comm.all_reduce_sum_(every)   # row r: rank r's figures
    return {"K": K, "mode": mode, "ranks": every.cpu().tolist()}


def worker(args) -> None:
    import torch

    from fedddp.comm import Comm
    from fedddp.env import resolve
    torch.set_num_threads(1)
    comm = Comm(resolve(), args.device, timeout_s=3600)
    layout = _model_layout(args.model)
    results = [_measure(args, comm, layout, K, mode) for K in args.clients for mode in args.modes]
    if comm.is_main:
        with open(args.out, "w") as fh:
            json.dump({"numel": layout.numel, "world": comm.world_size, "results": results}, fh)
    comm.close()


def _row(world: int, r: dict) -> str:
    mib = 2 ** 20
    ranks = r["ranks"]
    peak0, peak_max = ranks[0][0] / mib, max(x[0] for x in ranks) / mib
    seconds = max(x[2] for x in ranks)
    sent0, recv0 = ranks[0][4] / mib, ranks[0][5] / mib
    busiest = max(ranks, key=lambda x: x[4] + x[5])
    return (f"| {world} | {r['K']} | {r['mode']} | {peak0:,.0f} | {peak_max:,.0f} | {ranks[0][1] / mib:,.0f} | "
            f"{sent0:,.0f} / {recv0:,.0f} | {busiest[4] / mib:,.0f} / {busiest[5] / mib:,.0f} | "
            f"{ranks[0][3] / mib:,.0f} | {seconds:.2f} | {ranks[0][6]:.2f} / {ranks[0][7]:.2f} / {ranks[0][8]:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--rule", default="fedgma")
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["gather", "sharded"])
    parser.add_argument("--block", type=int, default=65536)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--smoke", action="store_true", help="a tiny MLP, K = 4, W = 1 and 2")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.model, args.clients, args.ranks, args.block = "tiny", [4], [1, 2], 256
    if args.worker:
        worker(args)
        return
    print(f"model {args.model}, rule {args.rule}, blocks of {args.block} columns, {args.device}; "
          "MiB; peak: added over the process with its own rows")
    print("| W | K | mode | peak rank 0 | peak max | rss rank 0 | sent / recv rank 0 | sent / recv busiest | "
          "written rank 0 | round s | rank 0: gather / aggregate / broadcast s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for world in args.ranks:
        out = f"/tmp/aggregation_scale_{os.getpid()}_{world}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               os.path.abspath(__file__), "--worker", "--out", out, "--model", args.model, "--rule", args.rule,
               "--block", str(args.block), "--device", args.device, "--clients", *map(str, args.clients),
               "--modes", *args.modes]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run(cmd, check=True, env=env, cwd=REPO)
        with open(out) as fh:
            found = json.load(fh)
        os.remove(out)
        for r in found["results"]:
            print(_row(world, r), flush=True)


if __name__ == "__main__":
    main()
