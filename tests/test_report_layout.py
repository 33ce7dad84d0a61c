"""The packed report row (fedddp.report.ReportLayout) and the round-vs-loop bench's code path."""

import os
import subprocess
import sys

import pytest
import torch

from fedddp.report import ALIGN, ALWAYS_PACKED, SCALAR_FIELDS, VECTOR_FIELDS, ReportLayout
from fedrun import REPO

ALL_VECTORS = frozenset({"params_KP"} | {stack for stack, _ in VECTOR_FIELDS})
ALL_SCALARS = frozenset({stack for stack, _ in SCALAR_FIELDS} | {"eff_rank_KL"})


@pytest.mark.parametrize("numel", [1, 7, 16, 33, 21840])
@pytest.mark.parametrize("needs", [frozenset({"params_KP"}) | ALWAYS_PACKED, ALL_VECTORS | ALL_SCALARS,
                                   frozenset({"params_KP", "full_grad_KP", "control_delta_KP"}) | ALWAYS_PACKED])
def test_vector_fields_and_rows_start_on_16_floats(needs, numel):
    """Every [K, P] stack's rows start on 64 bytes, so the Triton server kernels take their
    aligned (4-float vector) loads: rows whose P is not a multiple of 16 used to put every field
    after params_KP, and every row after the first, off alignment."""
    layout = ReportLayout(needs, numel, num_layers=3)
    assert layout.width % ALIGN == 0
    vectors = [sl for stack, sl in layout.slices.items() if stack.endswith("_KP")]
    assert len(vectors) == len(needs & ALL_VECTORS)
    assert all(sl.start % ALIGN == 0 and sl.stop - sl.start == numel for sl in vectors)
    taken = sorted((sl.start, sl.stop) for sl in layout.slices.values())
    assert all(a[1] <= b[0] for a, b in zip(taken, taken[1:])) and taken[-1][1] <= layout.width
    rows_KF = torch.empty(5, layout.width)
    stacks = layout.unpack(rows_KF)
    triton_kernels = pytest.importorskip("fedddp.strategies.triton_kernels")
    assert triton_kernels._aligned(*(stacks[s] for s in needs & ALL_VECTORS))


def test_scalars_pack_as_the_per_field_casts_did():
    """One host-to-device copy per client packs the scalars and eff_rank_L: each value (a Python
    float, a float32 or float64 tensor) lands as its float32 cast, as the per-field copies did."""
    needs = ALL_VECTORS | ALL_SCALARS
    layout = ReportLayout(needs, 10, num_layers=3)
    report = {"num_samples": torch.tensor(123.0), "train_loss": torch.tensor(0.1, dtype=torch.float64),
              "train_time": 1 / 3, "num_steps": torch.tensor(4.0), "full_loss": torch.tensor(2 / 3, dtype=torch.float64),
              "eff_rank_L": torch.tensor([1.1, 2.2, 3.3], dtype=torch.float64)}
    row_F = torch.full((layout.width,), float("nan"))
    layout.pack_scalars(row_F, report)
    stacks = layout.unpack(row_F[None])
    for stack in ALL_SCALARS:
        expected = torch.as_tensor(report[layout.keys[stack]], dtype=torch.float32).reshape(-1)
        got = stacks[stack][0].reshape(-1)
        assert torch.equal(got, expected), stack


@pytest.mark.processes
def test_round_vs_loop_bench_runs():
    """bench/round_vs_loop.py --quick (a tiny generated stand-in): both code paths run and the
    ratio line is printed; no figure is asserted."""
    proc = subprocess.run([sys.executable, "bench/round_vs_loop.py", "--quick"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generated stand-in" in proc.stdout and "ratio" in proc.stdout
