"""The robust server rules, FedMedian and FedTrimmedAvg (fedddp/strategies/coordinatewise.py),
Krum, Multi-Krum and Bulyan (fedddp/strategies/krum.py): against their slow twins, plain loops
written from the papers' definitions (Yin et al. 2018, Blanchard et al. 2017, El Mhamdi et al.
2018) in float64; against Flower (flwr.server.strategy.aggregate's own functions where flwr is
installed, and always a transcription of them kept here, so that a machine without flwr still
checks the formulas); their neutral settings (uniform FedAvg, or FedAvg with the run's weights,
bit for bit); Byzantine reports left out; their parameters; and a run through the round loop,
gathered and sharded. Their range form on 1-4 simulated ranks: tests/test_sharded.py.
Legend: K clients, P flat parameters."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from fedddp import checks
from fedddp.config import AlgorithmConfig
from fedddp.errors import ConfigError
from fedddp.strategies import SERVER_RULES, kernels
from fedrun import client_rows, metrics
from test_fedyogi import run_gathered_and_sharded

NUM_PARAMS = 37


@pytest.fixture(params=["c", "torch"])
def form(request):
    """Each rule in both forms of its means: the fused C kernel and the torch ops."""
    if request.param == "c" and kernels.lib(torch.zeros(1)) is None:
        pytest.skip("no working C compiler")
    with kernels.forced(request.param):
        yield request.param


def inputs(num_clients, seed, num_params=NUM_PARAMS):
    g = torch.Generator().manual_seed(seed)
    global_P = torch.randn(num_params, generator=g)
    stacks = {"params_KP": global_P + 0.1 * torch.randn(num_clients, num_params, generator=g),
              "num_samples_K": torch.randint(1, 100, (num_clients,), generator=g).float(),
              "train_loss_K": torch.rand(num_clients, generator=g), "aggregation_block": torch.tensor(16)}
    return global_P, stacks


def aggregate(name, global_P, stacks, weighting="uniform", **params):
    rule = SERVER_RULES[name]
    hp = AlgorithmConfig(name=name, weighting=weighting, params=rule.params | params)
    return rule.aggregate(global_P, stacks, rule.init_state(global_P, hp), hp)


def assert_close(new_P, twin_P):
    torch.testing.assert_close(new_P.double(), torch.tensor(twin_P, dtype=torch.float64), rtol=1e-6, atol=1e-6)


# -- slow twins, from the papers -----------------------------------------------------------------

def columns(rows):
    return [[row[j] for row in rows] for j in range(len(rows[0]))]


def twin_median(rows):
    """Yin et al., Def. 1: each coordinate's median (K even: the mean of the middle two)."""
    return [statistics.median(col) for col in columns(rows)]


def twin_trimmed(rows, beta):
    """Yin et al., Def. 2: each coordinate's mean once the beta K largest and smallest are out."""
    b = math.floor(beta * len(rows) + 1e-9)
    return [sum(sorted(col)[b:len(col) - b]) / (len(col) - 2 * b) for col in columns(rows)]


def twin_scores(rows, f):
    """Blanchard et al., sec. 4: score(i) = sum of ||V_i - V_j||^2 over the n - f - 2 closest j != i
    (at least one, as Flower)."""
    n = len(rows)
    dist = [[sum((a - b) ** 2 for a, b in zip(rows[i], rows[j])) for j in range(n)] for i in range(n)]
    closest = min(max(1, n - f - 2), n - 1)
    return [sum(sorted(dist[i][j] for j in range(n) if j != i)[:closest]) for i in range(n)]


def twin_krum(rows, weights, f, m):
    """Multi-Krum: the m lowest scores (ties: lower index), averaged with the weights over them."""
    scores = twin_scores(rows, f)
    chosen = sorted(sorted(range(len(rows)), key=lambda i: (scores[i], i))[:m])
    total = sum(weights[i] for i in chosen)
    return [sum(weights[i] * rows[i][j] for i in chosen) / total for j in range(len(rows[0]))], chosen


def twin_bulyan(rows, f):
    """El Mhamdi et al., sec. 3: theta = n - 2f rows, each Krum's choice among those left; then per
    coordinate the mean of the beta = theta - 2f values closest to the median."""
    left, chosen = list(range(len(rows))), []
    for _ in range(len(rows) - 2 * f):
        scores = twin_scores([rows[i] for i in left], f)
        chosen.append(left.pop(min(range(len(left)), key=lambda i: (scores[i], i))))
    beta, out = len(chosen) - 2 * f, []
    for col in columns([rows[i] for i in sorted(chosen)]):
        med = statistics.median(col)
        closest = sorted(range(len(col)), key=lambda i: (abs(col[i] - med), i))[:beta]
        out.append(sum(col[i] for i in closest) / beta)
    return out, sorted(chosen)


def twin_weights(stacks, weighting):
    n = stacks["num_samples_K"].tolist()
    return [1.0] * len(n) if weighting == "uniform" else n


@pytest.mark.parametrize("num_clients", [1, 2, 5, 8, 9])
def test_median_and_trimmed_mean_match_their_twins(form, num_clients):
    global_P, stacks = inputs(num_clients, seed=num_clients)
    rows = stacks["params_KP"].double().tolist()
    assert_close(aggregate("fedmedian", global_P, stacks)[0], twin_median(rows))
    for beta in (0.0, 0.1, 0.2, 0.25, 0.45):
        assert_close(aggregate("fedtrimmedavg", global_P, stacks, trim_beta=beta)[0], twin_trimmed(rows, beta))


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
@pytest.mark.parametrize("num_clients,f,m", [(1, 1, 1), (2, 0, 1), (6, 1, 1), (9, 2, 1), (9, 1, 4), (10, 3, 2),
                                             (7, 0, 7)])
def test_krum_matches_its_twin(form, num_clients, f, m, weighting):
    global_P, stacks = inputs(num_clients, seed=10 * num_clients + f)
    new_P, _, diagnostics = aggregate("krum", global_P, stacks, weighting, byzantine_f=f, krum_m=m)
    rows = stacks["params_KP"].double().tolist()
    twin_P, chosen = twin_krum(rows, twin_weights(stacks, weighting), f, m)
    assert_close(new_P, twin_P)
    assert torch.nonzero(diagnostics["krum_selected_K"])[:, 0].tolist() == chosen
    torch.testing.assert_close(diagnostics["krum_score_K"], torch.tensor(twin_scores(rows, f), dtype=torch.float64),
                               rtol=1e-9, atol=0)
    if m == 1:   # Krum: the chosen client's model itself
        assert torch.equal(new_P, stacks["params_KP"][chosen[0]])


@pytest.mark.parametrize("num_clients,f", [(7, 1), (8, 1), (11, 2), (12, 2), (9, 0), (3, 0)])
def test_bulyan_matches_its_twin(form, num_clients, f):
    global_P, stacks = inputs(num_clients, seed=100 + num_clients)
    new_P, _, diagnostics = aggregate("bulyan", global_P, stacks, byzantine_f=f)
    twin_P, chosen = twin_bulyan(stacks["params_KP"].double().tolist(), f)
    assert_close(new_P, twin_P)
    assert torch.nonzero(diagnostics["bulyan_selected_K"])[:, 0].tolist() == chosen
    assert diagnostics["bulyan_f"].item() == f


def test_bulyan_with_too_few_reports_takes_the_largest_f_that_fits():
    """K >= 4f + 3 (Flower raises otherwise): 6 reports with f = 1 run with f = 0, the mean."""
    global_P, stacks = inputs(6, seed=3)
    new_P, _, diagnostics = aggregate("bulyan", global_P, stacks, byzantine_f=1)
    assert diagnostics["bulyan_f"].item() == 0
    assert torch.equal(new_P, aggregate("bulyan", global_P, stacks, byzantine_f=0)[0])
    _, _, diagnostics = aggregate("bulyan", *inputs(11, seed=3), byzantine_f=5)
    assert diagnostics["bulyan_f"].item() == 2


# -- neutral settings ------------------------------------------------------------------------------

@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_neutral_settings_are_fedavg_bit_for_bit(form, weighting):
    """trim_beta = 0 and Bulyan's f = 0 keep every client: uniform FedAvg; Multi-Krum with m = K
    keeps every client: FedAvg with the run's weights."""
    global_P, stacks = inputs(9, seed=4, num_params=1000)
    fedavg = {w: aggregate("fedavg", global_P, stacks, w)[0] for w in ("uniform", weighting)}
    assert torch.equal(aggregate("krum", global_P, stacks, weighting, krum_m=9)[0], fedavg[weighting])
    assert torch.equal(aggregate("krum", global_P, stacks, weighting, krum_m=50)[0], fedavg[weighting])
    assert torch.equal(aggregate("fedtrimmedavg", global_P, stacks, weighting, trim_beta=0.0)[0], fedavg["uniform"])
    assert torch.equal(aggregate("fedtrimmedavg", global_P, stacks, weighting, trim_beta=0.1)[0], fedavg["uniform"])
    assert torch.equal(aggregate("bulyan", global_P, stacks, weighting, byzantine_f=0)[0], fedavg["uniform"])


@pytest.mark.parametrize("attack", ["large", "nan", "inf"])
def test_byzantine_reports_are_left_out(form, attack):
    """Two of 11 clients report garbage: every robust rule's model stays within the honest
    clients' range, coordinate by coordinate (f = 2: Bulyan needs 11 reports)."""
    global_P, stacks = inputs(11, seed=6)
    honest_KP = stacks["params_KP"][2:].clone()
    stacks["params_KP"][:2] = {"large": 1e6, "nan": math.nan, "inf": math.inf}[attack]
    for name, params in [("fedmedian", {}), ("fedtrimmedavg", {"trim_beta": 0.2}), ("krum", {"byzantine_f": 2}),
                         ("krum", {"byzantine_f": 2, "krum_m": 5}), ("bulyan", {"byzantine_f": 2})]:
        if attack == "nan" and name.startswith("fed"):
            continue    # torch.sort puts NaN above everything: both on one side, trimmed only at beta K >= 2
        new_P = aggregate(name, global_P, stacks, **params)[0]
        assert torch.isfinite(new_P).all(), name
        assert ((new_P >= honest_KP.min(0).values) & (new_P <= honest_KP.max(0).values)).all(), name


# -- Flower -------------------------------------------------------------------------------------
# Transcribed from flwr.server.strategy.aggregate (flwr 1.42), for one layer: aggregate_median,
# _trim_mean, aggregate_krum with _compute_distances, aggregate_bulyan with
# _aggregate_n_closest_weights. A report is (weights, num_examples).

def t_aggregate(results):
    total = sum(n for _, n in results)
    return sum(w * n for w, n in results) / total


def t_median(results):
    return np.median(np.asarray([w for w, _ in results]), axis=0)


def t_trimmed_avg(results, proportiontocut):
    array = np.asarray([w for w, _ in results])
    lowercut = int(proportiontocut * array.shape[0])
    uppercut = array.shape[0] - lowercut
    return np.mean(np.partition(array, (lowercut, uppercut - 1), 0)[lowercut:uppercut], axis=0)


def t_krum(results, num_malicious, to_keep):
    weights = [w for w, _ in results]
    distance_matrix = np.array([[np.linalg.norm(a - b) ** 2 for b in weights] for a in weights])
    num_closest = max(1, len(weights) - num_malicious - 2)
    scores = [np.sum(d[np.argsort(d)[1:num_closest + 1]]) for d in distance_matrix]
    if to_keep > 0:
        return t_aggregate([results[i] for i in np.argsort(scores)[::-1][len(scores) - to_keep:]])
    return weights[np.argmin(scores)]


def t_bulyan(results, num_malicious):
    results, selected = list(results), []
    if len(results) < 4 * num_malicious + 3:
        raise ValueError("Bulyan needs 4 * num_malicious + 3 clients")
    theta = len(results) - 2 * num_malicious
    beta = theta - 2 * num_malicious
    for _ in range(theta):
        best = t_krum(results, num_malicious, 0)
        selected.append(results.pop(next(i for i, (w, _) in enumerate(results) if np.array_equal(w, best))))
    stacked = np.array([w for w, _ in selected])
    indices = np.argpartition(np.abs(t_median(selected) - stacked), kth=beta - 1, axis=0)
    return np.mean(np.take_along_axis(stacked, indices=indices, axis=0)[:beta], axis=0)


def flower_functions(source):
    if source == "transcription":
        return t_median, t_trimmed_avg, t_krum, t_bulyan
    pytest.importorskip("flwr")
    from flwr.server.strategy import aggregate as fa

    def layer(fn):   # Flower's functions take and return lists of layers
        return lambda results, *args: fn([([w], n) for w, n in results], *args)[0]
    return (layer(fa.aggregate_median), layer(fa.aggregate_trimmed_avg), layer(fa.aggregate_krum),
            layer(lambda results, f: fa.aggregate_bulyan(results, f, fa.aggregate_krum, to_keep=0)))


@pytest.mark.parametrize("source", ["transcription", "flwr"])
@pytest.mark.parametrize("num_clients", [8, 11])
def test_rules_agree_with_flower(form, source, num_clients):
    """Flower's functions on the same float32 reports: the median bit for bit (numpy's mean of
    the middle two), the others to rounding (Flower sums in another order). Multi-Krum with
    weighting = samples is Flower's (its mean of the kept clients weighs by num_examples);
    to_keep = 0 is Krum (m = 1); Bulyan with Flower's Krum as its first rule."""
    median, trimmed_avg, krum, bulyan = flower_functions(source)
    global_P, stacks = inputs(num_clients, seed=20 + num_clients)
    results = [(row.numpy().copy(), int(n)) for row, n in zip(stacks["params_KP"], stacks["num_samples_K"])]
    assert np.array_equal(aggregate("fedmedian", global_P, stacks)[0].numpy(), median(results))
    for beta in (0.1, 0.2, 0.3):
        np.testing.assert_allclose(aggregate("fedtrimmedavg", global_P, stacks, trim_beta=beta)[0].numpy(),
                                   trimmed_avg(results, beta), rtol=1e-6, atol=1e-6)
    for f, m in [(0, 1), (1, 1), (2, 1), (1, 3), (2, 5)]:
        np.testing.assert_allclose(aggregate("krum", global_P, stacks, "samples", byzantine_f=f, krum_m=m)[0].numpy(),
                                   krum(results, f, 0 if m == 1 else m), rtol=1e-6, atol=1e-6)
    for f in range(0, (num_clients - 3) // 4 + 1):
        np.testing.assert_allclose(aggregate("bulyan", global_P, stacks, byzantine_f=f)[0].numpy(),
                                   bulyan(results, f), rtol=1e-6, atol=1e-6)


# -- parameters and runs --------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    (["algorithm.name=fedtrimmedavg", "algorithm.params.trim_beta=0.5"], r"trim_beta: must be in \[0, 0.5\), got 0.5"),
    (["algorithm.name=krum", "algorithm.params.krum_m=0"], r"krum_m: must be > 0, got 0"),
    (["algorithm.name=krum", "algorithm.params.byzantine_f=1.5"], r"byzantine_f: krum takes a int"),
    (["algorithm.name=bulyan", "algorithm.params.byzantine_f=-1"], r"byzantine_f: must be >= 0, got -1"),
    (["algorithm.name=bulyan", "algorithm.params.krum_m=2"], r"krum_m: not a parameter of the bulyan server rule"),
    (["algorithm.name=fedmedian", "algorithm.server_lr=0.5"], r"algorithm.server_lr: the fedmedian server rule"),
])
def test_params_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        checks.load(None, overrides)


def test_params_default_to_their_own():
    assert checks.load(None, ["algorithm.name=krum"]).algorithm.params == {"byzantine_f": 1, "krum_m": 1}
    assert checks.load(None, ["algorithm.name=bulyan"]).algorithm.params == {"byzantine_f": 1}
    assert checks.load(None, ["algorithm.name=fedtrimmedavg"]).algorithm.params == {"trim_beta": 0.2}
    assert checks.load(None, ["algorithm.name=fedmedian"]).algorithm.weighting == "uniform"


CLIENT_DIAGNOSTIC = {"krum": "krum_selected", "bulyan": "bulyan_selected"}


@pytest.mark.e2e
@pytest.mark.parametrize("name,extra", [("fedmedian", []), ("fedtrimmedavg", []), ("krum", []),
                                        ("krum", ["algorithm.params.krum_m=4"]),
                                        ("bulyan", ["algorithm.params.byzantine_f=1"])])
def test_runs_two_rounds_gathered_and_sharded_alike(tmp_path, name, extra):
    """Two rounds on the quickstart (10 clients a round); sharded, the distances are summed per
    block of 64 columns and the run ends on the gathered run's bits."""
    gather, sharded = run_gathered_and_sharded(tmp_path, [f"algorithm.name={name}", *extra])
    assert metrics(gather)[-1]["test_accuracy"] is not None
    if name in CLIENT_DIAGNOSTIC:
        last = [row for row in client_rows(sharded) if row["round"] == 2]
        chosen = sum(row[CLIENT_DIAGNOSTIC[name]] for row in last)
        assert chosen == {"krum": 4 if extra else 1, "bulyan": 8}[name] and len(last) == 10
