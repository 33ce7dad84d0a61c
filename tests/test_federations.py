"""Realistic federations: uneven local work, clients that drop out or miss a deadline, and
client-level differential privacy (DP-FedAvg).

1. The draws (fedddp.participation) depend on (seed, round, client id) only.
2. End to end: the drawn work and dropouts give the bitwise-same final.pt on 1 and 2 ranks;
   FedNova follows the steps actually taken; a round without reports changes nothing.
3. DP-FedAvg: clipping bounds every client's contribution, the noise has std z C / K, its
   neutral setting is FedAvg bit for bit, and the epsilon written is the accountant's for
   sampling without replacement.
Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from fedddp import checkpoint, checks, config, participation, strategies
from fedddp.comm import Comm
from fedddp.env import ProcessEnv
from fedddp.errors import ConfigError
from fedddp.round import run
from fedddp.strategies import accounting, dpfedavg, kernels

from test_strategies import hp_of
from fedrun import QUICKSTART, assert_same_state, final_state, metrics, run_fedddp_each, run_here, selected

SINGLE = ProcessEnv(0, 1, 0, "127.0.0.1", 0, "single")
BASE = ["data.num_clients=10", "run.clients_per_round=5", "model.name=mlp", "model.hidden=16",
        "train.batch_size=10", "train.lr=0.05", "run.eval_every=100", "run.progress=false"]


def run_in_process(out, *overrides: str, rounds: int = 3) -> torch.Tensor:
    cfg = checks.load(None, BASE + [f"run.rounds={rounds}", f"run.out_dir={out}", *overrides])
    return run(cfg, Comm(SINGLE, "cpu"))["global_P"]


# -- 1. draws -----------------------------------------------------------------------------------

def test_draws_depend_only_on_seed_round_and_client():
    cfg = checks.load(None, ["train.local_epochs=5", "train.local_work_min=2", "run.dropout=0.3"])
    work = [participation.local_work(cfg.train, cfg.run.seed, r, c) for r in range(1, 21) for c in range(30)]
    assert set(work) == {2, 3, 4, 5}  # the whole stated range, nothing outside it
    again = [participation.local_work(cfg.train, cfg.run.seed, r, c) for r in range(1, 21) for c in range(30)]
    assert work == again
    drops = [participation.drops_out(cfg.run.dropout, cfg.run.seed, r, c) for r in range(1, 101) for c in range(30)]
    assert abs(sum(drops) / len(drops) - 0.3) < 0.03
    # another seed draws otherwise; work and dropouts are separate streams
    other = checks.load(None, ["train.local_epochs=5", "train.local_work_min=2", "run.seed=1"])
    assert work != [participation.local_work(other.train, other.run.seed, r, c)
                    for r in range(1, 21) for c in range(30)]
    equal = checks.load(None, ["train.local_steps=7"])
    assert {participation.local_work(equal.train, equal.run.seed, r, c) for r in range(1, 5) for c in range(9)} == {7}


def test_deadline_keeps_the_rows_within_it():
    num_steps_K = torch.tensor([3.0, 9.0, 5.0, 12.0])
    assert participation.reporting_rows(num_steps_K, 5).tolist() == [0, 2]
    assert participation.reporting_rows(num_steps_K, 0).tolist() == [0, 1, 2, 3]


# -- 2. end to end --------------------------------------------------------------------------------

UNEVEN = ["run.rounds=4", "train.local_epochs=3", "train.local_work_min=1", "run.dropout=0.3",
          "run.deadline_steps=40", "run.eval_every=2"]


def uneven(name: str) -> list[str]:
    # fixed-size sampling, so every round samples 10 clients and the dropouts leave some (Poisson
    # sampling's world-size invariance: tests/test_privacy.py)
    dp = ["algorithm.dp_clip=0.5", "run.sampling=fixed", "algorithm.params.dp_accountant=rdp"]
    return UNEVEN + [f"algorithm.name={name}"] + (dp if name == "dpfedavg" else [])


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory) -> dict:
    """{rule: out_dir} of the selected rules' runs on 2 ranks, under one torchrun."""
    names = selected(request, "test_drawn_work_and_dropouts_are_world_size_invariant", "name")
    root = tmp_path_factory.mktemp("two_ranks")
    if names:
        run_fedddp_each([uneven(name) + [f"run.out_dir={root / name}"] for name in names], nproc=2)
    return {name: root / name for name in names}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fednova", "dpfedavg"])
@pytest.mark.processes
@pytest.mark.e2e
def test_drawn_work_and_dropouts_are_world_size_invariant(tmp_path, name, two_ranks):
    """Guards against draws that depend on the rank (or on the clients a rank owns) and against
    dropped rows reaching the server rule in a rank-dependent order."""
    args = uneven(name)
    one, two = tmp_path / "one", two_ranks[name]
    run_here(args + [f"run.out_dir={one}"])
    assert_same_state(final_state(one), final_state(two))
    lines_1, lines_2 = metrics(one), metrics(two)
    assert [(m["num_reports"], m["dropped"]) for m in lines_1] == [(m["num_reports"], m["dropped"]) for m in lines_2]
    # clients really dropped, at random and past the deadline, yet every round had reports
    assert all(0 < m["num_reports"] < 10 for m in lines_1)
    cfg = checks.load(QUICKSTART, args)
    at_random = {(m["round"], c) for m in lines_1 for c in m["dropped"]
                 if participation.drops_out(cfg.run.dropout, cfg.run.seed, m["round"], c)}
    all_dropped = {(m["round"], c) for m in lines_1 for c in m["dropped"]}
    assert at_random and all_dropped - at_random


@pytest.mark.e2e
def test_fednova_follows_the_steps_actually_taken(tmp_path):
    equal = ["train.local_steps=4"]
    uneven = ["train.local_steps=4", "train.local_work_min=1"]
    torch.testing.assert_close(run_in_process(tmp_path / "ne", "algorithm.name=fednova", *equal),
                               run_in_process(tmp_path / "ae", "algorithm.name=fedavg", *equal), rtol=0, atol=2e-6)
    nova = run_in_process(tmp_path / "nu", "algorithm.name=fednova", *uneven)
    fedavg = run_in_process(tmp_path / "au", "algorithm.name=fedavg", *uneven)
    assert (nova - fedavg).abs().max() > 1e-4
    # tau_eff is the weighted mean of the drawn step counts, which lie in [1, 4] and differ
    tau_eff = [m["tau_eff"] for m in metrics(tmp_path / "nu")]
    assert all(1 <= t <= 4 for t in tau_eff) and len(set(tau_eff)) > 1


@pytest.mark.e2e
def test_round_without_reports_leaves_model_and_state_unchanged(tmp_path, monkeypatch):
    """Guards against a round with zero reports aggregating stale or padding rows (or dividing
    by a zero weight sum): FedMom's momentum state must stay as it was, too."""
    monkeypatch.setattr(checkpoint, "_prune", lambda *args: None)  # keep every round's checkpoint
    out = tmp_path / "run"
    run_in_process(out, "algorithm.name=fedmom", "run.clients_per_round=2", "run.dropout=0.6",
                   "run.ckpt_every=1", "run.eval_every=1", rounds=6)
    lines = metrics(out)
    empty = [m["round"] for m in lines if m["num_reports"] == 0]
    full = [m["round"] for m in lines if m["num_reports"] > 0]
    assert [r for r in empty if r > 1] and full, lines  # both kinds occur (seeded)
    for m in lines:
        assert (m["train_loss"] is None) == (m["num_reports"] == 0)
    saved = {r: torch.load(out / "checkpoints" / f"round_{r:06d}" / "server.pt", weights_only=True)
             for r in range(1, 7)}
    for r in range(2, 7):
        unchanged = torch.equal(saved[r]["global_P"], saved[r - 1]["global_P"]) and all(
            torch.equal(saved[r]["state"][k], saved[r - 1]["state"][k]) for k in saved[r]["state"])
        assert unchanged == (r in empty), r


@pytest.mark.e2e
def test_zero_report_round_says_so_on_one_process(tmp_path):
    out = tmp_path / "run"
    start = run_in_process(tmp_path / "zero", "run.dropout=1.0", rounds=1)
    again = run_in_process(out, "run.dropout=1.0", rounds=2)
    assert torch.equal(start, again)
    assert [(m["num_reports"], m["train_loss"]) for m in metrics(out)] == [(0, None), (0, None)]


# -- 3. DP-FedAvg ---------------------------------------------------------------------------------

@pytest.fixture(params=["c", "torch"])
def rule_form(request, monkeypatch):
    """Both forms of the weighted mean DP-FedAvg shares with FedAvg."""
    monkeypatch.setenv("FEDDDP_KERNELS", request.param)
    if request.param == "c" and kernels.lib(torch.zeros(1)) is None:
        pytest.skip("no working C compiler")
    return request.param


def dp_inputs(num_clients=6, num_params=300, seed=0, spread=(0.01, 3.0), num_sampled=None):
    g = torch.Generator().manual_seed(seed)
    global_P = torch.randn(num_params, generator=g)
    sizes_K = torch.linspace(*spread, num_clients)  # some updates inside the clip norm, some far out
    directions_KP = torch.randn(num_clients, num_params, generator=g)
    updates_KP = directions_KP / directions_KP.norm(dim=1, keepdim=True) * sizes_K[:, None]
    stacks = {"params_KP": global_P + updates_KP, "num_samples_K": torch.arange(1.0, num_clients + 1),
              "train_loss_K": torch.ones(num_clients),
              "num_sampled": torch.tensor(float(num_sampled or num_clients)),
              "num_clients": torch.tensor(100.0), "noise_seed": torch.tensor(0)}
    return global_P, stacks


def dp_hp(**kw):
    return hp_of(name="dpfedavg", weighting="uniform", **kw)


@pytest.mark.parametrize("num_sampled", [None, 9])
def test_dp_clipping_bounds_every_clients_contribution(rule_form, num_sampled):
    """Slow twin in float64: each update scaled to norm <= C, summed, divided by the configured
    K (fixed denominator: 9 sampled, 6 reported)."""
    clip = 0.5
    global_P, stacks = dp_inputs(num_sampled=num_sampled)
    updates_KP = stacks["params_KP"] - global_P
    scale_K = dpfedavg.clip_factors_K(updates_KP, clip)
    clipped_norms_K = (scale_K[:, None] * updates_KP).double().norm(dim=1)
    assert (clipped_norms_K <= clip * (1 + 1e-6)).all()
    inside = updates_KP.norm(dim=1) <= clip
    assert inside.any() and (~inside).any() and (scale_K[inside] == 1).all()
    hp = dp_hp(dp_clip=clip, dp_noise=0.0)
    new_P, state, diag = dpfedavg.aggregate(global_P, stacks, dpfedavg.init_state(global_P, hp), hp)
    K = len(scale_K)
    denominator = float(stacks["num_sampled"])
    twin = global_P.double().clone()
    for k in range(K):
        d = updates_KP[k].double()
        twin += d * min(1.0, clip / d.norm().item()) / denominator
    torch.testing.assert_close(new_P.double(), twin, rtol=0, atol=1e-5)
    assert (new_P - global_P).double().norm() <= clip * K / denominator * (1 + 1e-5)
    assert float(diag["clipped_fraction"]) == float((~inside).float().mean())
    assert float(state["dp_steps"]) == 1


@pytest.mark.parametrize("server_lr", [0.5, 1.5])
def test_dp_server_lr_scales_the_noised_step(rule_form, server_lr):
    """algorithm.server_lr is the server's step along the noised mean update (it was ignored):
    w + eta (sum_k s_k d_k + noise) / K, the same noise (post-processing: no privacy cost)."""
    global_P, stacks = dp_inputs(num_sampled=9)
    state = dpfedavg.init_state(global_P, dp_hp(dp_clip=0.5))
    full_P, _, _ = dpfedavg.aggregate(global_P, stacks, state, dp_hp(dp_clip=0.5, dp_noise=1.0))
    new_P, _, _ = dpfedavg.aggregate(global_P, stacks, state, dp_hp(dp_clip=0.5, dp_noise=1.0,
                                                                    server_lr=server_lr))
    twin = global_P.double() + server_lr * (full_P.double() - global_P.double())
    torch.testing.assert_close(new_P.double(), twin, rtol=0, atol=1e-6)


def test_dp_noise_has_std_z_c_over_k(rule_form):
    global_P, stacks = dp_inputs(num_clients=4, num_params=200_000, spread=(0.0, 0.0), num_sampled=8)
    hp = dp_hp(dp_clip=2.0, dp_noise=1.5)
    new_P, _, _ = dpfedavg.aggregate(global_P, stacks, dpfedavg.init_state(global_P, hp), hp)
    noise_P = (new_P - global_P).double()
    assert abs(noise_P.std().item() / (1.5 * 2.0 / 8) - 1) < 0.01
    assert abs(noise_P.mean().item()) < 0.01


def test_dp_neutral_setting_is_fedavg_bitwise(rule_form):
    global_P, stacks = dp_inputs(spread=(0.1, 2.0))
    fedavg, _, _ = strategies.get("fedavg").aggregate(global_P, stacks, {}, dp_hp())
    hp = dp_hp(dp_clip=1e9, dp_noise=0.0)
    dp, _, _ = dpfedavg.aggregate(global_P, stacks, dpfedavg.init_state(global_P, hp), hp)
    assert torch.equal(dp, fedavg)


@pytest.mark.e2e
def test_dp_neutral_setting_is_fedavg_bitwise_end_to_end(tmp_path):
    fedavg = run_in_process(tmp_path / "a", "algorithm.name=fedavg", "algorithm.weighting=uniform")
    fixed = ["run.sampling=fixed", "algorithm.params.dp_accountant=rdp"]  # FedAvg's sample
    neutral = run_in_process(tmp_path / "d", "algorithm.name=dpfedavg", "algorithm.dp_clip=1e9",
                             "algorithm.dp_noise=0", *fixed)
    assert torch.equal(neutral, fedavg)
    noisy = run_in_process(tmp_path / "n", "algorithm.name=dpfedavg", "algorithm.dp_clip=1", *fixed)
    assert (noisy - fedavg).abs().max() > 1e-3  # the comparison can fail


@pytest.mark.e2e
def test_dp_with_dropouts_resumes_exactly(tmp_path):
    """Guards against noise or accounting that restart with the process: the aggregation count
    that seeds the noise and feeds the accountant is server state, checkpointed."""
    args = ["algorithm.name=dpfedavg", "algorithm.dp_clip=0.5", "run.dropout=0.3", "run.ckpt_every=2",
            "run.eval_every=1"]
    full = run_in_process(tmp_path / "full", *args, rounds=4)
    run_in_process(tmp_path / "part", *args, "run.stop_after=2", rounds=4)
    resumed = run_in_process(tmp_path / "part", *args, "run.resume=true", rounds=4)
    assert torch.equal(full, resumed)
    assert [m["epsilon"] for m in metrics(tmp_path / "full")] == [m["epsilon"] for m in metrics(tmp_path / "part")]


def accountant_epsilon(noise, num_sampled, num_clients, steps, delta, sampling):
    """dp-accounting's RdpAccountant called directly. without_replacement: K of N sampled
    without replacement, replace-one neighbours, so the clipped sum's sensitivity is 2C and
    the Gaussian's multiplier (std over sensitivity) z / 2; poisson: each client with
    probability K / N, add/remove-one neighbours, sensitivity C, multiplier z."""
    import dp_accounting
    if sampling == "without_replacement":
        accountant = dp_accounting.rdp.RdpAccountant(
            neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        event = dp_accounting.SampledWithoutReplacementDpEvent(
            num_clients, num_sampled, dp_accounting.GaussianDpEvent(noise / 2))
    else:
        accountant = dp_accounting.rdp.RdpAccountant()
        event = dp_accounting.PoissonSampledDpEvent(num_sampled / num_clients,
                                                    dp_accounting.GaussianDpEvent(noise))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(delta)


@pytest.mark.e2e
def test_reported_epsilon_is_the_accountants(tmp_path):
    """Every round's epsilon is dp-accounting's for K of N clients sampled without replacement
    (what run.sampling = fixed does), the noise multiplier and the aggregations so far (a round without
    reports spends nothing), and never below the Poisson-sampling figure at q = K / N, which
    was reported before and understated the privacy spent."""
    out = tmp_path / "dp"
    run_in_process(out, "algorithm.name=dpfedavg", "algorithm.dp_clip=1.0", "algorithm.dp_noise=1.1",
                   "algorithm.dp_delta=1e-4", "run.clients_per_round=2", "run.dropout=0.5", "run.sampling=fixed",
                   "algorithm.params.dp_accountant=rdp", "run.eval_every=1", rounds=6)
    steps = 0
    lines = metrics(out)
    assert {m["num_reports"] == 0 for m in lines} == {True, False}
    for m in lines:
        steps += m["num_reports"] > 0
        if steps == 0:
            assert m["epsilon"] == 0.0
            continue
        expected = accountant_epsilon(1.1, 2, 10, steps, 1e-4, "without_replacement")
        assert m["epsilon"] == pytest.approx(expected, rel=1e-12, abs=0)
        assert m["epsilon"] >= accountant_epsilon(1.1, 2, 10, steps, 1e-4, "poisson")
    assert lines[-1]["epsilon"] > 0


@pytest.mark.parametrize("noise,num_sampled,num_clients,steps", [
    (1.0, 10, 30, 40),      # the quickstart with DP (README): 40 rounds of 10 of 30 clients
    (1.0, 10, 30, 1), (0.5, 1, 100, 10), (2.0, 9, 10, 100), (4.0, 50, 1000, 1000), (1.5, 10, 10, 5)])
def test_epsilon_accounts_for_sampling_without_replacement(noise, num_sampled, num_clients, steps):
    """fedddp samples exactly K of N clients: epsilon is dp-accounting's bound for that sampling
    under replace-one (sensitivity 2C), at least the Poisson figure for the same (z, K, N, T)
    (2x or more on each of these), and for the quickstart's 40 rounds 113.1, where the Poisson
    accountant said 16.5."""
    got = accounting.epsilon(noise, num_sampled, num_clients, steps, 1e-5)
    assert got == pytest.approx(accountant_epsilon(noise, num_sampled, num_clients, steps, 1e-5,
                                                   "without_replacement"), rel=1e-12, abs=0)
    assert got >= 2 * accountant_epsilon(noise, num_sampled, num_clients, steps, 1e-5, "poisson")
    if (noise, num_sampled, num_clients, steps) == (1.0, 10, 30, 40):
        assert got == pytest.approx(113.13, abs=0.01)
    assert accounting.epsilon(noise, num_sampled, num_clients, 0, 1e-5) == 0.0
    assert accounting.epsilon(0.0, num_sampled, num_clients, steps, 1e-5) == math.inf


def test_checkpoint_from_before_the_new_keys_still_resumes():
    """Guards against every added config key making older checkpoints foreign: a key missing
    from the saved identity is no change while it keeps its default, and is one otherwise."""
    now = checkpoint.identity(checks.load(None, []))
    older = {k: v for k, v in now.items() if k not in ("run.dropout", "train.local_work_min")}
    assert checkpoint.identity_changes(older, now) == []
    changed = checkpoint.identity(checks.load(None, ["run.dropout=0.2"]))
    assert checkpoint.identity_changes(older, changed) == ["run.dropout '(unset)' -> 0.2"]


# -- configuration ----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,words", [
    (["algorithm.name=dpfedavg"], ["algorithm.params.dp_clip", "> 0"]),
    (["algorithm.name=dpfedavg", "algorithm.dp_clip=1", "algorithm.weighting=samples"], ["algorithm.weighting"]),
    (["algorithm.name=dpfedavg", "algorithm.dp_clip=1", "algorithm.dp_delta=0"], ["algorithm.params.dp_delta"]),
    (["run.dropout=1.5"], ["run.dropout"]),
    (["run.deadline_steps=-1"], ["run.deadline_steps"]),
    (["train.local_epochs=2", "train.local_work_min=3"], ["train.local_work_min", "train.local_epochs = 2"]),
    (["train.local_work_min=1", "train.lr_schedule=steplr", "train.lr_schedule_unit=epoch",
      "train.local_epochs=2"], ["train.local_work_min", "lr_schedule_unit"]),
])
def test_configuration_errors_name_the_key(overrides, words):
    with pytest.raises(ConfigError) as err:
        checks.load(None, overrides)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_dp_without_the_accountant_names_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "dp_accounting", None)  # import fails
    with pytest.raises(ConfigError, match=r"fedddp\[dp\]"):
        checks.load(None, ["algorithm.name=dpfedavg", "algorithm.dp_clip=1"])
