"""bench/peers/pfl_cifar10.py at tiny shapes (--smoke), so the peer benchmark cannot rot: fedddp's
side always, pfl's where the optional extra (pip install -e ".[peers]") is installed. No
figure is asserted."""

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join("bench", "peers", "pfl_cifar10.py")


def _smoke(*extra):
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", *extra], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_fedddp_side_runs_both_workloads():
    out = _smoke("--frameworks", "fedddp")
    assert "synthetic CIFAR10-shaped arrays" in out and "synthetic FEMNIST-shaped arrays" in out
    assert out.count("| 1 | fedddp B=1 |") == 2  # one row per workload
    assert "failed" not in out


def test_a_failing_parallel_width_is_one_line():
    """Whatever B > 1 does with the model's Dropout (it crashed in vmap before random ops were
    supported side by side), the run goes on and B = 1's row is there; no traceback."""
    out = _smoke("--frameworks", "fedddp", "--workloads", "cifar10", "--parallel-clients", "1,2")
    assert "| 1 | fedddp B=1 |" in out and "fedddp B=2" in out
    assert "Traceback" not in out


@pytest.mark.skipif(importlib.util.find_spec("pfl") is None, reason="pfl (the peers extra) is not installed")
def test_both_frameworks_alternate_with_a_paired_ratio():
    out = _smoke("--workloads", "cifar10")
    assert "| 1 | fedddp B=1 |" in out and "| 1 | pfl |" in out
    assert "paired ratio pfl / fedddp B=1" in out
