"""Seconds per FedAvg round of fedddp against the bare PyTorch loop a researcher would write.

One process, a world of one (no torchrun), on CUDA when present and else on the CPU: the seed-002
CNN of configs/mnist_cnn.toml on its 10 Dirichlet(0.3) clients of the real MNIST test split
(8,000 / 2,000 with data.holdout_from_test = 0.2; from --data-root), one local epoch, batch 32,
SGD lr 0.01, every client every round. Without the MNIST files a generated stand-in of the same
shape (random 1x28x28 images, 10 classes, 8,000 / 2,000) takes their place, and the output says so.

  fedddp  ``fedddp.run`` with run.rounds = R + 1 (its code path as the command line runs it);
          a round's seconds are metrics.jsonl's time_s less evaluate_s and checkpoint_s
          (sampling, training, report packing, gather, aggregation, divergence check).
  loop    one model; for each client: load the global state_dict, a fresh torch.optim.SGD,
          shuffled minibatches of 32 (the same number of steps as fedddp's client), then the
          sample-weighted average of the state dicts accumulated in place.

Both train on the same client tensors, already on the device, with the same thread count. Each
repeat runs fedddp then the loop (alternating), R + 1 rounds each; the first round of each is a
warm-up and left out; the figures are medians over every timed round. On CUDA the clock is read
after torch.cuda.synchronize() (fedddp's round ends in host reads of the loss and the model's
finiteness, which wait for the device).

    python bench/round_vs_loop.py [--rounds 5] [--repeats 3] [--threads 1] [--data-root ../shared/data]
    python bench/round_vs_loop.py --quick          # 3 small stand-in clients, 2 rounds, 1 repeat
    python bench/round_vs_loop.py --ops            # and tensor ops per step of both, by kind

--ops counts, under torch.profiler, the tensor ops one client's training dispatches per step in
fedddp's train_client and in the loop (top-level aten ops that compute: view and allocation ops
left out). On a GPU each launches at least one kernel, and a small model's step is bound by
launches, so extra ops are extra time there even where the CPU timing cannot show them.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import fedddp  # noqa: E402
from fedddp import checks, data as data_module  # noqa: E402
from fedddp.algorithms import build_model  # noqa: E402


def tables(args, stand_in: str | None, device: torch.device) -> dict:
    """configs/mnist_cnn.toml's run as the bench needs it: no checkpoints, no evaluation but the
    last round's (left out of the timing), no progress line."""
    data = {"name": "mnist", "root": args.data_root, "holdout_from_test": 0.2} if stand_in is None else \
        {"name": "tensors", "path": stand_in, "holdout_from_test": 0.0}
    return {
        "run": {"rounds": args.rounds + 1, "clients_per_round": args.clients, "eval_every": 10 ** 6,
                "ckpt_every": 0, "progress": False, "num_threads": args.threads, "seed": 0,
                "device": device.type},
        "data": data | {"num_clients": args.clients, "partition": "dirichlet", "dirichlet_alpha": 0.3},
        "model": {"name": "cnn"},
        "train": {"optimizer": "sgd", "lr": 0.01, "batch_size": 32, "local_epochs": 1},
        "algorithm": {"name": "fedavg"},
    }


def write_stand_in(folder: str, train: int, test: int) -> str:
    """Random MNIST-shaped arrays (float32 images, labels 0..9) as a tensors file."""
    gen = torch.Generator().manual_seed(0)
    mapping = {"x_train": torch.randn(train, 1, 28, 28, generator=gen),
               "y_train": torch.randint(0, 10, (train,), generator=gen),
               "x_test": torch.randn(test, 1, 28, 28, generator=gen),
               "y_test": torch.randint(0, 10, (test,), generator=gen)}
    path = os.path.join(folder, "stand_in.pt")
    torch.save(mapping, path)
    return path


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fedddp_seconds(cfg_tables: dict, folder: str) -> list[float]:
    """Per-round seconds of fedddp's round loop, warm-up round left out."""
    result = fedddp.run(cfg_tables, ["run.overwrite=true"], out_dir=os.path.join(folder, "fedddp"))
    return [r["time_s"] - r["evaluate_s"] - r["checkpoint_s"] for r in result.metrics[1:]]


def bare_loop_seconds(cfg, clients: list, device: torch.device, rounds: int) -> list[float]:
    """The loop a researcher would write; per-round seconds, warm-up round left out."""
    torch.manual_seed(cfg.run.seed)
    shape = tuple(clients[0][0].shape[1:])
    model = build_model(cfg, shape, 10).to(device)
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    total = sum(len(y) for _, y in clients)
    batch = cfg.train.batch_size
    seconds = []
    for round_idx in range(rounds + 1):
        sync(device)
        start = time.perf_counter()
        average = {k: torch.zeros_like(v) for k, v in global_state.items()}
        for cid, (x, y) in enumerate(clients):
            model.load_state_dict(global_state)
            optimizer = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
            gen = torch.Generator().manual_seed(round_idx * 1000 + cid)
            order = torch.randperm(len(y), generator=gen).to(device)
            for pos in range(0, len(y), batch):
                idx = order[pos:pos + batch]
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
                optimizer.step()
            weight = len(y) / total
            for k, v in model.state_dict().items():
                average[k].add_(v, alpha=weight)
        global_state = average
        sync(device)
        seconds.append(time.perf_counter() - start)
    return seconds[1:]


METADATA_OPS = {"view", "_unsafe_view", "as_strided", "empty", "empty_strided", "empty_like", "reshape", "slice",
                "select", "detach", "detach_", "t", "transpose", "alias", "unsqueeze", "squeeze", "expand",
                "lift_fresh", "resolve_conj", "resolve_neg", "to", "result_type", "flatten", "contiguous",
                "numpy_T", "permute", "requires_grad_", "_has_compatible_shallow_copy_type", "is_nonzero"}


def ops_per_step(cfg, clients: list, device: torch.device) -> tuple[dict, dict, int]:
    """Tensor ops by name per step, of fedddp's train_client and of the loop, on client 0."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from fedddp import strategies
    from fedddp.client import ClientContext, LocalTraining, rules, train_client
    from fedddp.data import ClientData
    from fedddp.flat import FlatLayout
    from fedddp.report import ReportLayout

    x, y = clients[0]
    steps = -(-len(y) // cfg.train.batch_size)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg, tuple(x.shape[1:]), 10).to(device)
    layout = FlatLayout(model)
    global_P = layout.flatten(model).clone()
    needs = strategies.ALWAYS | strategies.get("fedavg").needs_for(cfg.algorithm)
    report = ReportLayout(needs, layout.numel, len(layout.conv_entries()))
    row_F = torch.empty(report.width, device=device)

    def fedddp_client():
        layout.unflatten_into(global_P, model)
        out = report.views(row_F)
        train_client(model, ClientContext(0, 1, global_P, layout, cfg.algorithm), ClientData(x, y), LocalTraining.of(cfg),
                     rules.get("plain"), needs, 1, out)
        out["train_time"] = 0.0
        report.pack_scalars(row_F, out)

    state = {k: v.to(device) for k, v in layout.state_dict(global_P).items()}
    average = {k: torch.zeros_like(v) for k, v in state.items()}

    def loop_client():
        model.load_state_dict(state)
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1)).to(device)
        for pos in range(0, len(y), cfg.train.batch_size):
            idx = order[pos:pos + cfg.train.batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            optimizer.step()
        for k, v in model.state_dict().items():
            average[k].add_(v, alpha=0.1)

    counts = []
    for client in (fedddp_client, loop_client):
        client()  # warm-up: lazy initialisation is not a step's work
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            client()
        top = Counter(e.name.removeprefix("aten::") for e in prof.events() if e.name.startswith("aten::")
                      and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))
        counts.append({name: n / steps for name, n in top.items() if name not in METADATA_OPS})
    return counts[0], counts[1], steps


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as fh:
            model = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"CPU {model}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per repeat (plus a warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating fedddp / loop repeats")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of both (run.num_threads)")
    parser.add_argument("--data-root", default=os.path.join(REPO, "..", "shared", "data"))
    parser.add_argument("--stand-in", action="store_true", help="generated data even if MNIST is there")
    parser.add_argument("--ops", action="store_true", help="also count the tensor ops per step of both")
    parser.add_argument("--quick", action="store_true",
                        help="3 clients of a 900-sample stand-in, 1 timed round, 1 repeat")
    args = parser.parse_args()
    stand_in_size = (8000, 2000)
    if args.quick:
        args.rounds, args.repeats, args.clients, args.stand_in = 1, 1, 3, True
        stand_in_size = (900, 100)
    mnist = os.path.isdir(os.path.join(args.data_root, "MNIST", "raw")) and not args.stand_in

    with tempfile.TemporaryDirectory() as folder:
        stand_in = None if mnist else write_stand_in(folder, *stand_in_size)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        cfg_tables = tables(args, stand_in, device)
        cfg = checks.load(cfg_tables)
        # the clients' tensors exactly as fedddp makes them, moved to the device once
        built = data_module.build(cfg, cfg.data.seed, list(range(cfg.data.num_clients)))
        clients = [(built.train[c].x.to(device), built.train[c].y.to(device)) for c in range(cfg.data.num_clients)]
        sizes = [len(y) for _, y in clients]
        source = "MNIST t10k 8k/2k" if mnist else f"generated stand-in {stand_in_size[0]}/{stand_in_size[1]} (no MNIST used)"
        print(f"device {device_name(device)}; {args.threads} thread(s); load {os.getloadavg()[0]:.2f} on "
              f"{os.cpu_count()} cores; torch {torch.__version__}")
        print(f"data {source}; {len(sizes)} clients of {min(sizes)}..{max(sizes)} samples, "
              f"{sum(-(-n // 32) for n in sizes)} steps a round; {args.rounds} timed rounds x "
              f"{args.repeats} repeats", flush=True)

        ours, loop = [], []
        torch_threads = torch.get_num_threads()
        for _ in range(args.repeats):
            ours += fedddp_seconds(cfg_tables, folder)
            torch.set_num_threads(args.threads)
            try:
                loop += bare_loop_seconds(cfg, clients, device, args.rounds)
            finally:
                torch.set_num_threads(torch_threads)
        fed_s, loop_s = statistics.median(ours), statistics.median(loop)
        print(f"fedddp  {fed_s:.4f} s/round (rounds {min(ours):.4f}..{max(ours):.4f})")
        print(f"loop    {loop_s:.4f} s/round (rounds {min(loop):.4f}..{max(loop):.4f})")
        print(f"ratio   {fed_s / loop_s:.3f}x; load {os.getloadavg()[0]:.2f} after the runs")
        if args.ops:
            torch.set_num_threads(args.threads)
            ours_ops, loop_ops, steps = ops_per_step(cfg, clients, device)
            torch.set_num_threads(torch_threads)
            print(f"tensor ops per step (client 0, {steps} steps): fedddp {sum(ours_ops.values()):.2f}, "
                  f"loop {sum(loop_ops.values()):.2f}; by kind where they differ:")
            for name in sorted(set(ours_ops) | set(loop_ops), key=lambda k: loop_ops.get(k, 0) - ours_ops.get(k, 0)):
                if abs(ours_ops.get(name, 0) - loop_ops.get(name, 0)) > 1e-9:
                    print(f"  {name:24s} fedddp {ours_ops.get(name, 0):6.2f}  loop {loop_ops.get(name, 0):6.2f}")


if __name__ == "__main__":
    main()
