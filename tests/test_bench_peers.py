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


@pytest.mark.processes
@pytest.mark.e2e
def test_fedddp_side_runs_both_workloads():
    out = _smoke("--frameworks", "fedddp")
    assert "synthetic CIFAR10-shaped arrays" in out and "synthetic FEMNIST-shaped arrays" in out
    assert out.count("| 1 | fedddp B=1 |") == 2  # one row per workload
    assert out.count("time before round 1, median: fedddp B=1 ") == 2
    assert "failed" not in out


@pytest.mark.processes
@pytest.mark.e2e
def test_the_dropout_model_runs_side_by_side():
    """pfl's simple_cnn has Dropout, which crashed side by side (vmap's randomness error) before
    masks were drawn per client and step: B = 2 now has its row beside B = 1's."""
    out = _smoke("--frameworks", "fedddp", "--workloads", "cifar10", "--parallel-clients", "1,2")
    assert "| 1 | fedddp B=1 |" in out and "| 1 | fedddp B=2 |" in out
    assert "failed" not in out and "Traceback" not in out


@pytest.mark.skipif(importlib.util.find_spec("pfl") is None, reason="pfl (the peers extra) is not installed")
@pytest.mark.processes
@pytest.mark.e2e
def test_both_frameworks_alternate_with_a_paired_ratio():
    out = _smoke("--workloads", "cifar10")
    assert "| 1 | fedddp B=1 |" in out and "| 1 | pfl |" in out
    assert "paired ratio pfl / fedddp B=1" in out


def test_real_file_readers(tmp_path):
    """The real-data paths (CIFAR10 python batches, LEAF JSON), on tiny files of their formats."""
    import json
    import pickle

    import numpy as np

    sys.path.insert(0, REPO)
    from bench.peers import workloads

    rng = np.random.default_rng(0)
    cifar = tmp_path / "cifar-10-batches-py"
    cifar.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        blob = {b"data": rng.integers(0, 256, (8, 3072), dtype=np.uint8), b"labels": list(rng.integers(0, 10, 8))}
        (cifar / name).write_bytes(pickle.dumps(blob))
    mapping, source = workloads.cifar10_arrays(str(tmp_path), 4, 10, 5, seed=0)
    assert source.startswith("real CIFAR10")
    assert mapping["x_train"].shape == (40, 32, 32, 3) and mapping["x_test"].shape == (5, 32, 32, 3)
    assert abs(float(mapping["x_train"].mean())) < 0.5 and list(np.bincount(mapping["client_train"])) == [10] * 4

    for split, counts in (("train", [3, 4, 2]), ("test", [1, 1, 1])):
        folder = tmp_path / "FEMNIST" / split
        folder.mkdir(parents=True)
        users = ["w0", "w1", "w2"]
        blob = {"users": users, "num_samples": counts,
                "user_data": {u: {"x": rng.random((n, 784)).tolist(), "y": rng.integers(0, 62, n).tolist()}
                              for u, n in zip(users, counts)}}
        (folder / "all_data_0.json").write_text(json.dumps(blob))
    mapping, source = workloads.femnist_arrays(str(tmp_path), 2, 50, 350, 100, seed=0)
    assert source.startswith("real FEMNIST")
    assert mapping["x_train"].shape == (7, 1, 28, 28) and mapping["x_test"].shape == (2, 1, 28, 28)
    assert list(np.bincount(mapping["client_train"])) == [3, 4]
