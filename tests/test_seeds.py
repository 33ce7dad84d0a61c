"""data.seed fixes the data (partition, holdout split, synthetic samples, colours); run.seed fixes
training (initialisation, sampling, shuffling). Checked through the round loop itself, so a run
that hands the wrong seed to the data is caught."""

import numpy as np
import pytest
import torch

from fedddp import checks, config, prepare as prepare_mod, round as round_mod
from fedddp.comm import Comm
from fedddp.env import ProcessEnv

from fedrun import QUICKSTART, make_mnist_like


def run_recording_data(tmp_path, monkeypatch, overrides):
    """One in-process run; returns (what build_data made, the final global vector)."""
    made = []
    real_build = prepare_mod.build_data

    def recording_build(cfg, seed, owned):
        data = real_build(cfg, seed, owned)
        made.append(data)
        return data

    monkeypatch.setattr(prepare_mod, "build_data", recording_build)
    cfg = checks.load(QUICKSTART, ["run.rounds=2", "run.progress=false", "run.ckpt_every=0",
                                   f"run.out_dir={tmp_path / '_'.join(overrides)}"] + overrides)
    result = round_mod.run(cfg, Comm(ProcessEnv(0, 1, 0, "127.0.0.1", 29500, "single"), "cpu"))
    return made[0], result["global_P"]


def same_data(a, b) -> bool:
    return (a.num_samples == b.num_samples and torch.equal(a.test.x, b.test.x)
            and all(torch.equal(a.train[k].x, b.train[k].x) for k in a.train))


@pytest.mark.e2e
def test_run_seed_keeps_the_data_and_data_seed_changes_it(tmp_path, monkeypatch):
    """Guards against run.seed reseeding the data: the spread over run seeds would then mix data
    variation with training variation."""
    base, model_0 = run_recording_data(tmp_path, monkeypatch, ["run.seed=0"])
    other_run, model_1 = run_recording_data(tmp_path, monkeypatch, ["run.seed=1"])
    other_data, _ = run_recording_data(tmp_path, monkeypatch, ["data.seed=1"])
    assert same_data(base, other_run)  # same synthetic clients for every run seed
    assert not torch.equal(model_0, model_1)  # but the run seed still changes training
    assert base.num_samples != other_data.num_samples  # another data seed draws other clients


@pytest.mark.parametrize("partition", ["dirichlet", "iid"])
@pytest.mark.e2e
def test_partition_and_holdout_follow_data_seed_only(tmp_path, monkeypatch, partition):
    make_mnist_like(str(tmp_path / "data"), num=300)
    common = ["data.name=mnist", f"data.root={tmp_path / 'data'}", "data.holdout_from_test=0.2",
              f"data.partition={partition}", "data.num_clients=6", "run.clients_per_round=3",
              "run.rounds=1", "model.name=logistic"]
    a, _ = run_recording_data(tmp_path, monkeypatch, common + ["run.seed=0"])
    b, _ = run_recording_data(tmp_path, monkeypatch, common + ["run.seed=7"])
    c, _ = run_recording_data(tmp_path, monkeypatch, common + ["run.seed=0", "data.seed=7"])
    assert same_data(a, b)
    assert not torch.equal(a.test.x, c.test.x)  # another holdout split
    assert any(not np.array_equal(a.train[k].y.numpy(), c.train[k].y.numpy()) or
               a.num_samples[k] != c.num_samples[k] for k in a.train)  # and another partition


def test_data_seed_must_be_non_negative():
    with pytest.raises(config.ConfigError, match="data.seed: must be >= 0"):
        checks.load(None, ["data.seed=-1"])
