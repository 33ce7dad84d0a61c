"""FedAdam (fedddp/strategies/fedadam.py) against its slow twin: a plain loop over coordinates in
float64, written from Reddi et al. 2021, Algorithm 2, sharing no code with the rule."""

from __future__ import annotations

import math

import pytest
import torch

import fedddp
from fedddp import checks
from fedddp.config import AlgorithmConfig
from fedddp.errors import ConfigError
from fedddp.strategies import SERVER_RULES
from fedrun import QUICKSTART

PARAMS = {"eta": 0.05, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}


def twin(global_P, params_KP, num_samples_K, m_P, v_P, p):
    """One round: delta = sum_k n_k/n (w_k - w), then Adam's moments and step, coordinate by coordinate."""
    total = sum(num_samples_K)
    new_w, new_m, new_v = [], [], []
    for j in range(len(global_P)):
        delta = sum(n / total * (row[j] - global_P[j]) for row, n in zip(params_KP, num_samples_K))
        m = p["beta1"] * m_P[j] + (1 - p["beta1"]) * delta
        v = p["beta2"] * v_P[j] + (1 - p["beta2"]) * delta * delta
        new_w.append(global_P[j] + p["eta"] * m / (math.sqrt(v) + p["tau"]))
        new_m.append(m)
        new_v.append(v)
    return new_w, new_m, new_v


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fedadam_matches_its_twin_over_rounds(seed):
    gen = torch.Generator().manual_seed(seed)
    num_clients, num_params = 5, 37
    rule = SERVER_RULES["fedadam"]
    hp = AlgorithmConfig(name="fedadam", weighting="samples", params=dict(PARAMS))
    global_P = torch.randn(num_params, generator=gen)
    state = rule.init_state(global_P, hp)
    w, m, v = global_P.double().tolist(), [0.0] * num_params, [0.0] * num_params
    for _ in range(4):  # the state carries the moments from round to round
        params_KP = global_P + 0.1 * torch.randn(num_clients, num_params, generator=gen)
        num_samples_K = torch.randint(5, 50, (num_clients,), generator=gen).float()
        stacks = {"params_KP": params_KP, "num_samples_K": num_samples_K, "train_loss_K": torch.zeros(num_clients)}
        global_P, state, diagnostics = rule.aggregate(global_P, stacks, state, hp)
        w, m, v = twin(w, params_KP.double().tolist(), num_samples_K.tolist(), m, v, PARAMS)
        twin_P = torch.tensor(w, dtype=torch.float64)
        assert (global_P.double() - twin_P).abs().max() <= 1e-5 * twin_P.abs().max()
        assert torch.allclose(state["m_P"].double(), torch.tensor(m, dtype=torch.float64), atol=1e-6)
        assert torch.allclose(state["v_P"].double(), torch.tensor(v, dtype=torch.float64), atol=1e-8)
        assert diagnostics["update_norm"].item() > 0


def test_fedadam_params_are_its_own_and_checked():
    cfg = checks.load(None, ["algorithm.name=fedadam", "algorithm.params.eta=0.1"])
    assert cfg.algorithm.params == {"eta": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}
    with pytest.raises(ConfigError, match=r"algorithm.params.beta2: must be in \[0, 1\), got 1.0"):
        checks.load(None, ["algorithm.name=fedadam", "algorithm.params.beta2=1.0"])
    with pytest.raises(ConfigError, match="algorithm.server_lr: the fedadam server rule"):
        checks.load(None, ["algorithm.name=fedadam", "algorithm.server_lr=0.5"])


@pytest.mark.e2e
def test_fedadam_runs_end_to_end_and_its_state_is_checkpointed(tmp_path):
    overrides = ["algorithm.name=fedadam", "run.rounds=4", "run.ckpt_every=2", "run.eval_every=4",
                 "run.progress=false"]
    whole = fedddp.run(QUICKSTART, overrides, out_dir=tmp_path / "whole")
    fedddp.run(QUICKSTART, overrides + ["run.stop_after=2"], out_dir=tmp_path / "parts")
    resumed = fedddp.run(QUICKSTART, overrides + ["run.resume=true"], out_dir=tmp_path / "parts")
    assert whole.metrics[-1]["test_accuracy"] is not None
    for key in whole.state_dict:
        assert torch.equal(whole.state_dict[key], resumed.state_dict[key]), key
