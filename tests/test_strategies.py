"""Server rules of the papers: each fused rule against a slow twin written from the paper.

The twins are plain Python loops over clients and coordinates in float64, sharing no code with
fedddp.strategies (they only call the fused rule to compare). Neutral settings must give
FedAvg's vector bit for bit (torch.equal), except FedER, which has no sample weights and is
compared to uniform FedAvg at float32 tolerance.
Legend: K sampled clients, P flat parameters, L conv layers.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fedddp import strategies
from fedddp.client import rules
from fedddp.config import AlgorithmConfig
from fedddp.flat import runs_R3
from fedddp.strategies import kernels
from fedddp.strategies import fedcong as fedcong_module
from fedddp.strategies import fedgma as fedgma_module

NUM_LAYERS = 4
# (K, P): the register-chunk C kernels work in chunks of 4-16 columns (the vector width) and
# prefetch blocks of 256; 13 and 50 leave a tail chunk, 600 spans three blocks
SIZES = [(1, 50), (3, 50), (8, 50), (8, 13), (5, 600)]
SEEDS = [0, 1, 2]


# -- inputs -----------------------------------------------------------------------------------

def make_inputs(num_clients, num_params, seed, discrete=False):
    """Random global vector and client reports. discrete=True draws updates from {-1, 0, 1}
    steps, so zero updates and tied sign counts are common."""
    g = torch.Generator().manual_seed(seed)
    global_P = torch.randn(num_params, generator=g)
    if discrete:
        steps_KP = torch.randint(-1, 2, (num_clients, num_params), generator=g).float()
        params_KP = global_P + 0.25 * steps_KP
    else:
        params_KP = global_P + 0.1 * torch.randn(num_clients, num_params, generator=g)
    last_grad_KP = torch.randn(num_clients, num_params, generator=g)
    if discrete:
        signs_KP = torch.randint(-1, 2, (num_clients, num_params), generator=g).float()
        last_grad_KP = signs_KP * last_grad_KP.abs()
    # groups: a few elements before the first conv, parameters in order, then buffers again.
    half = num_params // 2
    head = min(3, num_params)
    num_param_elems, num_buffer_elems = max(half - head, 0), num_params - max(half, head)
    params_groups = torch.sort(torch.randint(0, NUM_LAYERS, (num_param_elems,), generator=g)).values
    buffer_groups = torch.sort(torch.randint(-1, NUM_LAYERS, (num_buffer_elems,), generator=g)).values
    conv_group_P = torch.cat([torch.full((head,), -1), params_groups, buffer_groups]).long()
    eff_rank_KL = 3.0 * torch.rand(num_clients, NUM_LAYERS, generator=g)
    eff_rank_KL[torch.rand(num_clients, NUM_LAYERS, generator=g) < 0.2] = 0.0   # clamped to 1e-3
    stacks = {
        "params_KP": params_KP,
        "num_samples_K": torch.randint(1, 100, (num_clients,), generator=g).float(),
        "train_loss_K": torch.rand(num_clients, generator=g),
        "last_grad_KP": last_grad_KP,
        "full_grad_KP": 0.5 * torch.randn(num_clients, num_params, generator=g),
        "full_loss_K": 0.5 + torch.rand(num_clients, generator=g),
        "eff_rank_KL": eff_rank_KL,
        "conv_group_P": conv_group_P,    # for the twin
        "conv_runs_R3": runs_R3(conv_group_P),
    }
    return global_P, stacks


GATHERED = ["params_KP", "last_grad_KP", "full_grad_KP"]


def as_gather_views(stacks):
    """The [K, P] stacks as column slices of one [K, F] buffer (row stride F > P), the way
    round.py hands them to the rules."""
    num_clients, num_params = stacks["params_KP"].shape
    buffer_KF = torch.cat([stacks[f] for f in GATHERED] + [torch.zeros(num_clients, 3)], dim=1)
    views = dict(stacks)
    for i, f in enumerate(GATHERED):
        views[f] = buffer_KF[:, num_params * i:num_params * (i + 1)]
    return views


@pytest.fixture(autouse=True, params=["c", "torch"])
def rule_form(request, monkeypatch):
    """Every test runs each rule in both forms: the fused C kernels (CPU) and the torch ops
    (the CUDA form, and the CPU fallback without a C compiler)."""
    monkeypatch.setenv("FEDDDP_KERNELS", request.param)
    if request.param == "c" and kernels.lib(torch.zeros(1)) is None:
        pytest.skip("no working C compiler")
    return request.param


def hp_of(**kwargs):
    """An AlgorithmConfig with every built-in rule's own parameters at their defaults in params,
    those given (cong_alpha=0.5) replacing them, the other keywords (server_lr=) as its fields."""
    fields = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    defaults = {k: v for rule in [*strategies.SERVER_RULES.values(), *rules.RULES.values()]
                for k, v in rule.params.items()}
    given = {k: v for k, v in kwargs.items() if k not in fields}
    assert set(given) <= set(defaults), f"not a built-in rule's parameter: {set(given) - set(defaults)}"
    return AlgorithmConfig(**{k: v for k, v in kwargs.items() if k in fields}, params={**defaults, **given})


def run(name, global_P, stacks, hp, state=None):
    strategy = strategies.get(name)
    if state is None:
        state = strategy.init_state(global_P, hp)
    return strategy.aggregate(global_P.clone(), stacks, state, hp)


def fedavg_of(global_P, stacks, hp):
    """FedAvg's new model with hp's weights, at server_lr 1 whatever hp's (FedGMA's neutral
    eta_s = 0 is FedAvg's full step)."""
    return run("fedavg", global_P, stacks, dataclasses.replace(hp, server_lr=1.0))[0]


def as_lists(global_P, stacks):
    rows = stacks["params_KP"].double().tolist()
    return global_P.double().tolist(), rows


def twin_weights(stacks, weighting):
    n = stacks["num_samples_K"].double().tolist()
    if weighting == "uniform":
        n = [1.0] * len(n)
    total = sum(n)
    return [nk / total for nk in n]


def sign(value):
    return (value > 0) - (value < 0)


def assert_close(fused_P, twin_P, rtol=1e-5, atol=1e-6):
    assert torch.isfinite(fused_P).all()
    twin = torch.tensor(twin_P, dtype=torch.float64)
    torch.testing.assert_close(fused_P.double(), twin, rtol=rtol, atol=atol)


# -- slow twins, from the papers' equations ---------------------------------------------------

def twin_fedavg(global_P, stacks, weighting, server_lr=1.0):
    """McMahan et al. 2017, with FedOpt's server SGD step: w + eta (sum_k p_k w_k - w)."""
    w, rows = as_lists(global_P, stacks)
    p = twin_weights(stacks, weighting)
    return [w[j] + server_lr * (sum(p[k] * rows[k][j] for k in range(len(rows))) - w[j])
            for j in range(len(w))]


def twin_fedmom(global_P, stacks, velocity, momentum, weighting, server_lr=1.0):
    """Seed 004 eqs. 5-6: alpha = sum_k n_k/n (w_k - w); v <- delta v + alpha; w <- w + eta v
    (eta = 1 in the paper; Flower's FedAvgM: w <- w - eta (momentum buffer))."""
    w, rows = as_lists(global_P, stacks)
    p = twin_weights(stacks, weighting)
    new_w, new_v = [], []
    for j in range(len(w)):
        delta = 0.0
        for k in range(len(rows)):
            delta += p[k] * (rows[k][j] - w[j])
        v = momentum * velocity[j] + delta
        new_v.append(v)
        new_w.append(w[j] + server_lr * v)
    return new_w, new_v


def twin_fedcong(global_P, stacks, alpha, weighting):
    """Seed 004 eq. 3 with ALGORITHMS.md's choices: both qualify -> larger count, ties positive;
    an empty group never qualifies; p_k renormalised within the chosen group."""
    w, rows = as_lists(global_P, stacks)
    p = twin_weights(stacks, weighting)
    K = len(rows)
    out, chosen = [], []
    for j in range(len(w)):
        positive = [k for k in range(K) if rows[k][j] - w[j] > 0]
        negative = [k for k in range(K) if rows[k][j] - w[j] < 0]
        pos_ok = len(positive) > 0 and len(positive) >= alpha * K - 1e-9
        neg_ok = len(negative) > 0 and len(negative) >= alpha * K - 1e-9
        if pos_ok and (not neg_ok or len(positive) >= len(negative)):
            group, tag = positive, 1
        elif neg_ok:
            group, tag = negative, -1
        else:
            group, tag = list(range(K)), 0
        total = sum(p[k] for k in group)
        out.append(sum(p[k] * rows[k][j] for k in group) / total)
        chosen.append(tag)
    return out, chosen


def twin_fedgma(global_P, stacks, threshold, server_lr, grad_mode, mask_mode, weighting):
    """Seed 001 Alg. 1 + AND-mask: mask_j = 1{p K <= |sum_k sign(g_kj)|}; w = avg - eta grad."""
    w, rows = as_lists(global_P, stacks)
    p = twin_weights(stacks, weighting)
    K = len(rows)
    if grad_mode == "last":
        grads = stacks["last_grad_KP"].double().tolist()
    else:
        # the client computes w - w_k in float32 (the pseudo-gradient it would send)
        grads = (global_P[None, :] - stacks["params_KP"]).double().tolist()
    out, masks = [], []
    for j in range(len(w)):
        agreement = abs(sum(sign(grads[k][j]) for k in range(K)))
        if agreement >= threshold * K - 1e-9:
            mask = 1.0
        else:
            mask = 0.0 if mask_mode == "hard" else agreement / K
        grad = sum(p[k] * grads[k][j] * mask for k in range(K))
        avg = sum(p[k] * rows[k][j] for k in range(K))
        out.append(avg - server_lr * grad)
        masks.append(mask)
    return out, masks


def twin_cgw(global_P, stacks, alpha, weighting):
    """Seed 000 eqs. 6, 13, 29, 8 with zero-gradient clients left out."""
    w, rows = as_lists(global_P, stacks)
    p = twin_weights(stacks, weighting)
    D = stacks["full_grad_KP"].double().tolist()
    losses = stacks["full_loss_K"].double().tolist()
    K, P = len(rows), len(w)
    norms = [math.sqrt(sum(D[k][j] ** 2 for j in range(P))) for k in range(K)]
    live = [k for k in range(K) if norms[k] > 0]
    D_sum = [sum(D[k][j] for k in range(K)) for j in range(P)]
    m = [sum(D[k][j] * D_sum[j] for j in range(P)) for k in range(K)]
    x = [0.0] * K
    c = 0.0
    if live:
        c = min(alpha * losses[k] / norms[k] for k in live)
        spread = math.sqrt(sum((m[k] / norms[k]) ** 2 for k in live))
        if spread > 0:
            for k in live:
                x[k] = c / spread * m[k] / norms[k] ** 2
    out = [sum(p[k] * rows[k][j] for k in range(K)) - sum(x[k] * D[k][j] for k in range(K))
           for j in range(P)]
    return out, x, c, norms, m


def twin_feder(global_P, stacks):
    """Seed 003 Alg. 4: alpha_l^k = max(1e-3, er_l^k) / sum_k; non-conv elements use the previous
    conv layer's alpha, elements before the first conv layer the uniform 1/K."""
    w, rows = as_lists(global_P, stacks)
    er = stacks["eff_rank_KL"].double().tolist()
    groups = stacks["conv_group_P"].tolist()
    K = len(rows)
    out = []
    for j in range(len(w)):
        layer = groups[j]
        if layer < 0:
            alpha = [1.0 / K] * K
        else:
            clamped = [max(1e-3, er[k][layer]) for k in range(K)]
            alpha = [e / sum(clamped) for e in clamped]
        out.append(sum(alpha[k] * rows[k][j] for k in range(K)))
    return out


# -- FedAvg ----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_clients,num_params", SIZES)
@pytest.mark.parametrize("weighting", ["samples", "uniform"])
@pytest.mark.parametrize("server_lr", [1.0, 0.5, 0.0, 1.7])
def test_fedavg_matches_twin(num_clients, num_params, weighting, server_lr):
    """Guards algorithm.server_lr for FedAvg's server rule (FedProx, MOON, FedSAM, FedGAM too):
    it was ignored, so a server step of 0.5 took the full step."""
    global_P, stacks = make_inputs(num_clients, num_params, num_clients)
    new_P, _, _ = run("fedavg", global_P, stacks, hp_of(weighting=weighting, server_lr=server_lr))
    assert_close(new_P, twin_fedavg(global_P, stacks, weighting, server_lr))


@pytest.mark.parametrize("num_clients,num_params", SIZES)
def test_fedavg_server_lr_one_is_the_weighted_mean_bitwise(num_clients, num_params):
    """The default server_lr keeps FedAvg's bits: the weighted mean itself, no step formed."""
    global_P, stacks = make_inputs(num_clients, num_params, 5)
    hp = hp_of(server_lr=1.0)
    mean_P = strategies.weighted_mean_P(strategies.client_weights_K(stacks, hp), stacks["params_KP"])
    assert torch.equal(run("fedavg", global_P, stacks, hp)[0], mean_P)


# -- FedMom ----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_clients,num_params", SIZES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weighting", ["samples", "uniform"])
@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_fedmom_matches_twin_over_rounds(num_clients, num_params, seed, weighting, server_lr):
    hp = hp_of(server_momentum=0.9, weighting=weighting, server_lr=server_lr)
    global_P, stacks = make_inputs(num_clients, num_params, seed)
    state = strategies.get("fedmom").init_state(global_P, hp)
    velocity = [0.0] * num_params
    for round_idx in range(3):
        _, stacks = make_inputs(num_clients, num_params, 100 * seed + round_idx)
        new_P, state, diag = run("fedmom", global_P, stacks, hp, state)
        twin_P, velocity = twin_fedmom(global_P, stacks, velocity, 0.9, weighting, server_lr)
        assert_close(new_P, twin_P)
        step = [server_lr * v for v in velocity]               # w_new - w = eta v
        assert_close(new_P - state["previous_P"], step)
        assert diag["velocity_norm"].item() == pytest.approx(math.sqrt(sum(v * v for v in step)),
                                                             rel=1e-5, abs=1e-6)
        global_P = new_P
    assert torch.isfinite(diag["velocity_norm"])


def test_fedmom_server_lr_zero_never_moves():
    """eta = 0: v accumulates but the model stays (no division by eta in the kept state)."""
    hp = hp_of(server_momentum=0.9, server_lr=0.0)
    global_P, _ = make_inputs(3, 50, 0)
    state = strategies.get("fedmom").init_state(global_P, hp)
    for round_idx in range(3):
        _, stacks = make_inputs(3, 50, round_idx)
        new_P, state, _ = run("fedmom", global_P, stacks, hp, state)
        assert torch.equal(new_P, global_P)


@pytest.mark.parametrize("num_clients,num_params", SIZES)
def test_fedmom_momentum_zero_is_fedavg_every_round(num_clients, num_params):
    hp = hp_of(server_momentum=0.0)
    global_P, _ = make_inputs(num_clients, num_params, 0)
    state = {"previous_P": torch.randn(num_params)}  # even after rounds run with momentum
    for round_idx in range(3):
        _, stacks = make_inputs(num_clients, num_params, round_idx + 7)
        new_P, state, _ = run("fedmom", global_P, stacks, hp, state)
        assert torch.equal(new_P, fedavg_of(global_P, stacks, hp))
        global_P = new_P


# -- FedCong ---------------------------------------------------------------------------------

@pytest.mark.parametrize("num_clients,num_params", SIZES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.3, 0.5, 0.7, 1.0])
@pytest.mark.parametrize("discrete", [False, True])
def test_fedcong_matches_twin(num_clients, num_params, seed, alpha, discrete):
    weighting = "uniform" if seed == 2 else "samples"
    hp = hp_of(cong_alpha=alpha, weighting=weighting)
    global_P, stacks = make_inputs(num_clients, num_params, seed, discrete=discrete)
    new_P, _, diag = run("fedcong", global_P, stacks, hp)
    twin_P, chosen = twin_fedcong(global_P, stacks, alpha, weighting)
    assert_close(new_P, twin_P)
    P = num_params
    assert diag["cong_positive"].item() == pytest.approx(sum(c == 1 for c in chosen) / P)
    assert diag["cong_negative"].item() == pytest.approx(sum(c == -1 for c in chosen) / P)
    assert diag["cong_all"].item() == pytest.approx(sum(c == 0 for c in chosen) / P)


def test_fedcong_tie_goes_to_positive_group():
    """alpha <= 0.5 lets both groups qualify; equal counts must take the positive group."""
    global_P = torch.zeros(1)
    stacks = {"params_KP": torch.tensor([[1.0], [3.0], [-2.0], [-4.0]]),
              "num_samples_K": torch.ones(4), "train_loss_K": torch.zeros(4)}
    new_P, _, diag = run("fedcong", global_P, stacks, hp_of(cong_alpha=0.5))
    assert new_P.item() == pytest.approx(2.0)
    assert diag["cong_positive"].item() == 1.0


# -- FedGMA ----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_clients,num_params", SIZES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("grad_mode", ["last", "delta"])
@pytest.mark.parametrize("mask_mode", ["hard", "soft"])
@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.8, 1.0])
def test_fedgma_matches_twin(num_clients, num_params, seed, grad_mode, mask_mode, threshold):
    weighting = "uniform" if seed == 2 else "samples"
    hp = hp_of(gma_threshold=threshold, server_lr=0.7, gma_grad=grad_mode, gma_mask=mask_mode,
               weighting=weighting)
    global_P, stacks = make_inputs(num_clients, num_params, seed, discrete=seed == 1)
    new_P, _, diag = run("fedgma", global_P, stacks, hp)
    twin_P, masks = twin_fedgma(global_P, stacks, threshold, 0.7, grad_mode, mask_mode, weighting)
    assert_close(new_P, twin_P)
    assert diag["mask_density"].item() == pytest.approx(sum(masks) / num_params, abs=1e-6)


@pytest.mark.parametrize("num_clients,num_params", SIZES)
@pytest.mark.parametrize("grad_mode", ["last", "delta"])
@pytest.mark.parametrize("mask_mode", ["hard", "soft"])
def test_fedgma_neutral_is_fedavg(num_clients, num_params, grad_mode, mask_mode):
    hp = hp_of(gma_threshold=0.0, server_lr=0.0, gma_grad=grad_mode, gma_mask=mask_mode)
    global_P, stacks = make_inputs(num_clients, num_params, 3)
    new_P, _, diag = run("fedgma", global_P, stacks, hp)
    assert torch.equal(new_P, fedavg_of(global_P, stacks, hp))
    assert diag["mask_density"].item() == 1.0


@pytest.mark.parametrize("num_clients", [1, 3, 8])
def test_fedgma_all_agreeing_clients_give_the_plain_weighted_gradient(num_clients):
    """With every client's gradient of the same sign per coordinate the AND-mask is all ones and
    the masked step is the plain weighted mean gradient (seed 001, sec. 3)."""
    global_P, stacks = make_inputs(num_clients, 50, 4)
    g = torch.Generator().manual_seed(5)
    direction_P = torch.where(torch.rand(50, generator=g) < 0.5, -1.0, 1.0)
    stacks["last_grad_KP"] = direction_P * (0.1 + torch.rand(num_clients, 50, generator=g))
    hp = hp_of(gma_threshold=1.0, server_lr=0.5)
    new_P, _, diag = run("fedgma", global_P, stacks, hp)
    p_K = stacks["num_samples_K"] / stacks["num_samples_K"].sum()
    expected_P = fedavg_of(global_P, stacks, hp) - 0.5 * (p_K @ stacks["last_grad_KP"])
    assert diag["mask_density"].item() == 1.0
    torch.testing.assert_close(new_P, expected_P)


# -- CGW -------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_clients,num_params", SIZES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("alpha", [0.05, 0.3])
def test_cgw_matches_twin(num_clients, num_params, seed, alpha):
    weighting = "uniform" if seed == 2 else "samples"
    hp = hp_of(cgw_alpha=alpha, weighting=weighting)
    global_P, stacks = make_inputs(num_clients, num_params, seed)
    new_P, _, diag = run("cgw", global_P, stacks, hp)
    twin_P, x, c, norms, m = twin_cgw(global_P, stacks, alpha, weighting)
    assert_close(new_P, twin_P)
    assert_close(diag["cgw_x_K"], x, rtol=1e-4, atol=1e-7)
    assert diag["cgw_c"].item() == pytest.approx(c, rel=1e-5)
    # eq. 24: the constraint is active at the optimum
    constraint = sum((xk * nk) ** 2 for xk, nk in zip(diag["cgw_x_K"].tolist(), norms))
    assert constraint == pytest.approx(c * c, rel=1e-4)
    # eq. 30: sign(x_k) = sign(m_k)
    assert [sign(xk) for xk in diag["cgw_x_K"].tolist()] == [sign(mk) for mk in m]
    assert diag["cgw_zero_grad_clients"].item() == 0


@pytest.mark.parametrize("num_clients,num_params", SIZES)
def test_cgw_alpha_zero_is_fedavg(num_clients, num_params):
    hp = hp_of(cgw_alpha=0.0)
    global_P, stacks = make_inputs(num_clients, num_params, 1)
    new_P, _, diag = run("cgw", global_P, stacks, hp)
    assert torch.equal(new_P, fedavg_of(global_P, stacks, hp))
    assert torch.equal(diag["cgw_x_K"], torch.zeros(num_clients))


def test_cgw_single_client_weight_is_c_over_norm():
    hp = hp_of(cgw_alpha=0.2)
    global_P, stacks = make_inputs(1, 50, 2)
    _, _, diag = run("cgw", global_P, stacks, hp)
    norm = stacks["full_grad_KP"][0].double().norm().item()
    c = 0.2 * stacks["full_loss_K"][0].item() / norm
    assert diag["cgw_c"].item() == pytest.approx(c, rel=1e-5)
    assert diag["cgw_x_K"][0].item() == pytest.approx(c / norm, rel=1e-5)


@pytest.mark.parametrize("num_clients", [2, 5])
def test_cgw_identical_gradients_share_weight_c_over_sqrt_k_norm(num_clients):
    hp = hp_of(cgw_alpha=0.3)
    global_P, stacks = make_inputs(num_clients, 50, 3)
    stacks["full_grad_KP"] = stacks["full_grad_KP"][:1].expand(num_clients, -1).clone()
    _, _, diag = run("cgw", global_P, stacks, hp)
    norm = stacks["full_grad_KP"][0].double().norm().item()
    c = min(0.3 * loss / norm for loss in stacks["full_loss_K"].tolist())
    expected = c / (math.sqrt(num_clients) * norm)
    expected_K = torch.full((num_clients,), expected, dtype=torch.float64)
    torch.testing.assert_close(diag["cgw_x_K"].double(), expected_K, rtol=1e-5, atol=0)


def test_cgw_zero_gradient_client_is_left_out_without_nan():
    hp = hp_of(cgw_alpha=0.3)
    global_P, stacks = make_inputs(4, 50, 4)
    stacks["full_grad_KP"][2] = 0.0
    stacks["full_loss_K"][2] = 0.0  # would make c = 0 if it were not left out
    new_P, _, diag = run("cgw", global_P, stacks, hp)
    twin_P, x, c, _, _ = twin_cgw(global_P, stacks, 0.3, "samples")
    assert torch.isfinite(new_P).all() and torch.isfinite(diag["cgw_x_K"]).all()
    assert diag["cgw_x_K"][2].item() == 0.0
    assert diag["cgw_zero_grad_clients"].item() == 1
    assert c > 0 and diag["cgw_c"].item() == pytest.approx(c, rel=1e-5)
    assert_close(new_P, twin_P)


def test_cgw_all_zero_gradients_give_fedavg_without_nan():
    hp = hp_of(cgw_alpha=0.3)
    global_P, stacks = make_inputs(3, 50, 5)
    stacks["full_grad_KP"].zero_()
    new_P, _, diag = run("cgw", global_P, stacks, hp)
    assert torch.equal(new_P, fedavg_of(global_P, stacks, hp))
    assert diag["cgw_zero_grad_clients"].item() == 3
    assert diag["cgw_c"].item() == 0.0 and torch.isfinite(diag["cgw_x_K"]).all()


def test_cgw_opposite_gradients_give_zero_correction_without_nan():
    """D_1 = -D_2: D = 0, so every m_k = 0 and eq. 29 is 0/0; the correction must be 0."""
    hp = hp_of(cgw_alpha=0.3)
    global_P, stacks = make_inputs(2, 50, 6)
    stacks["full_grad_KP"][1] = -stacks["full_grad_KP"][0]
    new_P, _, diag = run("cgw", global_P, stacks, hp)
    assert torch.isfinite(diag["cgw_x_K"]).all()
    torch.testing.assert_close(new_P, fedavg_of(global_P, stacks, hp), rtol=0, atol=1e-6)


# -- FedER -----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_clients,num_params", SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_feder_matches_twin(num_clients, num_params, seed):
    hp = hp_of()
    global_P, stacks = make_inputs(num_clients, num_params, seed)
    new_P, _, diag = run("feder", global_P, stacks, hp)
    assert_close(new_P, twin_feder(global_P, stacks))
    assert diag["feder_alpha_KL"].shape == (num_clients, NUM_LAYERS)
    torch.testing.assert_close(diag["feder_alpha_KL"].sum(0), torch.ones(NUM_LAYERS))


@pytest.mark.parametrize("seed", SEEDS)
def test_feder_matches_twin_for_any_group_order(seed):
    """FedER walks runs of equal conv_group_P: unsorted groups with runs of length 1 too."""
    global_P, stacks = make_inputs(3, 50, seed)
    g = torch.Generator().manual_seed(seed)
    stacks["conv_group_P"] = torch.randint(-1, NUM_LAYERS, (50,), generator=g)
    stacks["conv_runs_R3"] = runs_R3(stacks["conv_group_P"])
    new_P, _, _ = run("feder", global_P, stacks, hp_of())
    assert_close(new_P, twin_feder(global_P, stacks))


@pytest.mark.parametrize("num_clients,num_params", SIZES)
@pytest.mark.parametrize("rank", [0.0, 2.5])
def test_feder_equal_ranks_is_uniform_fedavg(num_clients, num_params, rank):
    """Equal ranks (rank 0: every client clamped, as in early rounds) -> the uniform mean.
    Not bitwise: FedAvg's weights 1/K and FedER's er / sum er round differently."""
    hp = hp_of(weighting="uniform")
    global_P, stacks = make_inputs(num_clients, num_params, 2)
    stacks["eff_rank_KL"] = torch.full((num_clients, NUM_LAYERS), rank)
    new_P, _, _ = run("feder", global_P, stacks, hp)
    torch.testing.assert_close(new_P, fedavg_of(global_P, stacks, hp), rtol=1e-6, atol=1e-6)


# -- all rules: block boundaries, strided stacks, devices ------------------------------------

BLOCKED = {"fedcong": (fedcong_module, hp_of(cong_alpha=0.5)),
           "fedgma": (fedgma_module, hp_of(gma_threshold=0.5, server_lr=0.3))}


@pytest.mark.parametrize("name", sorted(BLOCKED))
def test_blocked_rules_do_not_depend_on_the_block_size(name, monkeypatch, rule_form):
    if rule_form == "c":
        pytest.skip("column_block sizes the torch form's blocks only")
    module, hp = BLOCKED[name]
    global_P, stacks = make_inputs(5, 1000, 8, discrete=True)
    whole_P, _, whole_diag = run(name, global_P, stacks, hp)
    monkeypatch.setattr(module, "column_block", lambda num_rows, device: 7)  # 1000 = 142 * 7 + 6
    blocked_P, _, blocked_diag = run(name, global_P, stacks, hp)
    torch.testing.assert_close(blocked_P, whole_P, rtol=1e-6, atol=1e-7)
    for key in whole_diag:
        torch.testing.assert_close(blocked_diag[key], whole_diag[key])


RULE_HPS = {"fedmom": hp_of(server_momentum=0.9), "fedcong": hp_of(cong_alpha=0.6),
            "fedgma": hp_of(gma_threshold=0.6, server_lr=0.5), "cgw": hp_of(cgw_alpha=0.2),
            "feder": hp_of()}


@pytest.mark.parametrize("name", sorted(RULE_HPS))
def test_rules_accept_strided_views_of_the_gather_buffer(name):
    """round.py hands the rules column slices of one [K, F] gather buffer (row stride F > P)."""
    hp = RULE_HPS[name]
    global_P, stacks = make_inputs(4, 50, 9)
    strided = as_gather_views(stacks)
    assert not any(strided[f].is_contiguous() for f in GATHERED)
    expected_P, _, _ = run(name, global_P, stacks, hp)
    got_P, _, _ = run(name, global_P, strided, hp)
    torch.testing.assert_close(got_P, expected_P, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(RULE_HPS))
def test_rules_are_registered_with_their_needs(name):
    strategy = strategies.get(name)
    expected = {"fedmom": set(), "fedcong": set(), "fedgma": {"last_grad_KP"},
                "cgw": {"full_grad_KP", "full_loss_K", "aggregation_block"}, "feder": {"eff_rank_KL", "conv_runs_R3"}}[name]
    assert set(strategy.needs) == expected
    global_P, stacks = make_inputs(3, 20, 0)
    kept = {k: v for k, v in stacks.items() if k in strategies.ALWAYS | strategy.needs}
    new_P, state, diag = run(name, global_P, kept, RULE_HPS[name])
    assert new_P.shape == global_P.shape and new_P.dtype == torch.float32
    assert all(isinstance(v, torch.Tensor) for v in list(state.values()) + list(diag.values()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(RULE_HPS))
def test_rules_run_on_cuda_like_on_cpu(name):
    hp = RULE_HPS[name]
    global_P, stacks = make_inputs(8, 5000, 10)
    expected_P, _, _ = run(name, global_P, stacks, hp)
    got_P, _, _ = run(name, global_P.cuda(), {k: v.cuda() for k, v in stacks.items()}, hp)
    torch.testing.assert_close(got_P.cpu(), expected_P, rtol=1e-5, atol=1e-6)


def test_agreement_threshold_is_not_fooled_by_rounding():
    """0.28 * 25 = 7.000000000000001 in floating point: 7 agreeing clients out of 25 must meet
    a threshold of 0.28 (FedGMA's mask and FedCong's group choice)."""
    global_P = torch.zeros(1)
    column_K1 = torch.tensor([1.0] * 7 + [0.0] * 18)[:, None]
    stacks = {"params_KP": column_K1.clone(), "last_grad_KP": column_K1.clone(),
              "num_samples_K": torch.ones(25), "train_loss_K": torch.zeros(25)}
    _, _, diag = run("fedgma", global_P, stacks, hp_of(gma_threshold=0.28, server_lr=1.0))
    assert diag["mask_density"].item() == 1.0
    new_P, _, diag = run("fedcong", global_P, stacks, hp_of(cong_alpha=0.28))
    assert diag["cong_positive"].item() == 1.0 and new_P.item() == pytest.approx(1.0)
