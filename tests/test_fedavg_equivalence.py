"""FedAvg with one full-batch gradient step per client is one centralised gradient step on the
union of the clients' data (weights by sample count make the mean of means the global mean)."""

import dataclasses
import pytest
import torch
import torch.nn.functional as F

from fedddp import checks, config
from fedddp.comm import Comm
from fedddp.data import build as build_data
from fedddp.env import ProcessEnv
from fedddp.flat import FlatLayout
from fedddp.algorithms import build_model
from fedddp.round import run

SINGLE = ProcessEnv(0, 1, 0, "127.0.0.1", 0, "single")


@pytest.mark.e2e
def test_one_full_batch_step_equals_centralised_step(tmp_path):
    lr = 0.5
    cfg = checks.load(None, ["data.num_clients=8", "run.clients_per_round=8", "run.rounds=1",
                             "train.batch_size=0", "train.local_steps=1", f"train.lr={lr}",
                             "model.name=mlp", "model.hidden=16", f"run.out_dir={tmp_path}",
                             "run.progress=false"])
    result = run(cfg, Comm(SINGLE, "cpu"))

    data = build_data(cfg, cfg.data.seed, list(range(8)))
    x = torch.cat([data.train[k].x for k in range(8)])
    y = torch.cat([data.train[k].y for k in range(8)])
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg, data.input_shape, data.num_classes)
    layout = FlatLayout(model)
    start_P = layout.flatten(model).clone()
    F.cross_entropy(model(x), y).backward()
    expected_P = start_P - lr * layout.flatten_grads(model)

    assert not torch.equal(result["global_P"], start_P)
    torch.testing.assert_close(result["global_P"], expected_P, rtol=1e-5, atol=1e-6)
    # and the uniform weighting is really different (the test can tell them apart)
    cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, weighting="uniform"),
                              run=dataclasses.replace(cfg.run, out_dir=str(tmp_path / "u")))
    uniform = run(cfg, Comm(SINGLE, "cpu"))["global_P"]
    assert (uniform - expected_P).abs().max() > 1e-4
