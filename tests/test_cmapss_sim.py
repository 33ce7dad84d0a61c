"""fedddp.data.cmapss_sim: a simulated turbofan set in NASA's CMAPSS format, the regression task of
the reduced seed-004 reproduction. Deterministic, read by the CMAPSS loader, degrading towards
failure."""

import numpy as np
import torch

from fedddp import checks, config
from fedddp.data import build, cmapss_sim


def test_same_arguments_write_the_same_bytes(tmp_path):
    """Guards the reduced sweep's data: a regenerated set must be the one its runs trained on."""
    first, second = tmp_path / "a", tmp_path / "b"
    cmapss_sim.write(str(first), 6, 4, seed=3)
    cmapss_sim.write(str(second), 6, 4, seed=3)
    for name in ("train_FD001.txt", "test_FD001.txt", "RUL_FD001.txt"):
        assert (first / "CMAPSS" / name).read_bytes() == (second / "CMAPSS" / name).read_bytes()
    cmapss_sim.write(str(second), 6, 4, seed=4)
    assert (first / "CMAPSS" / "train_FD001.txt").read_bytes() != (second / "CMAPSS" / "train_FD001.txt").read_bytes()


def test_loader_reads_it_and_the_sensors_track_the_health(tmp_path):
    cmapss_sim.write(str(tmp_path), 6, 4, seed=0)
    cfg = checks.load(None, ["data.name=cmapss", f"data.root={tmp_path}", "data.num_clients=3",
                             "model.name=ffnn", "run.clients_per_round=2"])
    data = build(cfg, 0, [0, 1, 2])
    assert data.task == "regression" and data.input_shape == (14,) and len(data.test.y) > 0
    assert len((tmp_path / "CMAPSS" / "RUL_FD001.txt").read_text().split()) == 4
    lives = [n for n in data.num_samples]  # two engines per client, each 128-362 cycles
    assert all(2 * cmapss_sim.LIFE_MIN <= n <= 2 * cmapss_sim.LIFE_MAX for n in lives)
    x_NF = torch.cat([data.train[k].x for k in range(3)]).numpy()
    y_N = torch.cat([data.train[k].y for k in range(3)]).numpy().ravel()
    assert 0 <= y_N.min() and y_N.max() < 1
    # a learnable task: a linear fit of the health from the 14 sensors explains most of its variance
    # (0.74 on these 6 engines; pure noise would explain about 14 / rows, under 0.01)
    design_NF1 = np.c_[x_NF, np.ones(len(x_NF))]
    residual_N = y_N - design_NF1 @ np.linalg.lstsq(design_NF1, y_N, rcond=None)[0]
    assert 1 - residual_N.var() / y_N.var() > 0.5
