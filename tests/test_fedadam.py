"""FedAdam (fedddp/strategies/fedadam.py) against its slow twin: a plain loop over coordinates in
float64, written from Reddi et al. 2021, Algorithm 2, sharing no code with the rule; and its
pseudo-gradient's rounding where clients leave coordinates (nearly) where they were, in every
CPU form (test_triton_kernels.py runs the same checks through the Triton form)."""

from __future__ import annotations

import math

import pytest
import torch

import fedddp
from fedddp import checks
from fedddp.config import AlgorithmConfig
from fedddp.errors import ConfigError
from fedddp.strategies import SERVER_RULES, Span, kernels
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


# -- the pseudo-gradient's rounding -----------------------------------------------------------------
# delta = sum_k p_k (w_k - w) is 0 where every client returned w; formed as (sum_k p_k w_k) - w it
# was the mean's rounding, about eps |w|, which Adam divides by sqrt(v) + tau ~ tau in the first
# round: steps up to 0.19 at eta 1, tau 1e-7, in about half the coordinates (these inputs).

ROUNDING_CASES = [(0.01, 1e-3), (0.1, 1e-5), (1.0, 1e-7)]      # (eta, tau): the defaults, then less damping


def rounding_inputs(moving: bool, num_clients: int = 7, num_params: int = 1000):
    """|w| uniform in 0.5..2 (either sign), every client returning w; ``moving``: client 2 moves
    each coordinate by r |w|, |r| log-uniform in 1e-7..1e-4 (either sign)."""
    g = torch.Generator().manual_seed(1 + moving)

    def signed(magnitude_P):
        return torch.where(torch.rand(num_params, generator=g) < 0.5, -magnitude_P, magnitude_P)

    global_P = signed(0.5 + 1.5 * torch.rand(num_params, generator=g))
    params_KP = global_P.expand(num_clients, num_params).clone()
    if moving:
        params_KP[2] = global_P + signed(10 ** (-7 + 3 * torch.rand(num_params, generator=g))) * global_P.abs()
    num_samples_K = torch.randint(1, 100, (num_clients,), generator=g).float()
    return global_P, {"params_KP": params_KP, "num_samples_K": num_samples_K, "train_loss_K": torch.zeros(num_clients)}


def check_rounding(aggregate, eta, tau):
    """aggregate(global_P, stacks, state, hp) -> the rule's result, from a fresh state. (1) Every
    client returns w: w comes back bit for bit. (2) One client moves w a little: m (= (1 - beta1)
    delta) and the step match the float64 twin; the step is compared where the float32 model
    resolves it (|step| > 1e4 eps |w|; none at the defaults, where m carries the check)."""
    hp = AlgorithmConfig(name="fedadam", weighting="samples", params=PARAMS | {"eta": eta, "tau": tau})
    global_P, stacks = rounding_inputs(moving=False)
    new_P, state, _ = aggregate(global_P, stacks, SERVER_RULES["fedadam"].init_state(global_P, hp), hp)
    assert torch.equal(new_P, global_P), f"{(new_P != global_P).float().mean():.1%} of the coordinates moved"
    assert not state["m_P"].any() and not state["v_P"].any()

    global_P, stacks = rounding_inputs(moving=True)
    new_P, state, _ = aggregate(global_P, stacks, SERVER_RULES["fedadam"].init_state(global_P, hp), hp)
    num_params = len(global_P)
    w, m, _ = twin(global_P.double().tolist(), stacks["params_KP"].double().tolist(),
                   stacks["num_samples_K"].tolist(), [0.0] * num_params, [0.0] * num_params, hp.params)
    m_P, step_P = torch.tensor(m, dtype=torch.float64), torch.tensor(w, dtype=torch.float64) - global_P.double()
    m_err = ((state["m_P"].double() - m_P) / m_P).abs()
    assert m_err.max() < 1e-5, f"m: relative error median {m_err.median():.3g}, max {m_err.max():.3g}"
    resolved = step_P.abs() > 1e4 * torch.finfo(torch.float32).eps * global_P.abs().double()
    if resolved.any():
        err = (((new_P.double() - global_P.double()) - step_P) / step_P).abs()[resolved]
        assert err.median() < 1e-3 and err.max() < 1e-2, \
            f"step: relative error median {err.median():.3g}, max {err.max():.3g}"


@pytest.mark.parametrize("eta,tau", ROUNDING_CASES)
@pytest.mark.parametrize("shape", ["gathered", "range"])
@pytest.mark.parametrize("form", ["c", "torch"])
def test_unmoved_coordinates_stay_and_small_moves_match_the_twin(form, shape, eta, tau):
    if form == "c" and kernels.lib(torch.zeros(1)) is None:
        pytest.skip("no working C compiler")
    rule = SERVER_RULES["fedadam"]

    def aggregate(global_P, stacks, state, hp):
        with kernels.forced(form):
            if shape == "gathered":
                return rule.aggregate(global_P, stacks, state, hp)
            # the sharded server's range form: the whole vector here, in blocks of 64 columns
            span = Span(0, len(global_P), len(global_P), 64, global_P.device)
            return rule.aggregate_span(global_P, stacks, state, hp, span)

    check_rounding(aggregate, eta, tau)


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
