"""Bytes and seconds per round of per-client state travelling between ranks.

Each round, the owner of every client that another rank trains sends the client's state there
before local training, and gets the new state back after it (fedddp.client.state.fetch and
send_home, in client-id order). This times exactly those two calls, with nothing else in the
round, for a config's real assignment (sampling, dropouts and the balanced assignment by cost
computed as the round loop does) and states of the config's model size: one [P] float32 tensor
per client (SCAFFOLD's c_k; MOON's previous model is the same size, FedSMOO's duals twice it).
Steady state: every client already has its state (in a real run, clients that never trained
send only an empty list). The time is the slowest rank's, between two barriers; the first
round is left out (warm-up: connections, allocations). Run under torchrun:

    torchrun --standalone --nproc_per_node=2 bench/state_transfer.py [configs/mnist_cnn.toml]
        [--rounds 20] [--data-root ../shared/data] [--store memory|mmap]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from fedddp import checks, env, participation
from fedddp.client.state import fetch, open_store, send_home
from fedddp.comm import Comm
from fedddp.data import build as build_data
from fedddp.flat import FlatLayout
from fedddp.algorithms import build_model
from fedddp.sampling import assign_clients, expected_cost, owned_clients, sample_clients, travelling

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=os.path.join(REPO, "configs", "mnist_cnn.toml"))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--data-root", default=os.path.join(REPO, "..", "shared", "data"))
    parser.add_argument("--store", choices=("memory", "mmap"), default="memory")
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = Comm(env.resolve(), "cpu")
    cfg = checks.load(args.config, [f"data.root={args.data_root}", "algorithm.name=scaffold"])
    data = build_data(cfg, cfg.data.seed, [])  # the partition only: sample counts, no tensors
    model = build_model(cfg, data.input_shape, data.num_classes, data.task)
    numel = FlatLayout(model, buffers=cfg.model.flat_buffers).numel
    cost_N = [expected_cost(n, cfg.train) for n in data.num_samples]
    owned = owned_clients(cfg.data.num_clients, comm.rank, comm.world_size)
    with tempfile.TemporaryDirectory() as folder:
        store = open_store(args.store, owned, os.path.join(folder, f"rank{comm.rank}"), comm.device)
        gen = torch.Generator().manual_seed(comm.rank)
        for cid in owned:
            store.client(cid)["control_P"] = torch.randn(numel, generator=gen)
        seconds, nbytes, moved = [], [], []
        for round_idx in range(1, args.rounds + 1):
            sampled = sample_clients(cfg.data.num_clients, cfg.num_sampled(), cfg.run.seed, round_idx)
            reporting = [c for c in sampled if not participation.drops_out(cfg.run.dropout, cfg.run.seed, round_idx, c)]
            per_rank = assign_clients(reporting, cost_N.__getitem__, comm.world_size, True)
            moves = travelling(reporting, per_rank, comm.world_size)
            comm.barrier()
            start = time.perf_counter()
            visiting = fetch(comm, store, moves)
            send_home(comm, store, moves, visiting)
            comm.barrier()
            if round_idx > 1:
                seconds.append(time.perf_counter() - start)
                nbytes.append(2 * len(moves) * numel * 4)
                moved.append(len(moves))
        store.close()
    if comm.is_main:
        print(f"{args.config}: P = {numel:,} floats, {comm.world_size} ranks, {cfg.num_sampled()} "
              f"clients a round, {args.store} store, rounds 2-{args.rounds}, load {os.getloadavg()[0]:.2f}")
        print(f"clients moved per round: mean {statistics.mean(moved):.1f} (min {min(moved)}, max {max(moved)})")
        print(f"bytes per round (there and back): mean {statistics.mean(nbytes) / 1e6:.2f} MB")
        print(f"seconds per round: median {statistics.median(seconds) * 1e3:.1f} ms, "
              f"mean {statistics.mean(seconds) * 1e3:.1f} ms, max {max(seconds) * 1e3:.1f} ms")
    comm.close()


if __name__ == "__main__":
    main()
