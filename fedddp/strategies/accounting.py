"""DP-FedAvg's privacy accounting (strategies/dpfedavg.py is the mechanism: clipping, noise, adaptive
clipping): epsilon at ``dp_delta`` from Google's dp-accounting (``pip install fedddp[dp]``,
imported late, only for DP runs), for Poisson sampling (PLD or RDP, add/remove-one) or fixed-size
sampling (RDP, replace-one, multiplier z / 2); what is accounted and why is dpfedavg.py's docstring,
"Privacy". ``spent`` is the rule's Strategy.spent.

One step's PLD (or RDP curve) depends on (z, q) (or (z, K, N)) only and is computed once per run
(per grid); T steps are its T-fold composition, as the accountants compose them. PLD's grid is the
accountant's default 1e-4 where one step has at most 2^17 points and T steps at most 2^20, else
the finest 1e-4 2^k within both (``pld_interval``): the points at a fixed grid grow as 1 / z^2 and
with T (z = 0.01, q = 1/3, T = 8 at 1e-4: over 8 minutes and 4.7 GB), and the pessimistic PLD is
an upper bound on any grid. So one epsilon takes under about 1.5 s and 100 MB for any z and T (2
shared cores; RDP 0.1 s), and the runtime asks for it on the rounds that evaluate (and the last).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math

ACCOUNTANTS = ("pld", "rdp")
# dp-accounting's PLDAccountant default: the grid of privacy-loss values, the finest used (pld_interval)
PLD_INTERVAL = 1e-4
# the most grid points one step's PLD (what building it costs, about 6 us a point) and the T-fold
# composition (what composing it and reading epsilon off it cost, about 100 bytes a point) may
# have: past them the grid is coarsened (pld_interval), which bounds the accountant's time and memory
PLD_STEP_POINTS = 1 << 17
PLD_POINTS = 1 << 20
# the tail mass dp-accounting's self_compose truncates (its default), which fixes the composition's length
_PLD_TAIL = 1e-15


def spent(state, static, hp) -> float:
    """Epsilon at dp_delta after the aggregations so far, for the run's sampling (static: poisson,
    sampling_rate q, num_sampled K, num_clients N) or, with a noise cohort m, for its deployment."""
    p, steps, num_clients = hp.params, int(state["dp_steps"]), int(static["num_clients"])
    if bool(static["poisson"]):
        rate = p["dp_noise_cohort"] / num_clients if p["dp_noise_cohort"] else float(static["sampling_rate"])
        return poisson_epsilon(p["dp_noise"], rate, steps, p["dp_delta"], p["dp_accountant"])
    if p["dp_accountant"] != "rdp":
        raise ValueError(f"dp_accountant {p['dp_accountant']} cannot account fixed-size sampling")
    return epsilon(p["dp_noise"], p["dp_noise_cohort"] or int(static["num_sampled"]), num_clients, steps, p["dp_delta"])


@contextlib.contextmanager
def _quiet_accountant():
    """dp-accounting's RDP routine logs (absl) every order it cannot evaluate and then leaves out:
    a screenful of warnings on stderr per curve, none of which changes the bound."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@functools.lru_cache(maxsize=4)
def _one_step_rdp(noise: float, num_sampled: int, num_clients: int):
    """(orders, RDP at each order) of one aggregation: K of N sampled without replacement, the
    Gaussian's multiplier z / 2 for the replace-one sensitivity 2C (module docstring)."""
    import dp_accounting  # late: an optional extra, imported only for DP runs
    accountant = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    with _quiet_accountant():
        accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(
            num_clients, num_sampled, dp_accounting.GaussianDpEvent(noise / 2)))
    return accountant.orders, accountant.rdp


@functools.lru_cache(maxsize=8)
def _one_step_pld(noise: float, rate: float, interval: float):
    """One aggregation under Poisson sampling at rate q, add/remove-one, multiplier z, on the grid
    ``interval``: the PLD dp-accounting's PLDAccountant builds for PoissonSampledDpEvent(q,
    GaussianDpEvent(z)) (pessimistic connect-the-dots)."""
    import dp_accounting
    return dp_accounting.pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise, value_discretization_interval=interval, sampling_prob=rate,
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)


@functools.lru_cache(maxsize=4)
def _one_step_poisson_rdp(noise: float, rate: float):
    """One aggregation under Poisson sampling at rate q, add/remove-one, multiplier z: (orders, RDP)."""
    import dp_accounting
    rdp = dp_accounting.rdp.RdpAccountant()
    with _quiet_accountant():
        rdp.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(noise)))
    return rdp.orders, rdp.rdp


def _coarsened(interval: float, ratio: float) -> float:
    """interval 2^k for the smallest k >= 0 with 2^k >= ratio (exact: a power of two), so the grids
    are nested and few: one step's PLD is built on a handful of them over a run."""
    return interval * 2 ** max(0, math.ceil(math.log2(ratio))) if ratio > 1 else interval


def pld_step_points(noise: float, rate: float, interval: float) -> int:
    """Grid points of one step's PLD on ``interval``, from its privacy-loss range alone (dp-
    accounting's connect-the-dots bounds, the range from_gaussian_mechanism discretises, the wider
    of remove and add), without building it. The range grows as 1 / (2 z^2): about 9.6 at z = 1 and
    q = 1/3, 6,000 at z = 0.01, 60 million points at the default grid."""
    from dp_accounting.pld import privacy_loss_mechanism as plm
    width = 0.0
    for adjacency in (plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD):
        bounds = plm.GaussianPrivacyLoss(noise, sampling_prob=rate, adjacency_type=adjacency).connect_dots_bounds()
        width = max(width, bounds.epsilon_upper - bounds.epsilon_lower)
    return math.ceil(width / interval) + 1


def pld_composed_points(one, steps: int) -> int:
    """Grid points of the ``steps``-fold composition of the PLD ``one``: the range dp-accounting's
    self_compose keeps (its Chernoff bounds at the tail mass it truncates), the wider of remove and
    add. Without the PMFs' arrays (dp-accounting internals): the untruncated length's bound,
    steps PLD_STEP_POINTS + 1, which can only coarsen the grid more."""
    from dp_accounting.pld import common
    points = 0
    for pmf in (getattr(one, "_pmf_remove", None), getattr(one, "_pmf_add", None)):
        probs = getattr(pmf, "_probs", None)
        if probs is None:
            return steps * PLD_STEP_POINTS + 1
        lower, upper = common.compute_self_convolve_bounds(probs, steps, _PLD_TAIL)
        points = max(points, upper - lower + 1)
    return points


@functools.lru_cache(maxsize=16)
def pld_interval(noise: float, rate: float, steps: int) -> float:
    """The grid the PLD accountant composes ``steps`` aggregations on: dp-accounting's default
    PLD_INTERVAL (1e-4) where one step's PLD has at most PLD_STEP_POINTS points and its
    composition at most PLD_POINTS, else the finest PLD_INTERVAL 2^k within both. The loss range,
    and with it the points, time and memory at a fixed grid, grows as 1 / z^2 and with the steps
    (z = 0.01, q = 1/3, 8 steps: 60 million points a step, minutes and gigabytes); the points'
    bound keeps every z and T to about a second and 100 MB. A coarser grid costs nothing in
    validity: dp-accounting's pessimistic connect-the-dots PLD (Doroshenko et al. 2022, "Connect
    the Dots") overestimates the hockey-stick divergence on any grid, so epsilon stays an upper
    bound; and little in tightness (z = 1, 1000 steps: 122.63930 at 1e-4, 122.63932 at 4e-4)."""
    interval = _coarsened(PLD_INTERVAL, pld_step_points(noise, rate, PLD_INTERVAL) / PLD_STEP_POINTS)
    for _ in range(8):  # the composed points scale as 1 / interval: one coarsening is all but always enough
        points = pld_composed_points(_one_step_pld(noise, rate, interval), steps)
        if points <= PLD_POINTS:
            break
        interval = _coarsened(interval, points / PLD_POINTS)
    return interval


def epsilon(noise: float, num_sampled: int, num_clients: int, steps: int, delta: float) -> float:
    """Epsilon at ``delta`` after ``steps`` aggregations of K = num_sampled of N = num_clients
    clients sampled without replacement, noise multiplier z = ``noise`` on the clipped sum:
    what dp-accounting's RdpAccountant gives for that many SampledWithoutReplacementDpEvent(N,
    K, GaussianDpEvent(z / 2)) under REPLACE_ONE (the accountant adds the one-step curve
    ``steps`` times, as here)."""
    if steps == 0:
        return 0.0
    if noise <= 0.0:
        return math.inf
    import dp_accounting
    orders, rdp = _one_step_rdp(float(noise), int(num_sampled), int(num_clients))
    return float(dp_accounting.rdp.compute_epsilon(orders, steps * rdp, delta)[0])


def poisson_epsilon(noise: float, rate: float, steps: int, delta: float, accountant: str = "pld") -> float:
    """Epsilon at ``delta`` after ``steps`` aggregations of a Poisson sample at rate q = ``rate``
    with noise multiplier z = ``noise``: what dp-accounting's PLDAccountant (``pld``) or
    RdpAccountant (``rdp``), both add/remove-one, give for PoissonSampledDpEvent(q,
    GaussianDpEvent(z)) composed ``steps`` times (the same one-step PLD self-composed, or RDP
    curve multiplied, as they do). PLD on the accountant's default grid (1e-4) unless that would
    exceed the grid's point bounds (small z, many steps), then on the coarser grid of
    ``pld_interval``: still an upper bound, within about a second and 100 MB for any z and steps."""
    if steps == 0:
        return 0.0
    if noise <= 0.0:
        return math.inf
    import dp_accounting
    noise, rate, steps = float(noise), float(rate), int(steps)
    if accountant == "pld":  # on dp-accounting's grid, coarser where it would take minutes (pld_interval)
        interval = pld_interval(noise, rate, steps)
        identity = dp_accounting.pld.privacy_loss_distribution.identity(value_discretization_interval=interval)
        composed = identity.compose(_one_step_pld(noise, rate, interval).self_compose(steps, _PLD_TAIL))
        return float(composed.get_epsilon_for_delta(delta))
    orders, rdp = _one_step_poisson_rdp(noise, rate)
    return float(dp_accounting.rdp.compute_epsilon(orders, steps * rdp, delta)[0])
