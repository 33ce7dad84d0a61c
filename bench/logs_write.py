"""What rank 0's per-round files cost at many clients: ``logs.RunLogs.write_round`` for a round
of K reporting clients (metrics.jsonl, metrics.csv and K clients.jsonl lines), with CGW's three
per-client numbers or FedER's [K, L] layer weights as the rule's diagnostics. Median over
rounds of wall and CPU time (process time, which the machine's other work disturbs less); the
load average is printed beside the figures.

    python bench/logs_write.py [--clients 1000] [--layers 20] [--rounds 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from fedddp import logs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    num_clients = args.clients
    stacks = {"num_samples_K": torch.full((num_clients,), 60.0), "num_steps_K": torch.full((num_clients,), 6.0),
              "train_loss_K": torch.rand(num_clients), "train_time_K": torch.rand(num_clients)}
    rules = {"cgw": {"cgw_x_K": torch.rand(num_clients, dtype=torch.float64),
                     "cgw_weight_K": torch.rand(num_clients, dtype=torch.float64),
                     "cgw_grad_norm_K": torch.rand(num_clients, dtype=torch.float64), "cgw_c": torch.tensor(1.0)},
             f"feder (L = {args.layers})": {"feder_alpha_KL": torch.rand(num_clients, args.layers)}}
    reported = list(range(num_clients))
    rank_of = {c: c % 2 for c in reported}
    print(f"load average {os.getloadavg()[0]:.1f}")
    for name, diagnostics in rules.items():
        with tempfile.TemporaryDirectory() as out_dir:
            run_logs = logs.RunLogs(out_dir, 1, tensorboard=False)
            wall, cpu = [], []
            for round_idx in range(1, args.rounds + 1):
                line = {"round": round_idx, "train_loss": 0.5, "test_loss": None, "clients": reported,
                        "num_reports": num_clients, "dropped": []}
                t_wall, t_cpu = time.perf_counter(), time.process_time()
                run_logs.write_round(line, diagnostics, stacks, reported, rank_of, None)
                wall.append(time.perf_counter() - t_wall)
                cpu.append(time.process_time() - t_cpu)
            size = os.path.getsize(os.path.join(out_dir, "clients.jsonl")) / args.rounds / 1e3
        print(f"{name}: K = {num_clients}: {statistics.median(wall) * 1e3:.1f} ms a round (CPU "
              f"{statistics.median(cpu) * 1e3:.1f} ms), clients.jsonl {size:.0f} kB a round")


if __name__ == "__main__":
    main()
