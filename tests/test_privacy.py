"""Client-level DP with sampling and accounting that match: Poisson sampling, PLD and RDP
accountants, adaptive clipping, the noise cohort and DP-FedMom.

1. Poisson sampling: per (seed, round, client id), so world-size invariant; its rate.
2. Accounting: every epsilon is dp-accounting's, called directly, for the run's sampling; a
   fixed-size run with an accountant that cannot account it is refused in one line.
3. The mechanism: the noise has its stated standard deviation (update and count), adaptive
   clipping follows its target quantile, DP-FedMom is the same mechanism plus FedMom's step.
4. End to end: empty rounds, the clip in metrics.jsonl, resume, 1 vs 2 ranks, configuration
   errors, old checkpoints.
Legend: K reporting clients, P flat parameters, N all clients, q the sampling rate, m the cohort
the noise is calibrated for.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from fedddp import checkpoint, checks, config, strategies
from fedddp.comm import Comm
from fedddp.env import ProcessEnv
from fedddp.errors import ConfigError
from fedddp.book import Progress
from fedddp.round import run
from fedddp.sampling import sample_poisson
from fedddp.strategies import accounting, dpfedavg

from test_strategies import hp_of
from fedrun import assert_same_state, final_state, metrics, run_fedddp, run_here

dp_accounting = pytest.importorskip("dp_accounting")

SINGLE = ProcessEnv(0, 1, 0, "127.0.0.1", 0, "single")
BASE = ["data.num_clients=10", "model.name=mlp", "model.hidden=16", "train.batch_size=10", "train.lr=0.05",
        "run.progress=false", "run.eval_every=1"]
DP = ["algorithm.name=dpfedavg", "algorithm.params.dp_clip=0.5"]


def run_in_process(out, *overrides: str, rounds: int = 4) -> torch.Tensor:
    cfg = checks.load(None, BASE + [f"run.rounds={rounds}", f"run.out_dir={out}", *overrides])
    return run(cfg, Comm(SINGLE, "cpu"))["global_P"]


def dp_hp(**kw):
    return hp_of(name="dpfedavg", weighting="uniform", **kw)


# -- 1. Poisson sampling ------------------------------------------------------------------------

def test_poisson_sampling_draws_each_client_on_its_own():
    """A client's membership depends on (seed, round, its id) only: the same whatever N (so no
    rank's view of the other clients can change it), at rate q on average, all clients at q = 1."""
    small = [sample_poisson(10, 0.3, 7, r) for r in range(1, 200)]
    large = [sample_poisson(50, 0.3, 7, r) for r in range(1, 200)]
    assert small == [[c for c in big if c < 10] for big in large]
    assert small == [sample_poisson(10, 0.3, 7, r) for r in range(1, 200)]
    sizes = [len(s) for s in large]
    assert abs(sum(sizes) / len(sizes) / 50 - 0.3) < 0.02
    assert 0 in [len(s) for s in small] or min(sizes) < 15  # the size varies from round to round
    assert sample_poisson(10, 1.0, 7, 3) == list(range(10))
    assert sample_poisson(10, 0.3, 8, 3) != sample_poisson(10, 0.3, 7, 3) or \
        sample_poisson(10, 0.3, 8, 4) != sample_poisson(10, 0.3, 7, 4)


def test_auto_sampling_is_poisson_for_the_private_rules_only(tmp_path):
    for name, sampling in (("fedavg", "fixed"), ("fedmom", "fixed"), ("dpfedavg", "poisson"), ("dpfedmom", "poisson")):
        cfg = checks.load(None, [f"algorithm.name={name}", "algorithm.dp_clip=1"])
        assert cfg.run.sampling == sampling
        assert f'sampling = "{sampling}"' in config.dumps(cfg)
    assert checks.load(None, ["run.sampling=poisson"]).run.sampling == "poisson"
    cfg = checks.load(None, ["run.sampling=poisson", "run.participation=0.25", "data.num_clients=8"])
    assert (cfg.sampling_rate(), cfg.expected_cohort()) == (0.25, 2.0)
    cfg = checks.load(None, ["run.sampling=poisson", "run.clients_per_round=3", "data.num_clients=12"])
    assert (cfg.sampling_rate(), cfg.expected_cohort()) == (0.25, 3.0)


# -- 2. accounting --------------------------------------------------------------------------------

def direct_poisson(noise, rate, steps, delta, accountant):
    """dp-accounting's accountants called directly: add/remove-one, Poisson at q, multiplier z."""
    acc = dp_accounting.pld.PLDAccountant() if accountant == "pld" else dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(noise)), steps)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("noise,rate,steps,delta", [(1.0, 1 / 3, 40, 1e-5), (0.8, 0.1, 7, 1e-4),
                                                    (2.0, 0.01, 300, 1e-6), (1.2, 1.0, 3, 1e-5)])
def test_poisson_epsilon_is_the_accountants(noise, rate, steps, delta, accountant):
    got = accounting.poisson_epsilon(noise, rate, steps, delta, accountant)
    assert got == pytest.approx(direct_poisson(noise, rate, steps, delta, accountant), rel=1e-6, abs=0)
    assert accounting.poisson_epsilon(noise, rate, 0, delta, accountant) == 0.0
    assert accounting.poisson_epsilon(0.0, rate, steps, delta, accountant) == math.inf


def test_pld_is_tighter_than_rdp():
    """The reason PLD is the default: for the quickstart's q = 1/3, z = 1, 40 rounds."""
    pld, rdp = (accounting.poisson_epsilon(1.0, 1 / 3, 40, 1e-5, a) for a in ("pld", "rdp"))
    assert pld < rdp



def step_points(noise, rate, interval):
    """Grid points of one step's PLD on ``interval`` (dp-accounting's connect-the-dots loss range,
    the wider of remove and add), known before it is built."""
    from dp_accounting.pld import privacy_loss_mechanism as plm
    bounds = [plm.GaussianPrivacyLoss(noise, sampling_prob=rate, adjacency_type=a).connect_dots_bounds()
              for a in (plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD)]
    return max(b.epsilon_upper - b.epsilon_lower for b in bounds) / interval + 1


@pytest.mark.parametrize("noise,steps", [(0.01, 8), (0.03, 100), (0.1, 1000)])
def test_pld_accounting_of_a_small_noise_stays_bounded(monkeypatch, noise, steps):
    """At dp-accounting's default grid (1e-4) one step of z = 0.01 at q = 1/3 is 60 million points
    (its loss range grows as 1 / z^2) and 8 rounds took over 8 minutes and 4.7 GB. The grid is
    coarsened so that one step's PLD has at most PLD_STEP_POINTS points and the composition at
    most PLD_POINTS (checked before anything is built, so the old grid fails at once instead of
    running for minutes); the epsilon is still finite and, PLD being tighter, below RDP's."""
    step_bound, composed_bound = 1 << 17, 1 << 20  # accounting.PLD_STEP_POINTS, PLD_POINTS
    module = dp_accounting.pld.privacy_loss_distribution
    build, read = module.from_gaussian_mechanism, module.PrivacyLossDistribution.get_epsilon_for_delta
    composed = []

    def checked_build(*args, **kw):
        assert step_points(kw["standard_deviation"], kw["sampling_prob"], kw["value_discretization_interval"]) \
            <= step_bound
        return build(*args, **kw)

    def checked_read(pld, delta):
        composed.append(max(pld._pmf_remove.size, pld._pmf_add.size))
        return read(pld, delta)

    monkeypatch.setattr(module, "from_gaussian_mechanism", checked_build)
    monkeypatch.setattr(module.PrivacyLossDistribution, "get_epsilon_for_delta", checked_read)
    pld = accounting.poisson_epsilon(noise, 1 / 3, steps, 1e-5, "pld")
    assert composed and max(composed) <= composed_bound
    assert (accounting.PLD_STEP_POINTS, accounting.PLD_POINTS) == (step_bound, composed_bound)
    assert accounting.pld_interval(noise, 1 / 3, steps) > accounting.PLD_INTERVAL
    assert 0 < pld < accounting.poisson_epsilon(noise, 1 / 3, steps, 1e-5, "rdp") < math.inf


def test_a_coarser_pld_grid_keeps_the_fine_epsilon():
    """z = 0.3 (373,475 points a step at 1e-4) is composed on 4e-4: its epsilon is the default
    grid's (dp-accounting's PLDAccountant) to a millionth, and both are upper bounds (pessimistic
    connect-the-dots on any grid); the quickstart's z = 1 keeps the default grid."""
    assert accounting.pld_interval(0.3, 1 / 3, 8) == 4 * accounting.PLD_INTERVAL
    assert accounting.pld_interval(1.0, 1 / 3, 40) == accounting.PLD_INTERVAL
    assert accounting.poisson_epsilon(0.3, 1 / 3, 8, 1e-5) == pytest.approx(
        direct_poisson(0.3, 1 / 3, 8, 1e-5, "pld"), rel=1e-6)


@pytest.mark.e2e
@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_reported_poisson_epsilon_is_the_accountants(tmp_path, accountant):
    """Every evaluated round's epsilon is dp-accounting's for Poisson sampling at q = K / N (one step
    a round, empty rounds too: the noise is released whatever the cohort), in the progress line's
    last row and the closing line's source."""
    out = tmp_path / "dp"
    run_in_process(out, *DP, "algorithm.params.dp_noise=1.1", "algorithm.params.dp_delta=1e-4",
                   "run.clients_per_round=1", f"algorithm.params.dp_accountant={accountant}", rounds=6)
    rows = metrics(out)
    assert 0 in [m["num_reports"] for m in rows]  # a round with no client, as Poisson sampling allows
    for m in rows:
        assert m["epsilon"] == pytest.approx(direct_poisson(1.1, 0.1, m["round"], 1e-4, accountant), rel=1e-6)


@pytest.mark.e2e
def test_noise_cohort_accounts_its_deployment(tmp_path):
    """With a noise cohort m the epsilon is that of sampling m of the N clients at the same z
    (pfl-research's accounting), with eval_every: written on the evaluated rounds only."""
    out = tmp_path / "dp"
    run_in_process(out, *DP, "run.clients_per_round=2", "algorithm.params.dp_noise_cohort=5", "run.eval_every=2")
    rows = metrics(out)
    assert [m["epsilon"] is None for m in rows] == [True, False, True, False]
    for m in rows[1::2]:
        assert m["epsilon"] == pytest.approx(direct_poisson(1.0, 0.5, m["round"], 1e-5, "pld"), rel=1e-6)


def test_fixed_sampling_is_accounted_without_replacement():
    """The fixed-size accountant (unchanged): RDP, K of N without replacement, replace-one, z / 2;
    with a noise cohort m the same for m of N."""
    static = {"poisson": torch.tensor(False), "num_sampled": torch.tensor(3.0), "num_clients": torch.tensor(12.0),
              "sampling_rate": torch.tensor(0.25, dtype=torch.float64)}
    state = {"dp_steps": torch.tensor(9.0, dtype=torch.float64)}
    hp = dp_hp(dp_clip=1.0, dp_noise=1.3, dp_accountant="rdp")
    assert accounting.spent(state, static, hp) == accounting.epsilon(1.3, 3, 12, 9, 1e-5)
    assert accounting.spent(state, static, dp_hp(dp_clip=1.0, dp_noise=1.3, dp_accountant="rdp",
                                                 dp_noise_cohort=6)) == accounting.epsilon(1.3, 6, 12, 9, 1e-5)
    with pytest.raises(ValueError):
        accounting.spent(state, static, dp_hp(dp_clip=1.0))  # pld cannot (the config refuses it first)


# -- 3. the mechanism -----------------------------------------------------------------------------

def empty_round(num_params: int, num_sampled: float, seed: int = 0):
    """A round whose cohort was empty (Poisson): the released model is w plus the noise alone."""
    global_P = torch.zeros(num_params)
    stacks = {"params_KP": torch.zeros(0, num_params), "num_samples_K": torch.zeros(0),
              "train_loss_K": torch.zeros(0), "num_sampled": torch.tensor(num_sampled),
              "num_clients": torch.tensor(100.0), "noise_seed": torch.tensor(seed)}
    return global_P, stacks


@pytest.mark.parametrize("noise_cohort,quantile", [(0, 0.0), (40, 0.0), (0, 0.5), (40, 0.5)])
def test_noise_has_its_stated_std(noise_cohort, quantile):
    """The noise on the mean has std z_Delta C / m: m the expected cohort q N (here 8.5: Poisson's
    fixed denominator need not be whole) or the noise cohort, z_Delta = z without adaptive
    clipping, (z^-2 - (2 sigma_b)^-2)^(-1/2) with it (sigma_b = m / 20)."""
    hp = dp_hp(dp_clip=2.0, dp_noise=1.5, dp_noise_cohort=noise_cohort, dp_adaptive_quantile=quantile,
               dp_adaptive_count_noise=1.0 if quantile else 0.0)
    global_P, stacks = empty_round(200_000, 8.5)
    new_P, state, _ = dpfedavg.aggregate(global_P, stacks, dpfedavg.init_state(global_P, hp), hp)
    m = noise_cohort or 8.5
    z = 1.5 if not quantile else (1.5 ** -2 - 2.0 ** -2) ** -0.5
    assert abs(new_P.double().std().item() / (z * 2.0 / m) - 1) < 0.01
    assert abs(new_P.double().mean().item()) < 5 * z * 2.0 / m / math.sqrt(200_000)
    assert float(state["dp_steps"]) == 1


@pytest.mark.parametrize("noise_cohort", [0, 40])
def test_count_noise_has_its_stated_std(noise_cohort):
    """Adaptive clipping's noised fraction b~ of unclipped updates: for an empty round 1/2 plus noise
    of std sigma_b / m (the deployment's, whatever K trains), over many seeds."""
    hp = dp_hp(dp_clip=1.0, dp_noise=1.0, dp_adaptive_quantile=0.5, dp_adaptive_count_noise=3.0,
               dp_noise_cohort=noise_cohort)
    fractions = []
    for seed in range(3000):
        global_P, stacks = empty_round(4, 10.0, seed)
        _, _, diag = dpfedavg.aggregate(global_P, stacks, dpfedavg.init_state(global_P, hp), hp)
        fractions.append(float(diag["unclipped_fraction_noised"]))
    values = torch.tensor(fractions, dtype=torch.float64)
    m = noise_cohort or 10
    assert abs(values.std().item() / (3.0 / m) - 1) < 0.05
    assert abs(values.mean().item() - 0.5) < 4 * 3.0 / m / math.sqrt(3000)


def known_norms(norms, num_params=50, seed=0):
    """Clients whose updates have exactly the given norms."""
    g = torch.Generator().manual_seed(seed)
    global_P = torch.randn(num_params, generator=g)
    directions = torch.randn(len(norms), num_params, generator=g)
    updates = directions / directions.norm(dim=1, keepdim=True) * torch.tensor(norms)[:, None]
    return global_P, {"params_KP": global_P + updates, "num_samples_K": torch.ones(len(norms)),
                      "train_loss_K": torch.ones(len(norms)), "num_sampled": torch.tensor(float(len(norms))),
                      "num_clients": torch.tensor(100.0), "noise_seed": torch.tensor(seed)}


@pytest.mark.parametrize("start", [0.3, 80.0])
@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_adaptive_clip_follows_its_quantile(start, noise):
    """40 clients with update norms 1, 2, ..., 40 and gamma = 0.3: 30% of the norms are <= C for C
    in [12, 13). From far below or far above, the clip comes there and stays (within the noised
    count's jitter when there is noise: sigma_b = 40 / 20 = 2 on the count, 0.05 on the fraction)."""
    global_P, stacks = known_norms([float(n) for n in range(1, 41)])
    hp = dp_hp(dp_clip=start, dp_noise=noise, dp_adaptive_quantile=0.3, dp_adaptive_lr=0.2)
    state, clips = dpfedavg.init_state(global_P, hp), []
    for _ in range(400):
        _, state, _ = dpfedavg.aggregate(global_P, stacks, state, hp)
        clips.append(float(state["dp_clip"]))
    late = torch.tensor(clips[200:])
    if noise == 0:
        assert 11.999 <= late.min() and late.max() < 13.001  # the norms are float32
    else:
        assert 10 <= late.median() <= 15 and 8 <= late.min() and late.max() <= 19


@pytest.mark.parametrize("norm,fraction", [(3.0, -0.2), (0.2, 1.2)])
def test_adaptive_clip_clamps_the_noised_fraction(norm, fraction):
    """Poisson sampling: 14 reports for an expected cohort of K = 10. All clipped, b~ = (0 - 7) / 10
    + 1/2 = -0.2; all within C, (14 - 7) / 10 + 1/2 = 1.2. As TF Privacy's QuantileEstimatorQuery,
    the step takes b~ clamped to [0, 1], so the clip grows by exp(eta_C gamma) at most and shrinks
    by exp(-eta_C (1 - gamma)) at most (here exp(0.1) = 1.105, not exp(0.14) = 1.150); metrics'
    unclipped_fraction_noised is b~ as released."""
    global_P, stacks = known_norms([norm] * 14)
    stacks["num_sampled"] = torch.tensor(10.0)
    hp = dp_hp(dp_clip=1.0, dp_noise=0.0, dp_adaptive_quantile=0.5, dp_adaptive_lr=0.2)
    _, state, diag = dpfedavg.aggregate(global_P, stacks, dpfedavg.init_state(global_P, hp), hp)
    assert float(diag["unclipped_fraction_noised"]) == pytest.approx(fraction)
    bound = math.exp(0.2 * 0.5) if fraction < 0 else math.exp(-0.2 * (1 - 0.5))
    assert float(state["dp_clip"]) == pytest.approx(bound, rel=1e-12)


def test_adaptive_clip_moves_within_the_clamped_bounds_under_noise():
    """With the count's noise too (z = 0.8, sigma_b = 10 / 20: std 0.05 on b~), 14 reports for K = 10,
    some clipped, over many seeds: b~ leaves [0, 1] and the growth factor never leaves
    [exp(-eta_C (1 - gamma)), exp(eta_C gamma)], reaching the bound whenever b~ is outside."""
    gamma, eta = 0.3, 0.2
    low, high = math.exp(-eta * (1 - gamma)), math.exp(eta * gamma)
    hp = dp_hp(dp_clip=1.0, dp_noise=0.8, dp_adaptive_quantile=gamma, dp_adaptive_lr=eta)
    outside = 0
    for seed in range(60):
        for norms in ([3.0] * 14, [0.5] * 13 + [3.0], [0.5] * 7 + [3.0] * 7):
            global_P, stacks = known_norms(norms, seed=seed)
            stacks["num_sampled"] = torch.tensor(10.0)
            _, state, diag = dpfedavg.aggregate(global_P, stacks, dpfedavg.init_state(global_P, hp), hp)
            below, growth = float(diag["unclipped_fraction_noised"]), float(state["dp_clip"])
            assert low * (1 - 1e-12) <= growth <= high * (1 + 1e-12)
            if not 0 <= below <= 1:
                outside += 1
                assert growth == pytest.approx(high if below < 0 else low, rel=1e-12)
            else:
                assert growth == pytest.approx(math.exp(-eta * (below - gamma)), rel=1e-12)
    assert outside >= 60


def test_dpfedmom_is_the_mechanism_then_fedmoms_step():
    """DP-FedMom's model: DP-FedAvg's released mean (the same noise), then lerp by eta and m times
    the last step; momentum 0 gives DP-FedAvg's bits."""
    global_P, stacks = known_norms([0.2, 0.7, 1.5, 3.0])
    base = dict(dp_clip=1.0, dp_noise=0.7)
    dp = strategies.get("dpfedmom")
    state = dp.init_state(global_P, dp_hp(**base))
    state["previous_P"] = global_P - 0.01  # a previous step
    plain, _, _ = dpfedavg.aggregate(global_P, stacks, dpfedavg.init_state(global_P, dp_hp(**base)), dp_hp(**base))
    zero, _, _ = dp.aggregate(global_P, stacks, dict(state), dp_hp(**base, server_momentum=0.0))
    assert torch.equal(zero, plain)
    new_P, new_state, diag = dp.aggregate(global_P, stacks, dict(state), dp_hp(**base, server_momentum=0.9,
                                                                              server_lr=0.5))
    twin = global_P.double() + 0.5 * (plain.double() - global_P.double()) + 0.9 * 0.01
    torch.testing.assert_close(new_P.double(), twin, rtol=0, atol=1e-6)
    assert torch.equal(new_state["previous_P"], global_P) and float(new_state["dp_steps"]) == 1
    assert float(diag["velocity_norm"]) > 0


# -- 4. end to end ----------------------------------------------------------------------------------

@pytest.mark.e2e
def test_an_empty_round_keeps_the_model_but_not_under_dp(tmp_path):
    """Poisson sampling may draw no client: FedAvg's model stays; DP-FedAvg releases its noise
    (and counts the step) all the same."""
    empty = next(r for r in range(2, 50) if not sample_poisson(10, 0.1, 0, r))
    args = ["run.clients_per_round=1", "run.sampling=poisson"]
    before = run_in_process(tmp_path / "a", *args, rounds=empty - 1)
    after = run_in_process(tmp_path / "b", *args, rounds=empty)
    assert torch.equal(before, after)
    row = metrics(tmp_path / "b")[-1]
    assert (row["round"], row["num_reports"], row["clients"], row["train_loss"]) == (empty, 0, [], None)
    dp_before = run_in_process(tmp_path / "c", *args, *DP, rounds=empty - 1)
    dp_after = run_in_process(tmp_path / "d", *args, *DP, rounds=empty)
    assert not torch.equal(dp_before, dp_after)
    assert metrics(tmp_path / "d")[-1]["epsilon"] == pytest.approx(direct_poisson(1.0, 0.1, empty, 1e-5, "pld"),
                                                                   rel=1e-6)


@pytest.mark.e2e
def test_adaptive_clip_is_written_and_resumes_exactly(tmp_path):
    """The clip is server state: metrics.jsonl has it every round, it moves, and a run stopped and
    resumed from a checkpoint continues with the same clip, noise and epsilon."""
    args = [*DP, "algorithm.params.dp_adaptive_quantile=0.5", "algorithm.params.dp_noise=0.5",
            "algorithm.params.dp_adaptive_count_noise=1.0", "run.clients_per_round=5", "run.ckpt_every=2",
            "run.dropout=0.2"]
    full = run_in_process(tmp_path / "full", *args, rounds=5)
    run_in_process(tmp_path / "part", *args, "run.stop_after=2", rounds=5)
    resumed = run_in_process(tmp_path / "part", *args, "run.resume=true", rounds=5)
    assert torch.equal(full, resumed)
    rows, again = metrics(tmp_path / "full"), metrics(tmp_path / "part")
    keys = ("dp_clip", "epsilon", "unclipped_fraction_noised", "clients")
    assert [[m[k] for k in keys] for m in rows] == [[m[k] for k in keys] for m in again]
    clips = [m["dp_clip"] for m in rows]
    assert len(set(clips)) == len(clips) and clips[0] != 0.5


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_poisson_sampling_is_world_size_invariant(tmp_path):
    """1 and 2 ranks give the same bits and the same cohorts: the draws are per (seed, round,
    client id), the noise is drawn on rank 0 from (seed, step)."""
    args = ["run.rounds=4", "run.eval_every=2", "algorithm.name=dpfedavg", "algorithm.params.dp_clip=1",
            "algorithm.params.dp_adaptive_quantile=0.5", "algorithm.params.dp_adaptive_count_noise=1.0",
            "run.dropout=0.2"]
    run_here(args + [f"run.out_dir={tmp_path / 'one'}"])
    run_fedddp(args + [f"run.out_dir={tmp_path / 'two'}"], nproc=2)
    assert_same_state(final_state(tmp_path / "one"), final_state(tmp_path / "two"))
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    keys = ("clients", "num_reports", "dp_clip", "epsilon")
    assert [[m[k] for k in keys] for m in one] == [[m[k] for k in keys] for m in two]
    assert len({len(m["clients"]) for m in one}) > 1  # cohorts of several sizes


@pytest.mark.parametrize("overrides,words", [
    (["run.sampling=sometimes"], ["run.sampling", "fixed, poisson"]),
    (DP + ["run.sampling=fixed"], ["algorithm.params.dp_accountant", "run.sampling=poisson",
                                   "algorithm.params.dp_accountant=rdp"]),
    (DP + ["algorithm.params.dp_accountant=moments"], ["algorithm.params.dp_accountant", "pld, rdp"]),
    (DP + ["run.clients_per_round=5", "algorithm.params.dp_noise_cohort=3"], ["algorithm.params.dp_noise_cohort"]),
    (DP + ["algorithm.params.dp_noise_cohort=31"], ["algorithm.params.dp_noise_cohort", "data.num_clients = 30"]),
    (DP + ["run.clients_per_round=10", "algorithm.params.dp_adaptive_quantile=0.5"],
     ["algorithm.params.dp_adaptive_count_noise", "0.5"]),
    (DP + ["algorithm.params.dp_adaptive_quantile=1.0"], ["algorithm.params.dp_adaptive_quantile"]),
    (DP + ["algorithm.params.dp_adaptive_lr=0"], ["algorithm.params.dp_adaptive_lr"]),
    (["algorithm.name=dpfedmom", "algorithm.params.dp_clip=1", "algorithm.params.server_momentum=2"],
     ["algorithm.params.server_momentum"]),
])
def test_configuration_errors_are_one_line_naming_the_key(overrides, words):
    with pytest.raises(ConfigError) as err:
        checks.load(None, overrides)
    assert str(err.value).startswith("1 configuration error(s): ") and "\n" not in str(err.value)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_fixed_sampling_with_rdp_and_an_adaptive_clip_load():
    cfg = checks.load(None, DP + ["run.sampling=fixed", "algorithm.params.dp_accountant=rdp",
                                  "run.clients_per_round=20", "algorithm.params.dp_adaptive_quantile=0.5"])
    assert cfg.run.sampling == "fixed" and cfg.algorithm.params["dp_accountant"] == "rdp"


def test_a_checkpoint_of_fixed_size_dp_from_before_resumes_as_it_ran():
    """A DP-FedAvg checkpoint written before run.sampling and the accountant choice sampled K of N
    and accounted with RDP: it resumes with those values and is refused, naming both, with the new
    defaults (Poisson sampling would be another run)."""
    old_keys = ("run.sampling", "dp_accountant", "dp_adaptive_quantile", "dp_adaptive_lr",
                "dp_adaptive_count_noise", "dp_noise_cohort")
    as_ran = checkpoint.identity(checks.load(None, DP + ["run.sampling=fixed", "algorithm.params.dp_accountant=rdp"]))
    older = {k: v for k, v in as_ran.items() if k not in old_keys}
    older["algorithm.params"] = {k: v for k, v in as_ran["algorithm.params"].items() if k not in old_keys}
    assert checkpoint.identity_changes(older, as_ran) == []
    changes = checkpoint.identity_changes(older, checkpoint.identity(checks.load(None, DP)))
    assert changes == ["algorithm.params.dp_accountant 'rdp' -> 'pld'", "run.sampling 'fixed' -> 'poisson'"]
    fedavg = checkpoint.identity(checks.load(None, []))
    assert checkpoint.identity_changes({k: v for k, v in fedavg.items() if k != "run.sampling"}, fedavg) == []


def test_progress_line_shows_the_last_epsilon(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    progress = Progress(3, True)
    progress.update(1, 1, {"test_accuracy": 0.5, "train_loss": 1.0, "epsilon": 2.25})
    progress.update(2, 1, {"test_accuracy": 0.6, "train_loss": 0.9, "epsilon": None})
    lines = err.getvalue().splitlines()
    assert "| eps 2.25 |" in lines[0] and "| eps 2.25 |" in lines[1]


def test_adaptive_clipping_at_the_defaults_says_the_value_to_set():
    """dp_adaptive_quantile with the defaults (sigma_b = cohort / 20 = z / 2) is refused with the
    value to set, and that value is accepted."""
    import re

    from fedrun import QUICKSTART

    base = ["algorithm.name=dpfedavg", "algorithm.params.dp_clip=1", "algorithm.params.dp_adaptive_quantile=0.5"]
    with pytest.raises(ConfigError) as refused:
        checks.load(QUICKSTART, base)
    fix = re.search(r"set (algorithm\.params\.dp_adaptive_count_noise=\S+) ", str(refused.value)).group(1)
    assert checks.load(QUICKSTART, base + [fix]).algorithm.params["dp_adaptive_count_noise"] == 1.0
