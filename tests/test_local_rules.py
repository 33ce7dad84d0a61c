"""Client-side rules (FedProx, SCAFFOLD, FedNova, MOON, FedSAM, FedGAM, FedGAM-CV, FedSMOO), their
server rules, composition checks and the client optimizers.

1. Reductions, end to end through fedddp.round.run on the same inputs: neutral settings equal
   FedAvg bit for bit (torch.equal), except FedNova (equal step counts, rho = 0), whose
   normalisation (w - tau_eff sum p_k (w - w_k) / tau) equals FedAvg only up to float rounding.
2. Slow single-client twins: each rule's step written from the paper's equations with plain
   tensors and autograd on a hand-written MLP (no fedddp model, layout or rule code), compared
   with train_client's real step at float32 tolerance (the real step sees the batch permuted).
3. Slow twins of the server rules: loops over clients in float64.
Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fedddp import checks, config, strategies
from fedddp.registry import ALGORITHMS
from fedddp.client import ClientContext, LocalTraining, train_client
from fedddp.client import optim, rules
from fedddp.comm import Comm
from fedddp.data import ClientData
from fedddp.env import ProcessEnv
from fedddp.errors import ConfigError
from fedddp.flat import FlatLayout
from fedddp.algorithms import build_model
from fedddp.round import run
from test_strategies import hp_of

from fedrun import run_fedddp

SINGLE = ProcessEnv(0, 1, 0, "127.0.0.1", 0, "single")
BASE = ["data.num_clients=10", "run.clients_per_round=5", "model.name=mlp", "model.hidden=16",
        "train.batch_size=10", "train.lr=0.05", "run.eval_every=100", "run.progress=false"]


def final_global(tmp_path, name: str, *overrides: str, rounds: int = 3) -> torch.Tensor:
    out = tmp_path / f"{name}-{abs(hash(overrides))}-{rounds}"
    cfg = checks.load(None, BASE + [f"algorithm.name={name}", f"run.rounds={rounds}", f"run.out_dir={out}",
                                    *overrides])
    return run(cfg, Comm(SINGLE, "cpu"))["global_P"]


# -- 1. reductions ----------------------------------------------------------------------------

def weighting_of_name(name: str) -> str:
    return checks.load(None, [f"algorithm.name={name}"]).algorithm.weighting


NEUTRAL = [("fedprox", ["algorithm.prox_mu=0"]),
           ("fedsam", ["algorithm.sam_rho=0"]),
           ("fedgam", ["algorithm.gam_rho=0"]),
           ("moon", ["algorithm.moon_mu=0", "algorithm.moon_proj_dim=0"])]


@pytest.mark.parametrize("name,neutral", NEUTRAL, ids=[n for n, _ in NEUTRAL])
@pytest.mark.e2e
def test_neutral_setting_equals_fedavg_bitwise(tmp_path, name, neutral):
    # FedAvg with the algorithm's own client weights (FedSAM's and FedGAM's are uniform)
    fedavg = final_global(tmp_path, "fedavg", f"algorithm.weighting={weighting_of_name(name)}")
    assert torch.equal(final_global(tmp_path, name, *neutral), fedavg)
    # the paper's default really changes the run (the comparison can fail)
    default = final_global(tmp_path, name, *[o for o in neutral if "proj_dim" in o])
    assert (default - fedavg).abs().max() > 1e-5


@pytest.mark.e2e
def test_moon_first_round_has_no_contrastive_term(tmp_path):
    """Round 1: no client has a previous model, so mu does not matter (projection head on);
    later rounds it does."""
    one = final_global(tmp_path, "moon", "algorithm.moon_mu=0", rounds=1)
    assert torch.equal(one, final_global(tmp_path, "moon", "algorithm.moon_mu=5", rounds=1))
    three_neutral = final_global(tmp_path, "moon", "algorithm.moon_mu=0")
    assert (three_neutral - final_global(tmp_path, "moon")).abs().max() > 1e-5


@pytest.mark.parametrize("name,twin", [("scaffold", "fedavg"), ("fedgam_cv", "fedgam")])
@pytest.mark.e2e
def test_control_variates_first_round_equals_base(tmp_path, name, twin):
    uniform = "algorithm.weighting=uniform"  # SCAFFOLD's and FedGAM's own; FedAvg's is samples
    assert torch.equal(final_global(tmp_path, name, rounds=1), final_global(tmp_path, twin, uniform, rounds=1))
    assert (final_global(tmp_path, name) - final_global(tmp_path, twin, uniform)).abs().max() > 1e-5


@pytest.mark.e2e
def test_fednova_equal_steps_equals_fedavg(tmp_path):
    steps = "train.local_steps=4"
    fedavg = final_global(tmp_path, "fedavg", steps)
    nova = final_global(tmp_path, "fednova", steps)
    torch.testing.assert_close(nova, fedavg, rtol=0, atol=2e-6)
    # unequal step counts (one local epoch of clients of different sizes) are normalised
    uneven = final_global(tmp_path, "fednova")
    assert (uneven - final_global(tmp_path, "fedavg")).abs().max() > 1e-4


# -- 2. single-client twins ---------------------------------------------------------------------

D_IN, HIDDEN, CLASSES, N = 7, 6, 4, 24


def twin_shapes(proj_dim: int = 0):
    """Parameter shapes of model.name = mlp (two hidden layers), with MOON's head if proj_dim."""
    shapes = [(HIDDEN, D_IN), (HIDDEN,), (HIDDEN, HIDDEN), (HIDDEN,)]
    if proj_dim:
        shapes += [(HIDDEN, HIDDEN), (HIDDEN,), (proj_dim, HIDDEN), (proj_dim,)]
    return shapes + [(CLASSES, proj_dim or HIDDEN), (CLASSES,)]


def split(flat, shapes):
    out, offset = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(flat[offset:offset + n].view(s))
        offset += n
    return out


def twin_represent(theta, x):
    h = torch.relu(x @ theta[0].T + theta[1])
    z = torch.relu(h @ theta[2].T + theta[3])
    if len(theta) == 10:
        z = torch.relu(z @ theta[4].T + theta[5]) @ theta[6].T + theta[7]
    return z


def twin_loss(theta, x, y):
    return F.cross_entropy(twin_represent(theta, x) @ theta[-2].T + theta[-1], y)


def twin_grad(flat, x, y, shapes):
    flat = flat.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(twin_loss(split(flat, shapes), x, y), flat)
    return g


def make_client(local: str, overrides=(), steps: int = 1, proj_dim: int = 0, seed: int = 0):
    cfg = checks.load(None, ["data.name=synthetic", "model.name=mlp", f"model.hidden={HIDDEN}",
                             "train.batch_size=0", f"train.local_steps={steps}", "train.lr=0.1",
                             f"algorithm.local={local}", f"algorithm.moon_proj_dim={proj_dim}",
                             "algorithm.name=fedavg" if local not in ("scaffold", "gam_cv", "smoo")
                             else {"scaffold": "algorithm.name=scaffold", "gam_cv": "algorithm.name=fedgam_cv",
                                   "smoo": "algorithm.name=fedsmoo"}[local], *overrides])
    torch.manual_seed(seed)
    model = build_model(cfg, (D_IN,), CLASSES)
    layout = FlatLayout(model)
    g = torch.Generator().manual_seed(seed + 1)
    data = ClientData(torch.randn(N, D_IN, generator=g), torch.randint(0, CLASSES, (N,), generator=g))
    return cfg, model, layout, data, g


def run_client(cfg, model, layout, data, global_P, server_view=None, state=None):
    layout.unflatten_into(global_P, model)
    ctx = ClientContext(0, 1, global_P, layout, cfg.algorithm, server_view or {}, state if state is not None else {})
    out = {k: torch.zeros(layout.numel) for k in ("params_P", "control_delta_P", "perturb_dual_P")}
    train_client(model, ctx, data, LocalTraining.of(cfg), rules.get(cfg.algorithm.local), frozenset(), 123, out)
    return out, ctx.state


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_prox_twin():
    cfg, model, layout, data, g = make_client("prox", ["algorithm.prox_mu=0.7"], steps=2)
    shapes = twin_shapes()
    w_glob = layout.flatten(model).clone()
    out, _ = run_client(cfg, model, layout, data, w_glob)
    w = w_glob.clone()
    for _ in range(2):  # the second step is where w != w_global: the proximal term acts
        w = w - 0.1 * (twin_grad(w, data.x, data.y, shapes) + 0.7 * (w - w_glob))
    close(out["params_P"], w)
    plain = w_glob - 0.1 * twin_grad(w_glob, data.x, data.y, shapes)
    plain = plain - 0.1 * twin_grad(plain, data.x, data.y, shapes)
    assert (plain - w).abs().max() > 1e-4


@pytest.mark.parametrize("local", ["scaffold", "gam_cv"])
def test_control_variate_twins(local):
    cfg, model, layout, data, g = make_client(local, ["algorithm.gam_rho=0.3", "algorithm.gam_alpha=0.6"], steps=2)
    shapes = twin_shapes()
    w_glob = layout.flatten(model).clone()
    P = layout.numel
    c, c_k = 0.3 * torch.randn(P, generator=g), 0.3 * torch.randn(P, generator=g)
    out, state = run_client(cfg, model, layout, data, w_glob, {"control_P": c}, {"control_P": c_k.clone()})
    w = w_glob.clone()
    for _ in range(2):
        grad = twin_grad(w, data.x, data.y, shapes)
        if local == "gam_cv":  # seed 002 eq. 19, then eq. 20
            adv = twin_grad(w + 0.3 * grad / (grad.norm() + 1e-12), data.x, data.y, shapes)
            grad = grad + 0.6 * 0.3 * adv
        w = w - 0.1 * (grad - c_k + c)
    new_c_k = c_k - c + (w_glob - w) / (2 * 0.1)  # option II / eq. 21
    close(out["params_P"], w)
    close(state["control_P"], new_c_k)
    close(out["control_delta_P"], new_c_k - c_k)


def momentum_sgd_twin(w_glob, x, y, shapes, correction_P, steps, lr=0.1, momentum=0.9):
    """torch.optim.SGD with momentum on full batches, each gradient plus a fixed correction."""
    w, buf = w_glob.clone(), None
    for _ in range(steps):
        grad = twin_grad(w, x, y, shapes) + correction_P
        buf = grad if buf is None else momentum * buf + grad
        w = w - lr * buf
    return w


def test_scaffold_option_one_twin():
    """Option I with momentum SGD: the steps get c - c_k as in option II, and c_k+ is the client's
    gradient at the global model (not read off w - w_k, which momentum makes wrong)."""
    cfg, model, layout, data, g = make_client("scaffold", ["algorithm.scaffold_control=I", "train.momentum=0.9"],
                                              steps=3)
    shapes = twin_shapes()
    w_glob = layout.flatten(model).clone()
    P = layout.numel
    c, c_k = 0.3 * torch.randn(P, generator=g), 0.3 * torch.randn(P, generator=g)
    out, state = run_client(cfg, model, layout, data, w_glob, {"control_P": c}, {"control_P": c_k.clone()})
    w = momentum_sgd_twin(w_glob, data.x, data.y, shapes, c - c_k, steps=3)
    new_c_k = twin_grad(w_glob, data.x, data.y, shapes)  # option I
    close(out["params_P"], w)
    close(state["control_P"], new_c_k)
    close(out["control_delta_P"], new_c_k - c_k)
    option_two = c_k - c + (w_glob - w) / (3 * 0.1)  # what option II would have kept: far off
    assert (option_two - new_c_k).abs().max() > 1e-2


def test_scaffold_option_one_gradient_spans_every_minibatch():
    """With minibatches (24 samples in batches of 5: the last has 4), c_k+ is still the gradient
    of the mean loss over all the client's samples at the global model."""
    cfg, model, layout, data, g = make_client("scaffold", ["algorithm.scaffold_control=I", "train.batch_size=5"],
                                              steps=2)
    w_glob = layout.flatten(model).clone()
    zeros = torch.zeros(layout.numel)
    out, state = run_client(cfg, model, layout, data, w_glob, {"control_P": zeros}, {})
    close(state["control_P"], twin_grad(w_glob, data.x, data.y, twin_shapes()))


def bn_net():
    from fedddp.models import Net
    torch.manual_seed(0)
    return Net(torch.nn.Sequential(torch.nn.Linear(D_IN, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU()),
               torch.nn.Linear(6, CLASSES))


def test_scaffold_option_one_extra_pass_leaves_training_alone():
    """The extra pass at the global model (train mode, for BatchNorm's batch statistics) must
    restore the running statistics: in round 1 (c = c_k = 0) options I and II train the same
    model bit for bit, buffers included, and only c_k+ differs. With BatchNorm, c_k+ is the mean
    over consecutive batch-size chunks of their train-mode gradients (weights chunk / n), not
    the eval-mode gradient."""
    results = {}
    for option in ("I", "II"):
        model = bn_net()
        cfg = checks.load(None, ["algorithm.name=scaffold", "algorithm.local=scaffold",
                                 f"algorithm.scaffold_control={option}",
                                 "train.batch_size=6", "train.local_steps=3", "train.lr=0.1"])
        layout = FlatLayout(model)
        g = torch.Generator().manual_seed(1)
        data = ClientData(torch.randn(N, D_IN, generator=g), torch.randint(0, CLASSES, (N,), generator=g))
        w_glob = layout.flatten(model).clone()
        results[option] = run_client(cfg, model, layout, data, w_glob, {"control_P": torch.zeros(layout.numel)}, {})
    assert torch.equal(results["I"][0]["params_P"], results["II"][0]["params_P"])
    assert (results["I"][1]["control_P"] - results["II"][1]["control_P"]).abs().max() > 1e-4

    def gradient_P(train_mode: bool):
        twin = bn_net().train(train_mode)
        params = list(twin.parameters())
        parts = [torch.autograd.grad(F.cross_entropy(twin(data.x[i:i + 6]), data.y[i:i + 6]), params)
                 for i in range(0, N, 6)]  # equal chunks: the mean of chunk means is the mean
        flat = torch.cat([torch.stack(gs).mean(0).reshape(-1) for gs in zip(*parts)])
        return torch.cat([flat, torch.zeros(layout.numel - flat.numel())])  # zero on buffers

    close(results["I"][1]["control_P"], gradient_P(train_mode=True))
    assert (results["I"][1]["control_P"] - gradient_P(train_mode=False)).abs().max() > 1e-4


def test_moon_frozen_models_run_in_eval_mode():
    """MOON's frozen global and previous models are in eval mode, as in MOON's code: with
    BatchNorm their representations are the eval-mode ones (running statistics, not the batch's)
    and their forward passes leave those statistics untouched. They used to run in train mode."""
    from fedddp.models import Net
    torch.manual_seed(0)
    model = Net(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU()),
                torch.nn.Linear(6, 3))
    layout = FlatLayout(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # two models whose running statistics are their own, not the defaults
        model(2 * torch.randn(32, 4, generator=g) + 1)
        w_glob = layout.flatten(model).clone()
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
        model(torch.randn(32, 4, generator=g) - 1)
        w_prev = layout.flatten(model).clone()
    cfg = checks.load(None, ["algorithm.name=moon", "algorithm.moon_mu=1.0"])
    layout.unflatten_into(w_glob, model)
    ctx = ClientContext(0, 2, w_glob, layout, cfg.algorithm, {}, {"prev_P": w_prev.clone()})
    rule = rules.get("moon")
    rule.begin(model, ctx)
    x, y = torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)
    rule.gradient(model, x, y, ctx)
    rule.gradient(model, x, y, ctx)
    for frozen, source_P in zip(ctx.scratch["frozen"], (w_glob, w_prev)):
        assert torch.equal(layout.flatten(frozen), source_P)  # running statistics untouched
        reference = copy.deepcopy(model)
        layout.unflatten_into(source_P, reference)
        with torch.no_grad():
            assert torch.equal(rules._represent(frozen, x), reference.eval().represent(x))
            # the test can tell the modes apart: train mode gives other representations
            assert (rules._represent(frozen, x) - reference.train().represent(x)).abs().max() > 1e-3


def test_moon_twin():
    proj = 5
    cfg, model, layout, data, g = make_client("moon", ["algorithm.moon_mu=2.0", "algorithm.moon_tau=0.5"],
                                              proj_dim=proj)
    shapes = twin_shapes(proj)
    assert sum(math.prod(s) for s in shapes) == layout.numel
    w_glob = layout.flatten(model).clone()
    w_prev = w_glob + 0.3 * torch.randn(layout.numel, generator=g)
    w_start = w_glob + 0.05 * torch.randn(layout.numel, generator=g)
    model_start = w_start.clone()
    layout.unflatten_into(model_start, model)
    ctx = ClientContext(0, 2, w_glob, layout, cfg.algorithm, {}, {"prev_P": w_prev.clone()})
    out = {"params_P": torch.zeros(layout.numel)}
    train_client(model, ctx, data, LocalTraining.of(cfg), rules.get("moon"), frozenset(), 5, out)

    def loss(flat):
        theta = split(flat, shapes)
        z = twin_represent(theta, data.x)
        z_glob = twin_represent(split(w_glob, shapes), data.x)
        z_prev = twin_represent(split(w_prev, shapes), data.x)
        cos = lambda a, b: (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))  # noqa: E731
        logits = torch.stack([cos(z, z_glob), cos(z, z_prev)], 1) / 0.5
        contrastive = -torch.log_softmax(logits, 1)[:, 0].mean()
        return F.cross_entropy(z @ theta[-2].T + theta[-1], data.y) + 2.0 * contrastive

    flat = w_start.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(loss(flat), flat)
    w = w_start - 0.1 * grad
    close(out["params_P"], w)
    close(ctx.state["prev_P"], w)
    plain = w_start - 0.1 * twin_grad(w_start, data.x, data.y, shapes)
    assert (plain - w).abs().max() > 1e-4


@pytest.mark.parametrize("local", ["sam", "gam"])
def test_sam_gam_twins(local):
    cfg, model, layout, data, g = make_client(local, ["algorithm.sam_rho=0.5", "algorithm.gam_rho=0.5",
                                                      "algorithm.gam_alpha=0.7"])
    shapes = twin_shapes()
    w0 = layout.flatten(model).clone()
    out, _ = run_client(cfg, model, layout, data, w0)
    grad = twin_grad(w0, data.x, data.y, shapes)
    adv = twin_grad(w0 + 0.5 * grad / grad.norm(), data.x, data.y, shapes)
    direction = adv if local == "sam" else grad + 0.7 * 0.5 * adv  # FedSAM; FedGAM eq. 19
    close(out["params_P"], w0 - 0.1 * direction)
    assert (out["params_P"] - (w0 - 0.1 * grad)).abs().max() > 1e-4


def test_smoo_twin():
    cfg, model, layout, data, g = make_client("smoo", ["algorithm.sam_rho=0.4", "algorithm.smoo_lambda=0.3"])
    shapes = twin_shapes()
    P = layout.numel
    w_glob = layout.flatten(model).clone()
    s, mu, h = (0.2 * torch.randn(P, generator=g) for _ in range(3))
    out, state = run_client(cfg, model, layout, data, w_glob, {"perturb_P": s},
                            {"perturb_dual_P": mu.clone(), "drift_P": h.clone()})
    grad = twin_grad(w_glob, data.x, data.y, shapes)
    corrected = grad - mu - s
    e = 0.4 * corrected / (corrected.norm() + 1e-7)
    new_mu = mu + e - s
    adv = twin_grad(w_glob + e, data.x, data.y, shapes)
    w = w_glob - 0.1 * (adv + 0.3 * (w_glob - w_glob + h))
    close(out["params_P"], w)
    close(state["perturb_dual_P"], new_mu)
    close(out["perturb_dual_P"], new_mu)
    close(state["drift_P"], h + (w - w_glob))


@pytest.mark.parametrize("local", ["sam", "gam", "smoo"])
def test_extra_passes_leave_batchnorm_statistics_to_the_first_pass(local):
    """The second pass at w + e must not update BatchNorm running statistics, and must leave w
    exactly as it was (a bug here makes FedSAM with rho = 0 differ from FedAvg on BN models)."""
    from fedddp.models import Net
    torch.manual_seed(0)
    features = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU())
    model = Net(features, torch.nn.Linear(6, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    name = {"sam": "fedsam", "gam": "fedgam", "smoo": "fedsmoo"}[local]
    cfg = checks.load(None, [f"algorithm.name={name}", "algorithm.sam_rho=0.5", "algorithm.gam_rho=0.5"])
    layout = FlatLayout(model)
    twin = copy.deepcopy(model)
    params_before = [p.detach().clone() for p in model.parameters()]
    zeros = torch.zeros(layout.numel)
    ctx = ClientContext(0, 1, layout.flatten(model).clone(), layout, cfg.algorithm, {"perturb_P": zeros})
    rule = rules.get(local)
    rule.begin(model, ctx)
    rule.gradient(model, x, y, ctx)
    F.cross_entropy(twin(x), y)  # one forward at w in train mode: what the statistics must show
    for a, b in zip(model.buffers(), twin.buffers()):
        assert torch.equal(a, b)
    assert not torch.equal(model.features[1].running_mean, torch.zeros(6))
    for p, before in zip(model.parameters(), params_before):
        assert torch.equal(p, before)


# -- 3. server rules against slow twins -------------------------------------------------------

def server_inputs(K=4, P=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    global_P = torch.randn(P, generator=g)
    stacks = {"params_KP": global_P + 0.1 * torch.randn(K, P, generator=g),
              "num_samples_K": torch.randint(1, 50, (K,), generator=g).float(),
              "train_loss_K": torch.rand(K, generator=g),
              "control_delta_KP": torch.randn(K, P, generator=g),
              "perturb_dual_KP": torch.randn(K, P, generator=g),
              "num_steps_K": torch.randint(1, 30, (K,), generator=g).float(),
              "num_clients": torch.tensor(17.0),
              "client_momentum": torch.tensor(0.6),
              "param_mask_P": torch.arange(P) < P - 2}
    return global_P, stacks


def weights(stacks, uniform=False):
    n = [1.0 if uniform else float(v) for v in stacks["num_samples_K"]]
    return [v / sum(n) for v in n]


@pytest.mark.parametrize("rule,divisor", [("scaffold", "N"), ("fedgam_cv", "K")])
@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_scaffold_server_twin(rule, divisor, server_lr):
    global_P, stacks = server_inputs()
    hp = hp_of(server_lr=server_lr)
    strategy = strategies.get(rule)
    state = {"control_P": torch.randn(global_P.shape[0], generator=torch.Generator().manual_seed(9))}
    new_P, new_state, _ = strategy.aggregate(global_P, stacks, dict(state), hp)
    K, P = stacks["params_KP"].shape
    p = weights(stacks)
    count = 17.0 if divisor == "N" else K
    for j in range(P):
        w = float(global_P[j])
        expected = w + server_lr * sum(p[k] * (float(stacks["params_KP"][k, j]) - w) for k in range(K))
        c = float(state["control_P"][j]) + sum(float(stacks["control_delta_KP"][k, j]) for k in range(K)) / count
        assert math.isclose(float(new_P[j]), expected, rel_tol=1e-5, abs_tol=1e-6)
        assert math.isclose(float(new_state["control_P"][j]), c, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.6])
@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_fednova_server_twin(momentum, server_lr):
    global_P, stacks = server_inputs()
    stacks["client_momentum"] = torch.tensor(momentum)
    new_P, _, diag = strategies.get("fednova").aggregate(global_P, stacks, {},
                                                         hp_of(server_lr=server_lr))
    K, P = stacks["params_KP"].shape
    p = weights(stacks)
    a = []
    for k in range(K):
        tau = float(stacks["num_steps_K"][k])
        # a_k = sum_{i<tau} (1 - rho^(tau - i)) / (1 - rho): the momentum-SGD accumulation, by loop
        a.append(tau if momentum == 0 else sum((1 - momentum ** (tau - i)) / (1 - momentum) for i in range(int(tau))))
    tau_eff = sum(p[k] * a[k] for k in range(K))
    assert math.isclose(float(diag["tau_eff"]), tau_eff, rel_tol=1e-6)
    for j in range(P):
        w = float(global_P[j])
        d = sum(p[k] * (w - float(stacks["params_KP"][k, j])) / a[k] for k in range(K))
        assert math.isclose(float(new_P[j]), w - server_lr * tau_eff * d, rel_tol=1e-5, abs_tol=1e-6)


def test_fedsmoo_server_twin():
    global_P, stacks = server_inputs()
    hp = hp_of(sam_rho=0.3)
    P = global_P.shape[0]
    state = {"drift_sum_P": torch.randn(P, generator=torch.Generator().manual_seed(3)), "perturb_P": torch.zeros(P)}
    new_P, new_state, _ = strategies.get("fedsmoo").aggregate(global_P, stacks, dict(state), hp)
    K = stacks["params_KP"].shape[0]
    p = weights(stacks)
    mean_mu = [sum(p[k] * float(stacks["perturb_dual_KP"][k, j]) for k in range(K)) for j in range(P)]
    norm = math.sqrt(sum(m * m for m in mean_mu))
    for j in range(P):
        w = float(global_P[j])
        is_param = bool(stacks["param_mask_P"][j])
        drift = sum(float(stacks["params_KP"][k, j]) - w for k in range(K)) if is_param else 0.0
        H = float(state["drift_sum_P"][j]) + drift
        expected = sum(p[k] * float(stacks["params_KP"][k, j]) for k in range(K)) + H / 17.0
        assert math.isclose(float(new_state["drift_sum_P"][j]), H, rel_tol=1e-5, abs_tol=1e-5)
        assert math.isclose(float(new_P[j]), expected, rel_tol=1e-5, abs_tol=1e-5)
        s_j = 0.3 * mean_mu[j] / (norm + 1e-7)
        assert math.isclose(float(new_state["perturb_P"][j]), s_j, rel_tol=1e-5, abs_tol=1e-6)


# -- composition and configuration errors ------------------------------------------------------

@pytest.mark.e2e
def test_composition_runs_and_differs(tmp_path):
    """FedProx clients under FedGMA's server: the local rule really is prox (not the name's)."""
    gma = final_global(tmp_path, "fedgma", "algorithm.server_lr=0.5", rounds=2)
    prox_gma = final_global(tmp_path, "fedgma", "algorithm.server_lr=0.5", "algorithm.local=prox",
                            "algorithm.prox_mu=1.0", rounds=2)
    assert (gma - prox_gma).abs().max() > 1e-5
    checks.load(None, ["algorithm.name=feder", "algorithm.local=gam", "data.name=mnist", "model.name=cnn"])


# the algorithms whose server rule has a step for algorithm.server_lr to scale (docs/algorithms.md)
TAKE_SERVER_LR = {"fedavg", "fedprox", "moon", "fedsam", "fedgam", "dpfedavg", "dpfedmom", "fedmom", "fedgma",
                  "scaffold", "fedgam_cv", "fednova"}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_server_lr_is_taken_or_refused_never_ignored(name):
    """Guards against algorithm.server_lr silently ignored (FedMom and most rules did): a rule
    with a server step takes it (its twin checks how), one without refuses it in one line
    naming the key and the rule; 1, the default, is every rule's own."""
    overrides = [f"algorithm.name={name}", "algorithm.server_lr=0.5"]
    overrides += ["algorithm.dp_clip=1"] if name.startswith("dp") else []
    overrides += ["data.name=mnist", "model.name=cnn"] if name == "feder" else []
    server = ALGORITHMS[name][1]
    assert strategies.get(server).takes_server_lr == (name in TAKE_SERVER_LR)
    if name in TAKE_SERVER_LR:
        assert checks.load(None, overrides).algorithm.server_lr == 0.5
    else:
        with pytest.raises(ConfigError) as info:
            checks.load(None, overrides)
        message = str(info.value)
        assert "1 configuration error" in message and "algorithm.server_lr" in message
        assert f"the {server} server rule" in message and "fedmom" in message
    checks.load(None, overrides[:1] + overrides[2:] + ["algorithm.server_lr=1"])


@pytest.mark.parametrize("overrides,words", [
    (["algorithm.name=fedavg", "algorithm.local=scaffold"], ["scaffold", "fedavg", "control_P"]),
    (["algorithm.name=fedmom", "algorithm.local=gam_cv"], ["gam_cv", "fedmom"]),
    (["algorithm.name=scaffold", "algorithm.local=plain"], ["plain", "scaffold", "control_delta_KP"]),
    (["algorithm.name=fedsmoo", "algorithm.local=sam"], ["sam", "fedsmoo", "perturb_dual_KP"]),
    (["algorithm.name=fednova", "train.optimizer=adam"], ["train.optimizer", "fednova"]),
    (["algorithm.name=fednova", "algorithm.local=prox"], ["prox", "fednova"]),
    (["algorithm.name=moon", "algorithm.moon_tau=0"], ["algorithm.params.moon_tau"]),
    (["algorithm.name=moon", "algorithm.params.moon.moon_proj_dim=-1"], ["algorithm.params.moon_proj_dim"]),
    (["train.lr_schedule=steplr", "train.lr_schedule_unit=epoch", "train.local_steps=5"], ["lr_schedule_unit"]),
    (["train.optimizer=adam", "train.momentum=0.9"], ["train.momentum"]),
    (["algorithm.name=scaffold", "train.momentum=0.9"], ["algorithm.params.scaffold_control", "scaffold_control = I"]),
    (["algorithm.name=scaffold", "train.optimizer=adam"], ["algorithm.params.scaffold_control", "scaffold_control = I"]),
    (["algorithm.name=fedgam_cv", "train.momentum=0.5"], ["train.momentum", "FedGAM-CV", "eq. 21"]),
])
def test_impossible_combinations_are_config_errors(overrides, words):
    with pytest.raises(ConfigError) as info:
        checks.load(None, overrides)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.e2e
def test_scaffold_option_one_end_to_end(tmp_path):
    """Through the round loop: round 1 (c = c_k = 0) is option II's bit for bit, later rounds
    differ (the controls really are other ones), and momentum trains to a finite model."""
    one = "algorithm.scaffold_control=I"
    assert torch.equal(final_global(tmp_path, "scaffold", one, rounds=1), final_global(tmp_path, "scaffold", rounds=1))
    assert (final_global(tmp_path, "scaffold", one) - final_global(tmp_path, "scaffold")).abs().max() > 1e-5
    assert torch.isfinite(final_global(tmp_path, "scaffold", one, "train.momentum=0.9")).all()


def test_scaffold_option_one_accepts_any_optimizer():
    for overrides in (["train.momentum=0.9"], ["train.optimizer=adam"]):
        checks.load(None, ["algorithm.name=scaffold", "algorithm.scaffold_control=I", *overrides])


@pytest.mark.e2e
def test_auto_weighting_is_the_papers(tmp_path):
    """FedGAM's Alg. 1 averages uniformly: auto must give uniform's bits, not the sample-count
    weights every algorithm used to get (the synthetic clients have unequal n_k)."""
    auto = final_global(tmp_path, "fedgam", rounds=2)
    assert torch.equal(auto, final_global(tmp_path, "fedgam", "algorithm.weighting=uniform", rounds=2))
    assert (auto - final_global(tmp_path, "fedgam", "algorithm.weighting=samples", rounds=2)).abs().max() > 1e-5


@pytest.mark.processes
def test_bad_pair_exits_2_naming_both(tmp_path):
    proc = run_fedddp(["algorithm.name=fedmom", "algorithm.local=scaffold", f"run.out_dir={tmp_path}"], check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "scaffold" in proc.stderr and "fedmom" in proc.stderr


# -- optimizers and schedules -----------------------------------------------------------------

class RecordLr(rules.LocalRule):
    """Plain rule that records the mean learning rate its end hook gets."""

    def end(self, model, ctx, num_steps, lr, out):
        ctx.state["mean_lr"] = torch.tensor(lr)


def client_steps(overrides, round_idx=1, rule=None, model_name="mlp"):
    data_name = "mnist" if model_name == "cnn" else "synthetic"  # validation: a CNN needs images
    cfg = checks.load(None, [f"data.name={data_name}", f"model.name={model_name}", "model.hidden=8",
                             "train.batch_size=8", *overrides])
    torch.manual_seed(0)
    shape = (1, 28, 28) if model_name == "cnn" else (D_IN,)
    model = build_model(cfg, shape, CLASSES)
    layout = FlatLayout(model)
    g = torch.Generator().manual_seed(0)
    data = ClientData(torch.randn(N, *shape, generator=g), torch.randint(0, CLASSES, (N,), generator=g))
    w0 = layout.flatten(model).clone()
    ctx = ClientContext(0, round_idx, w0, layout, cfg.algorithm)
    out = {"params_P": torch.zeros(layout.numel)}
    train_client(model, ctx, data, LocalTraining.of(cfg), rule or rules.LocalRule(), frozenset(), 7, out)
    return out["params_P"], w0, ctx


def test_steplr_by_round_and_by_epoch():
    tc = config.TrainConfig(lr=1.0, lr_schedule="steplr", lr_step_size=2, lr_gamma=0.5, local_epochs=3)
    assert [optim.lr_at(tc, r, 0) for r in (1, 2, 3, 4, 5)] == [1.0, 1.0, 0.5, 0.5, 0.25]
    tc = dataclasses.replace(tc, lr_schedule_unit="epoch")
    assert [optim.lr_at(tc, 1, e) for e in range(6)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    # within a client's round: 3 epochs of 3 steps each (N = 24, batch 8), round 2 starts at epoch 3
    common = ["train.lr=1.0", "train.lr_schedule=steplr", "train.lr_step_size=2", "train.lr_gamma=0.5",
              "train.local_epochs=3"]
    _, _, ctx = client_steps(common + ["train.lr_schedule_unit=epoch"], round_idx=2, rule=RecordLr())
    assert math.isclose(float(ctx.state["mean_lr"]), (0.5 + 0.25 + 0.25) / 3, rel_tol=1e-6)  # epochs 3, 4, 5
    _, _, ctx = client_steps(common + ["train.lr_schedule_unit=round"], round_idx=3, rule=RecordLr())
    assert math.isclose(float(ctx.state["mean_lr"]), 0.5, rel_tol=1e-6)


@pytest.mark.parametrize("name", ["adam", "adamp", "rmsgd"])
def test_optimizers_train_and_differ_from_sgd(name):
    sgd, w0, _ = client_steps(["train.optimizer=sgd", "train.lr=0.01", "train.local_epochs=2"])
    other, _, _ = client_steps([f"train.optimizer={name}", "train.lr=0.01", "train.local_epochs=2"])
    assert torch.isfinite(other).all() and (other - w0).abs().max() > 0
    if name == "rmsgd":  # no conv layer: RMSGD's rates stay at lr, and it is exactly SGD
        assert torch.equal(other, sgd)
    else:
        assert (other - sgd).abs().max() > 1e-5


def test_rmsgd_real_constructor_and_epoch_step(monkeypatch):
    from rmsgd import RMSGD
    tc = config.TrainConfig(optimizer="rmsgd", lr=0.03, momentum=0.9, weight_decay=1e-4, rmsgd_beta=0.7)
    opt = optim.build_optimizer(tc, [torch.nn.Parameter(torch.randn(4, 3, 3, 3))], 0.03)
    assert isinstance(opt, RMSGD) and opt.beta == 0.7 and opt.init_lr == 0.03
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["weight_decay"] == 1e-4
    calls = []
    original = RMSGD.epoch_step
    monkeypatch.setattr(RMSGD, "epoch_step", lambda self: (calls.append(1), original(self))[1])
    w, w0, _ = client_steps(["train.optimizer=rmsgd", "train.lr=0.05", "train.local_epochs=3"], model_name="cnn")
    assert len(calls) == 2  # after every local epoch but the last (the optimizer is then discarded)
    sgd, _, _ = client_steps(["train.optimizer=sgd", "train.lr=0.05", "train.local_epochs=3"], model_name="cnn")
    assert (w - sgd).abs().max() > 1e-6  # the conv layers' rates adapted after the first epoch


def test_backward_into_unset_grads_has_the_bits_of_adding_to_zeros():
    """rules.backward (train_client unsets the gradients each step) leaves the bits that adding
    each step's gradient to zeroed gradients left: a -0.0 gradient element is +0.0 there, and a
    bare loss.backward() into unset gradients would keep -0.0 (the sign of a zero is the only
    difference, so torch.equal cannot see it: the bytes are compared)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    coeff = torch.tensor([[-0.0, 1.5, -2.0, 0.0]]).expand(3, 4)  # d loss / d weight, -0.0 entries included

    def loss_fn():
        return (model.weight * coeff).sum() + model.bias.sum()

    def grad_bytes():
        return [p.grad.view(torch.int32).clone() for p in model.parameters()]

    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    loss_fn().backward()
    zeroed = grad_bytes()
    assert (zeroed[0] == torch.tensor(-0.0).view(torch.int32)).sum() == 0  # 0.0 + -0.0 is +0.0

    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    assert any(not torch.equal(a, b) for a, b in zip(grad_bytes(), zeroed))  # the bare backward differs

    model.zero_grad(set_to_none=True)
    rules.backward(loss_fn(), list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(grad_bytes(), zeroed))
