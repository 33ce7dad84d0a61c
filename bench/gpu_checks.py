"""Correctness on a CUDA device of what the CPU tests check on CPU: a model with Dropout trained
side by side (B = 4) equals one after another (B = 1) with SGD, FedSAM and Adam; so does a model
with BatchNorm (torch's kernel on steps without padding, the masked form on padded ones, and
under run.compile), in float32 and, to bfloat16's tolerance, with train.precision = bf16; and
the warm-up before round 1 runs whole (its start-line words name nothing skipped). Prints one
line per check and exits 1 if one fails.

    python bench/gpu_checks.py [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fedddp  # noqa: E402
from fedddp.models import Net  # noqa: E402

TOL = 2e-5  # of the weights' scale: the CPU tests' tolerance for side by side against one after another
BF16_TOL = 2e-2  # tests/test_precision.py's


def dropout_mlp(input_shape, num_classes):
    """Dropout on the inputs and after each hidden layer (the CPU tests' model)."""
    width = int(torch.tensor(input_shape).prod())
    return Net(nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(width, 32), nn.ReLU(), nn.Dropout(0.5),
                             nn.Linear(32, 16), nn.ReLU(), nn.Dropout(0.3)), nn.Linear(16, num_classes))


def batch_norm_mlp(input_shape, num_classes):
    """A BatchNorm1d after a linear layer without bias (as in ResNet), then the head."""
    width = int(torch.tensor(input_shape).prod())
    return Net(nn.Sequential(nn.Flatten(), nn.Linear(width, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU()),
               nn.Linear(32, num_classes))


def final_P(device: str, parallel: int, extra: list[str]) -> torch.Tensor:
    with tempfile.TemporaryDirectory() as out:
        result = fedddp.run("configs/quickstart.toml", ["run.rounds=3", "run.ckpt_every=0", "run.progress=false",
                                                        f"run.device={device}", f"run.parallel_clients={parallel}",
                                                        *extra], out_dir=out)
    return torch.cat([t.detach().float().reshape(-1).cpu() for t in result.state_dict.values()])


def start_line(device: str, extra: list[str]) -> str:
    """The run's start line (stderr) of a one-round run."""
    err = io.StringIO()
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stderr(err):
        fedddp.run("configs/quickstart.toml", ["run.rounds=1", "run.ckpt_every=0", "run.progress=true",
                                               f"run.device={device}", *extra], out_dir=out)
    return next((line for line in err.getvalue().splitlines() if " rank(s) on " in line), "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    failed = 0
    dropout = "model.name=bench.gpu_checks:dropout_mlp"
    batch_norm = ["model.name=bench.gpu_checks:batch_norm_mlp", "train.batch_size=12"]  # no last batch of one
    for name, extra, tol in [("dropout MLP, SGD", [dropout], TOL),
                             ("dropout MLP, FedSAM", [dropout, "algorithm.name=fedsam"], TOL),
                             ("dropout MLP, Adam", [dropout, "train.optimizer=adam", "train.lr=0.001"], TOL),
                             ("BatchNorm MLP, SGD", batch_norm, TOL),
                             ("BatchNorm MLP, FedSAM", [*batch_norm, "algorithm.name=fedsam"], TOL),
                             ("BatchNorm MLP, compiled", [*batch_norm, "run.compile=true"], TOL),
                             ("BatchNorm MLP, bf16", [*batch_norm, "train.precision=bf16"], BF16_TOL)]:
        one, side = final_P(args.device, 1, extra), final_P(args.device, 4, extra)
        diff = ((one - side).abs().max() / one.abs().max()).item()
        ok = diff <= tol
        failed += not ok
        print(f"{name:24s} B=4 vs B=1 on {args.device}: max |diff| {diff:.2e} of the scale "
              f"(tolerance {tol:.0e}) {'ok' if ok else 'FAILED'}", flush=True)
    if args.device == "cuda":  # elsewhere a run warms up only with run.compile
        for name, extra in [("warm-up, B = 1, FedGMA", ["algorithm.name=fedgma"]),
                            ("warm-up, B = 4, FedAvg", ["run.parallel_clients=4"])]:
            line = start_line(args.device, extra)
            ok = "s before round 1" in line and "skipped" not in line
            failed += not ok
            words = next((w for w in line.split("; ") if w.startswith("warm-up")), "no warm-up in the start line")
            print(f"{name:24s} on {args.device}: {words} {'ok' if ok else 'FAILED'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
