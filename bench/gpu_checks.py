"""Correctness on a CUDA device of what the CPU tests check on CPU: a model with Dropout trained
side by side (B = 4) equals one after another (B = 1) with SGD, FedSAM and Adam. Prints one line
per check and exits 1 if one fails.

    python bench/gpu_checks.py [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fedddp  # noqa: E402
from fedddp.models import Net  # noqa: E402

TOL = 2e-5  # of the weights' scale: the CPU tests' tolerance for side by side against one after another


def dropout_mlp(input_shape, num_classes):
    """Dropout on the inputs and after each hidden layer (the CPU tests' model)."""
    width = int(torch.tensor(input_shape).prod())
    return Net(nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(width, 32), nn.ReLU(), nn.Dropout(0.5),
                             nn.Linear(32, 16), nn.ReLU(), nn.Dropout(0.3)), nn.Linear(16, num_classes))


def final_P(device: str, parallel: int, extra: list[str]) -> torch.Tensor:
    with tempfile.TemporaryDirectory() as out:
        result = fedddp.run("configs/quickstart.toml", ["run.rounds=3", "run.ckpt_every=0", "run.progress=false",
                                                        f"run.device={device}", f"run.parallel_clients={parallel}",
                                                        *extra], out_dir=out)
    return torch.cat([t.detach().float().reshape(-1).cpu() for t in result.state_dict.values()])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    failed = 0
    for name, extra in [("dropout MLP, SGD", []), ("dropout MLP, FedSAM", ["algorithm.name=fedsam"]),
                        ("dropout MLP, Adam", ["train.optimizer=adam", "train.lr=0.001"])]:
        extra = ["model.name=bench.gpu_checks:dropout_mlp", *extra]
        one, side = final_P(args.device, 1, extra), final_P(args.device, 4, extra)
        diff = ((one - side).abs().max() / one.abs().max()).item()
        ok = diff <= TOL
        failed += not ok
        print(f"{name:24s} B=4 vs B=1 on {args.device}: max |diff| {diff:.2e} of the scale "
              f"(tolerance {TOL:.0e}) {'ok' if ok else 'FAILED'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
