"""FedYogi and FedAdagrad (fedddp/strategies/fedyogi.py, FedAdam's step with another second
moment) against their slow twin, a plain loop over coordinates in float64 written from Reddi et
al. 2021, Algorithm 2; against Flower's FedYogi, FedAdagrad and FedAdam (Flower's own classes
where flwr is installed, and always a transcription of their aggregate_fit kept here, so that a
machine without flwr still checks the formulas); their parameters; and a run through the round
loop, gathered and sharded. Their range form: tests/test_sharded.py. Legend: K clients, P flat
parameters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedddp import checks
from fedddp.config import AlgorithmConfig
from fedddp.errors import ConfigError
from fedddp.strategies import SERVER_RULES, kernels
from fedrun import assert_same_state, final_state, metrics, run_here

ROUNDS = 4


def twin(rule, global_P, params_KP, num_samples_K, m_P, v_P, p):
    """One round of Algorithm 2, coordinate by coordinate: delta = sum_k n_k/n (w_k - w), m, then
    v as the rule's optimizer has it (Adam, Yogi or Adagrad), then the step."""
    weights = [n / sum(num_samples_K) for n in num_samples_K]
    new_w, new_m, new_v = [], [], []
    for j, (w, m, v) in enumerate(zip(global_P, m_P, v_P)):
        delta = sum(q * (row[j] - w) for q, row in zip(weights, params_KP))
        sq = delta * delta
        if rule == "fedyogi":
            v -= (1 - p["beta2"]) * sq * ((v > sq) - (v < sq))
        elif rule == "fedadagrad":
            v += sq
        else:
            v = p["beta2"] * v + (1 - p["beta2"]) * sq
        new_m.append(p["beta1"] * m + (1 - p["beta1"]) * delta)
        new_w.append(w + p["eta"] * new_m[-1] / (math.sqrt(v) + p["tau"]))
        new_v.append(v)
    return new_w, new_m, new_v


def rounds_of_reports(seed, num_clients=5, num_params=37):
    """The initial model and ROUNDS rounds of (params_KP, num_samples_K): clients near the model,
    with larger moves in later rounds so that Yogi's sign(v - delta^2) takes both signs."""
    gen = torch.Generator().manual_seed(seed)
    global_P = torch.randn(num_params, generator=gen)
    reports = [(0.02 * (1 + 3 * (r % 2)) * torch.randn(num_clients, num_params, generator=gen),
                torch.randint(5, 50, (num_clients,), generator=gen).float()) for r in range(ROUNDS)]
    return global_P, reports


def run_rule(name, global_P, reports, params, form="torch"):
    """The rule over the rounds (each round's reports are moves from the current model): the
    models after each round, and the last state."""
    rule = SERVER_RULES[name]
    hp = AlgorithmConfig(name=name, weighting="samples", params=dict(params))
    state, models = rule.init_state(global_P, hp), []
    with kernels.forced(form):
        for moves_KP, num_samples_K in reports:
            stacks = {"params_KP": global_P + moves_KP, "num_samples_K": num_samples_K,
                      "train_loss_K": torch.zeros(len(num_samples_K))}
            global_P, state, diagnostics = rule.aggregate(global_P, stacks, state, hp)
            assert diagnostics["update_norm"].item() > 0
            models.append(global_P)
    return models, state


PARAMS = {"fedyogi": {"eta": 0.05, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3},
          "fedadagrad": {"eta": 0.05, "beta1": 0.9, "tau": 1e-3}}


@pytest.mark.parametrize("form", ["c", "torch"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", ["fedyogi", "fedadagrad"])
def test_rule_matches_its_twin_over_rounds(name, seed, form):
    if form == "c" and kernels.lib(torch.zeros(1)) is None:
        pytest.skip("no working C compiler")
    global_P, reports = rounds_of_reports(seed)
    models, state = run_rule(name, global_P, reports, PARAMS[name], form)
    num_params = len(global_P)
    w, m, v = global_P.double().tolist(), [0.0] * num_params, [0.0] * num_params
    for (moves_KP, num_samples_K), model_P in zip(reports, models):
        # the twin takes the reports as the rule saw them: float32 w + moves
        params_KP = (torch.tensor(w, dtype=torch.float32) + moves_KP).double().tolist()
        w, m, v = twin(name, torch.tensor(w, dtype=torch.float32).double().tolist(), params_KP,
                       num_samples_K.tolist(), m, v, PARAMS[name])
        twin_P = torch.tensor(w, dtype=torch.float64)
        assert (model_P.double() - twin_P).abs().max() <= 1e-5 * twin_P.abs().max()
        w = model_P.double().tolist()      # the next round starts from the rule's float32 model
    assert torch.allclose(state["m_P"].double(), torch.tensor(m, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(state["v_P"].double(), torch.tensor(v, dtype=torch.float64), rtol=1e-4, atol=1e-9)


def test_yogi_second_moment_moves_both_ways():
    """Yogi's v rises toward delta^2 where it is below and falls where it is above, by (1 - beta2)
    delta^2 (Adam's would decay by beta2 v); Adagrad's only rises."""
    from fedddp.strategies.fedyogi import adagrad_v, yogi_v
    v_P, delta_P, p = torch.tensor([0.0, 1.0, 4.0]), torch.tensor([1.0, 1.0, 1.0]), {"beta2": 0.9}
    assert torch.allclose(yogi_v(v_P, delta_P, p), torch.tensor([0.1, 1.0, 3.9]))
    assert torch.equal(adagrad_v(v_P, delta_P, p), torch.tensor([1.0, 2.0, 5.0]))


# -- Flower ---------------------------------------------------------------------------------------
# Transcribed from flwr.server.strategy (flwr 1.42): FedOpt's subclasses' aggregate_fit. delta is
# Flower's FedAvg aggregate minus the current weights; m and v start at 0; FedAdam alone divides eta
# by bias corrections, with t = server_round + 1 (its round 1 is Adam's step 2).

def flower_transcription(kind, initial, eta, beta_1, beta_2, tau):
    current, m_t, v_t = [initial.astype(np.float64)], None, None

    def aggregate_fit(server_round, results):
        nonlocal current, m_t, v_t
        total = sum(n for _, n in results)
        fedavg = [sum(w[0] * (n / total) for w, n in results)]
        delta_t = [x - y for x, y in zip(fedavg, current)]
        m_t = [np.zeros_like(x) for x in delta_t] if m_t is None else m_t
        m_t = [np.multiply(beta_1, x) + (1 - beta_1) * y for x, y in zip(m_t, delta_t)]
        v_t = [np.zeros_like(x) for x in delta_t] if v_t is None else v_t
        if kind == "fedyogi":
            v_t = [x - (1.0 - beta_2) * np.multiply(y, y) * np.sign(x - np.multiply(y, y))
                   for x, y in zip(v_t, delta_t)]
        elif kind == "fedadagrad":
            v_t = [x + np.multiply(y, y) for x, y in zip(v_t, delta_t)]
        else:
            v_t = [beta_2 * x + (1 - beta_2) * np.multiply(y, y) for x, y in zip(v_t, delta_t)]
        step = eta
        if kind == "fedadam":
            step = eta * np.sqrt(1 - np.power(beta_2, server_round + 1.0)) / (1 - np.power(beta_1, server_round + 1.0))
        current = [x + step * y / (np.sqrt(z) + tau) for x, y, z in zip(current, m_t, v_t)]
        return current[0]
    return aggregate_fit


def flower_real(kind, initial, eta, beta_1, beta_2, tau):
    """Flower's own strategy object, fed FitRes reports as its server would."""
    flwr = pytest.importorskip("flwr")
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    cls = {"fedyogi": flwr.server.strategy.FedYogi, "fedadagrad": flwr.server.strategy.FedAdagrad,
           "fedadam": flwr.server.strategy.FedAdam}[kind]
    settings = {"eta": eta, "tau": tau} | ({} if kind == "fedadagrad" else {"beta_1": beta_1, "beta_2": beta_2})
    strategy = cls(initial_parameters=ndarrays_to_parameters([initial.astype(np.float64)]), **settings)

    def aggregate_fit(server_round, results):
        fit = [(None, FitRes(status=Status(code=Code.OK, message=""), metrics={}, num_examples=n,
                             parameters=ndarrays_to_parameters([w[0].copy()]))) for w, n in results]
        parameters, _ = strategy.aggregate_fit(server_round, fit, [])
        return parameters_to_ndarrays(parameters)[0]
    return aggregate_fit


FLOWER = {"transcription": flower_transcription, "flwr": flower_real}


@pytest.mark.parametrize("source", sorted(FLOWER))
@pytest.mark.parametrize("kind", ["fedyogi", "fedadagrad", "fedadam"])
def test_rule_agrees_with_flower(kind, source):
    """FedYogi and FedAdagrad are Flower's to rounding (fedddp sums delta as sum_k p_k (w_k - w),
    Flower as the mean minus w), with Flower's own settings; Flower's FedAdagrad has beta_1 = 0.
    FedAdam is Flower's with eta times Flower's bias correction sqrt(1 - beta2^(t+1)) /
    (1 - beta1^(t+1)) in round t (docs/algorithms.md)."""
    settings = {"eta": 0.05, "beta1": 0.0 if kind == "fedadagrad" else 0.9, "beta2": 0.99, "tau": 1e-3}
    global_P, reports = rounds_of_reports(seed=5)
    flower = FLOWER[source](kind, global_P.numpy(), settings["eta"], settings["beta1"], settings["beta2"],
                            settings["tau"])
    rule = SERVER_RULES[kind]
    state = None
    for server_round, (moves_KP, num_samples_K) in enumerate(reports, start=1):
        params_KP = global_P + moves_KP
        eta = settings["eta"]
        if kind == "fedadam":
            t = server_round + 1
            eta *= math.sqrt(1 - settings["beta2"] ** t) / (1 - settings["beta1"] ** t)
        hp = AlgorithmConfig(name=kind, weighting="samples",
                             params={k: v for k, v in (settings | {"eta": eta}).items() if k in rule.params})
        state = rule.init_state(global_P, hp) if state is None else state
        stacks = {"params_KP": params_KP, "num_samples_K": num_samples_K, "train_loss_K": torch.zeros(len(moves_KP))}
        global_P, state, _ = rule.aggregate(global_P, stacks, state, hp)
        # Flower gets the same float32 reports, as float64 arrays, and keeps its own model
        want = flower(server_round, [([row.double().numpy()], int(n)) for row, n in zip(params_KP, num_samples_K)])
        np.testing.assert_allclose(global_P.double().numpy(), want, rtol=2e-6, atol=2e-6)


# -- parameters and runs --------------------------------------------------------------------------

def test_params_are_their_own_and_checked():
    assert checks.load(None, ["algorithm.name=fedyogi"]).algorithm.params == PARAMS["fedyogi"] | {"eta": 1e-2}
    assert checks.load(None, ["algorithm.name=fedadagrad", "algorithm.params.beta1=0.0"]).algorithm.params == \
        {"eta": 1e-2, "beta1": 0.0, "tau": 1e-3}
    with pytest.raises(ConfigError, match=r"algorithm.params.beta2: not a parameter of the fedadagrad server rule"):
        checks.load(None, ["algorithm.name=fedadagrad", "algorithm.params.beta2=0.9"])
    with pytest.raises(ConfigError, match=r"algorithm.params.beta2: must be in \[0, 1\), got 1.0"):
        checks.load(None, ["algorithm.name=fedyogi", "algorithm.params.beta2=1.0"])
    with pytest.raises(ConfigError, match=r"algorithm.params.tau: must be > 0"):
        checks.load(None, ["algorithm.name=fedadagrad", "algorithm.params.tau=0.0"])


def run_gathered_and_sharded(tmp_path, overrides):
    """Two rounds on the quickstart through the round loop, gathered and sharded (one rank, blocks
    of 64 columns): the sharded server must end on the gathered run's bits. Returns the folders."""
    base = overrides + ["run.rounds=2", "run.eval_every=2", "run.ckpt_every=0", "run.aggregation_block=64"]
    for mode in ("gather", "sharded"):
        run_here(base + [f"run.aggregation={mode}", f"run.out_dir={tmp_path / mode}"])
    assert_same_state(final_state(tmp_path / "gather"), final_state(tmp_path / "sharded"))
    return tmp_path / "gather", tmp_path / "sharded"


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["fedyogi", "fedadagrad"])
def test_runs_two_rounds_gathered_and_sharded_alike(tmp_path, name):
    gather, _ = run_gathered_and_sharded(tmp_path, [f"algorithm.name={name}"])
    rows = metrics(gather)
    assert rows[-1]["test_accuracy"] is not None and rows[-1]["update_norm"] > 0
