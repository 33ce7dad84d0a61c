"""Who does what in a round, and the two schedules the round loop runs: ``SyncRounds`` (each
round samples its cohort) and ``FedBuffUpdates`` (run.mode = async: each round is one buffered
server update of the clients that arrive on the simulated clock).

A schedule plans each round identically on every rank without communication, says whether the
round reports the privacy spent, turns the arrivals' rows into updates (FedBuff) and keeps the
simulated clock, which a checkpoint saves and a resume restores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import asynchrony, participation
from .config import Cohort, RunConfig, TrainConfig
from .client import planned_steps
from .sampling import assign_clients, assign_groups, layout_rows, sample_clients, sample_poisson


@dataclass
class ClientStart:
    """Where an async client's training starts: the model version it started from (its round:
    that version + 1, for the learning-rate schedule) and its seed."""

    round_idx: int
    global_P: torch.Tensor
    seed: int


@dataclass
class RoundPlan:
    """Who does what in a round: drawn identically on every rank, without communication."""

    round_idx: int
    sampled: list[int]            # the K sampled clients, sorted
    reporting: list[int]          # those that did not drop out
    per_rank: list[list[int]]     # the reporting clients each rank trains
    groups: list[list[int]]       # this rank's clients, one training call a group
    rows_per_rank: int            # report rows per rank, padding included
    row_order: list[int]          # gathered rows -> client-id order
    work_of: dict[int, int]       # each reporting client's local epochs (steps) this round
    steps_of: dict[int, int]      # and its planned optimizer steps
    deadline_steps: int           # run.deadline_steps (0: none)
    # async mode: each client's start (the model version it trains from, its seed); None: the
    # round's model and client_seed(seed, round, client) for every client
    starts: dict[int, ClientStart] | None = None

    def straggles(self, cid: int) -> bool:
        """A client past the deadline does not train; its state stays home."""
        return bool(self.deadline_steps) and self.steps_of[cid] > self.deadline_steps


def plan_round(rc: RunConfig, tc: TrainConfig, cohort: Cohort, round_idx: int, num_samples: list[int],
               cost_K: list[int], rank: int, world_size: int, balanced: bool) -> RoundPlan:
    """sample -> drop -> assign: the round's clients, who trains them and their report rows
    (``rc``, ``tc``: the run's and the local training's settings)."""
    if cohort.poisson:  # each client with probability q: the cohort may be empty
        sampled = sample_poisson(cohort.num_clients, cohort.rate, rc.seed, round_idx)
    else:
        sampled = sample_clients(cohort.num_clients, cohort.num_sampled, rc.seed, round_idx)
    reporting = [c for c in sampled if not participation.drops_out(rc.dropout, rc.seed, round_idx, c)]
    if rc.parallel_clients > 1:  # groups trained side by side, cut whatever the world size
        per_rank, groups_R = assign_groups(reporting, cost_K.__getitem__, world_size, balanced, rc.parallel_clients)
        groups = groups_R[rank]
    else:
        per_rank = assign_clients(reporting, cost_K.__getitem__, world_size, balanced)
        groups = [[c] for c in per_rank[rank]]
    rows_per_rank, row_order = layout_rows(reporting, world_size, per_rank)
    # every reporting client's work and steps, alike on every rank, so all agree on the stragglers
    work_of = {c: participation.local_work(tc, rc.seed, round_idx, c) for c in reporting}
    steps_of = {c: planned_steps(num_samples[c], tc, work_of[c]) for c in reporting}
    return RoundPlan(round_idx, sampled, reporting, per_rank, groups, rows_per_rank, row_order, work_of, steps_of,
                     rc.deadline_steps)


def evaluates(rc, round_idx: int) -> bool:
    """Every run.eval_every rounds and at the last (``rc``: the RunConfig)."""
    return not round_idx % rc.eval_every or round_idx == rc.rounds


def describe(rc: RunConfig, cohort: Cohort) -> str:
    """The start line's words on who trains when: K of N a round, Poisson sampling, or async."""
    return schedule_class(rc).words(rc, cohort)


class SyncRounds:
    """Synchronous rounds: each samples its cohort afresh; the simulated clock advances by the
    slowest client that trained and reported."""

    def __init__(self, rc: RunConfig, tc: TrainConfig, cohort: Cohort, num_samples: list[int], cost_K: list[int],
                 speeds: list[float], comm, balanced: bool):
        self.rc, self.tc, self.cohort = rc, tc, cohort
        self.num_samples, self.cost_K, self.speeds = num_samples, cost_K, speeds
        self.rank, self.world_size, self.balanced = comm.rank, comm.world_size, balanced
        self.sim_time_s = 0.0  # the simulated clock after the last round

    @staticmethod
    def words(rc: RunConfig, cohort: Cohort) -> str:
        if cohort.poisson:
            return f"each of {cohort.num_clients} clients a round with probability {cohort.rate:g} (Poisson sampling)"
        return f"{cohort.num_sampled} of {cohort.num_clients} clients a round"

    def plan(self, round_idx: int, global_P: torch.Tensor) -> RoundPlan:
        return plan_round(self.rc, self.tc, self.cohort, round_idx, self.num_samples, self.cost_K, self.rank,
                          self.world_size, self.balanced)

    def reporting(self, round_idx: int) -> bool:
        """Whether the round writes the privacy spent: the rounds that evaluate."""
        return evaluates(self.rc, round_idx)

    def arrived(self, is_main: bool, rows, report, global_P: torch.Tensor) -> dict:
        return {}

    def advanced(self, plan: RoundPlan) -> dict:
        """metrics.jsonl's simulated clock: the round's length and the time after it."""
        round_s = self._round_seconds(plan)
        self.sim_time_s += round_s
        return {"sim_round_s": round_s, "sim_time_s": self.sim_time_s}

    def _round_seconds(self, plan: RoundPlan) -> float:
        """A round's simulated length: the slowest client that trained and reported (dropouts and
        stragglers are not waited for), its planned steps x its seconds per step."""
        trained = [c for c in plan.reporting if not plan.straggles(c)]
        return asynchrony.sync_round_seconds([plan.steps_of[c] for c in trained], [self.speeds[c] for c in trained])

    def saved(self) -> dict:
        return {"sim_time_s": self.sim_time_s}

    def restore(self, saved: dict, start_round: int, device) -> None:
        """The clock of a checkpoint; replayed from the rounds' plans (no training) for a
        checkpoint written before it was kept."""
        if "sim_time_s" in saved:
            self.sim_time_s = float(saved["sim_time_s"])
            return
        for r in range(1, start_round):
            self.sim_time_s += self._round_seconds(self.plan(r, None))


class FedBuffUpdates:
    """run.mode = async: each round is one server update of FedBuff. The schedule
    (asynchrony.next_update) says which clients arrive and from which model version each started;
    they train from those versions (kept while a training client refers to one), rank 0 turns
    their models into staleness-weighted updates and FedAvg's server step applies them."""

    def __init__(self, rc: RunConfig, tc: TrainConfig, cohort: Cohort, num_samples: list[int], cost_K: list[int],
                 speeds: list[float], comm, balanced: bool):
        self.rc, self.tc, self.num_samples, self.cost_K = rc, tc, num_samples, cost_K
        self.rank, self.world_size, self.balanced = comm.rank, comm.world_size, balanced
        self.sched = asynchrony.Schedule(cohort.num_clients, asynchrony.concurrency(rc, cohort.num_sampled),
                                         rc.async_buffer, rc.seed, tuple(speeds),
                                         lambda cid, start: self._steps(cid, start)[1])
        self.clock = asynchrony.Clock()   # the schedule after the last update
        self.versions: dict[int, torch.Tensor] = {}  # the model versions training clients started from
        self.before: asynchrony.Clock | None = None   # this update's: the clock before it, its arrivals
        self.arrivals: list = []

    @staticmethod
    def words(rc: RunConfig, cohort: Cohort) -> str:
        staleness = (f"(1 + tau)^-{rc.async_staleness_exponent:g}" if rc.async_staleness == "polynomial"
                     else "constant")
        return (f"async (FedBuff): {asynchrony.concurrency(rc, cohort.num_sampled)} of {cohort.num_clients} "
                f"clients training at once on the simulated clock, a server update every {rc.async_buffer} "
                f"arrivals, staleness weight {staleness}")

    @property
    def sim_time_s(self) -> float:
        return self.clock.now_s

    def _steps(self, cid: int, start: int) -> tuple[int, int]:
        """(local epochs or steps drawn, planned optimizer steps) of a client's training started as
        start number ``start``: drawn as a round's work is, with the start number in place of the
        round."""
        work = participation.local_work(self.tc, self.rc.seed, start, cid)
        return work, planned_steps(self.num_samples[cid], self.tc, work)

    def plan(self, round_idx: int, global_P: torch.Tensor) -> RoundPlan:
        """An update as a round's plan: its arrivals are the reporting clients (distinct, in
        client-id order, assigned to ranks by cost as a round's), each trained from the model
        version it started from, with the seed of its start."""
        self.before = self.clock
        self.versions[self.before.version] = global_P.clone()  # clients may start from it in this update
        self.arrivals, self.clock = asynchrony.next_update(self.before, self.sched)
        of = {f.client: f for f in self.arrivals}
        clients = sorted(of)
        per_rank = assign_clients(clients, self.cost_K.__getitem__, self.world_size, self.balanced)
        rows_per_rank, row_order = layout_rows(clients, self.world_size, per_rank)
        drawn = {c: self._steps(c, of[c].start) for c in clients}
        starts = {c: ClientStart(of[c].version + 1, self.versions[of[c].version],
                                 asynchrony.training_seed(self.rc.seed, of[c].start, c)) for c in clients}
        return RoundPlan(round_idx, clients, clients, per_rank, [[c] for c in per_rank[self.rank]], rows_per_rank,
                         row_order, {c: w for c, (w, _) in drawn.items()}, {c: n for c, (_, n) in drawn.items()}, 0,
                         starts)

    def reporting(self, round_idx: int) -> bool:
        return True

    def arrived(self, is_main: bool, rows_KF, report, global_P: torch.Tensor) -> dict:
        """FedBuff through FedAvg's server step: on rank 0 each arrival's model w_k becomes
        w + s(tau_k) (w_k - w_{v_k}) in its row (asynchrony.buffered_rows_), tau_k = the versions
        since it started. Returns the update's simulated clock and staleness for metrics.jsonl
        and, per client in client-id order, for clients.jsonl."""
        rc, before = self.rc, self.before
        ordered = sorted(self.arrivals, key=lambda f: f.client)
        if is_main:
            weights = [asynchrony.staleness_weight(before.version - f.version, rc.async_staleness,
                                                   rc.async_staleness_exponent) for f in ordered]
            asynchrony.buffered_rows_(rows_KF[:, report.slices["params_KP"]],
                                      [self.versions[f.version] for f in ordered], global_P, weights)
        return asynchrony.update_record(before, self.clock, ordered)

    def advanced(self, plan: RoundPlan) -> dict:
        """Forgets the model versions no training client refers to any more."""
        in_flight = {f.version for f in self.clock.flights}
        self.versions = {v: P for v, P in self.versions.items() if v in in_flight}
        return {}

    def saved(self) -> dict:
        """The clock, its training clients and their versions, for server.pt."""
        return {"sim_time_s": self.sim_time_s, "async": asynchrony.saved(self.clock, self.versions)}

    def restore(self, saved: dict, start_round: int, device) -> None:
        self.clock, self.versions = asynchrony.restored(saved["async"], device)


def schedule_class(rc: RunConfig) -> type[SyncRounds] | type[FedBuffUpdates]:
    """The one place run.mode is read: the run's schedule, chosen once at setup."""
    return FedBuffUpdates if rc.mode == "async" else SyncRounds


def schedule_of(rc: RunConfig, *args) -> SyncRounds | FedBuffUpdates:
    """The run's schedule. ``args``: the schedules' after ``rc``."""
    return schedule_class(rc)(rc, *args)
