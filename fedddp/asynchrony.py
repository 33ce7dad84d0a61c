"""The simulated clock: how long each client's local training takes, and in async mode
(``run.mode = async``) who trains when, from which model version, as pure functions.

Speeds. Every client has a speed, seconds per local step, from ``data.client_speed``
(``client_speeds``): ``constant[:S]`` (S, default 1), ``uniform:A:B``, ``lognormal:SIGMA[:MEDIAN]``
(MEDIAN exp(SIGMA z), z standard normal; MEDIAN default 1), each drawn per (data.seed, client id)
on its own stream, or ``file:PATH`` (also a bare PATH ending in .csv or .json): a CSV of
``client_id,seconds_per_step`` rows (a header line is allowed) or a JSON object
``{"client_id": seconds_per_step}``, which must name every client 0..N-1 (ids past N are
ignored). A client's local training takes its planned steps x its speed; nothing else (no
communication, no server time) takes simulated time.

Sync mode. A round takes as long as its slowest reporting client (``sync_round_seconds``).

Async mode (FedBuff, Nguyen et al. 2022, with FedAsync's staleness weights, Xie et al. 2019).
``run.async_concurrency`` = C clients train at once. A free slot is filled at once from the idle
clients, drawn uniformly by a generator seeded by (run.seed, the start's number n = 1, 2, ...);
the client starts from the current model version v and arrives at now + its steps x its speed,
its steps drawn as a round's are (``participation.local_work``) with n in place of the round.
Arrivals are taken in order of (arrival time, start number). Every ``run.async_buffer`` = B
arrivals the server updates the model once: version v + 1. A client that has arrived is not idle
again until that update (it reports at most once per update, as in FedBuff, so an update's
clients are distinct); the slots it and the others free are filled after the update, from the
new version. The schedule depends only on the clock, never on training, so every rank computes it
alike; the round loop then trains each update's arrivals from the versions they started from
(``plan.FedBuffUpdates``). With B <= N (checked) the run never stalls: while the buffer is not full,
some client is either idle or training.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass

import torch

from .registry import ALGORITHMS, SERVER_RULES, resolve
from .sampling import _mix

_SPEED_STREAM = 0x5BEED
_PICK_STREAM = 0xA51C
_TRAIN_STREAM = 0xA5C1


# -- speeds -----------------------------------------------------------------------------------

def parse_speed(spec: str) -> tuple[str, list]:
    """``data.client_speed`` -> (kind, arguments): ("constant", [S]), ("uniform", [A, B]),
    ("lognormal", [SIGMA, MEDIAN]) or ("file", [PATH]). ValueError with the reason otherwise."""
    if spec.startswith("file:") or (":" not in spec and spec.endswith((".csv", ".json"))):
        path = spec.removeprefix("file:")
        if not path:
            raise ValueError("file: needs a path, e.g. file:speeds.csv")
        return "file", [path]
    kind, *words = spec.split(":")
    try:
        numbers = [float(w) for w in words]
    except ValueError:
        raise ValueError(f"{spec!r}: its numbers must be numbers") from None
    if not all(math.isfinite(x) for x in numbers):
        raise ValueError(f"{spec!r}: its numbers must be finite")
    if kind == "constant" and len(numbers) <= 1:
        args = numbers or [1.0]
        if args[0] <= 0:
            raise ValueError(f"constant:S needs S > 0 seconds per step, got {args[0]:g}")
        return kind, args
    if kind == "uniform" and len(numbers) == 2:
        if not 0 < numbers[0] <= numbers[1]:
            raise ValueError(f"uniform:A:B needs 0 < A <= B, got A = {numbers[0]:g}, B = {numbers[1]:g}")
        return kind, numbers
    if kind == "lognormal" and len(numbers) in (1, 2):
        args = numbers + [1.0] * (2 - len(numbers))
        if args[0] < 0 or args[1] <= 0:
            raise ValueError(f"lognormal:SIGMA[:MEDIAN] needs SIGMA >= 0 and MEDIAN > 0, got {spec!r}")
        return kind, args
    raise ValueError(f"{spec!r} is not constant[:S], uniform:A:B, lognormal:SIGMA[:MEDIAN] or file:PATH")


def read_speed_file(path: str, num_clients: int) -> list[float]:
    """Seconds per step of clients 0..num_clients-1 from a CSV (client_id,seconds_per_step) or a
    JSON object; ValueError naming the first problem."""
    try:
        with open(path) as fh:
            if path.endswith(".json"):
                table = json.load(fh)
                if not isinstance(table, dict):
                    raise ValueError(f"{path}: a JSON speed file is an object {{\"client_id\": seconds_per_step}}")
                pairs = list(table.items())
            else:
                rows = [r for r in csv.reader(fh) if r and not r[0].lstrip().startswith("#")]
                if rows and not rows[0][0].strip().lstrip("-").isdigit():
                    rows = rows[1:]  # a header line
                if any(len(r) < 2 for r in rows):
                    raise ValueError(f"{path}: every CSV row is client_id,seconds_per_step")
                pairs = [(r[0], r[1]) for r in rows]
    except OSError as exc:
        raise ValueError(f"cannot read {path} ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    speeds: dict[int, float] = {}
    for cid, seconds in pairs:
        try:
            cid = int(str(cid).strip())
            seconds = float(seconds)
        except (TypeError, ValueError):
            raise ValueError(f"{path}: {cid!r}: {seconds!r} is not client_id: seconds_per_step") from None
        except OverflowError:  # a JSON integer past a float's range
            seconds = math.inf
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"{path}: client {cid} has {seconds!r} seconds per step; each must be finite and > 0")
        speeds[cid] = seconds
    missing = [c for c in range(num_clients) if c not in speeds]
    if missing:
        shown = ", ".join(map(str, missing[:5])) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"{path} has no speed for client(s) {shown} of data.num_clients = {num_clients}")
    return [speeds[c] for c in range(num_clients)]


def client_speeds(spec: str, num_clients: int, data_seed: int) -> list[float]:
    """Each client's seconds per local step (see the module doc); ValueError for a bad spec,
    also for one that draws a client a speed a float cannot hold (0 or past its range)."""
    kind, args = parse_speed(spec)
    if kind == "file":
        return read_speed_file(args[0], num_clients)
    if kind == "constant":
        return [args[0]] * num_clients
    speeds = []
    for cid in range(num_clients):
        gen = torch.Generator().manual_seed(_mix(_SPEED_STREAM, data_seed, cid))
        if kind == "uniform":  # within [A, B], which parse_speed keeps positive and finite
            u = torch.rand((), generator=gen, dtype=torch.float64).item()
            speeds.append(args[0] + (args[1] - args[0]) * u)
        else:
            speeds.append(_lognormal(spec, cid, *args, torch.randn((), generator=gen, dtype=torch.float64).item()))
    return speeds


def _lognormal(spec: str, cid: int, sigma: float, median: float, z: float) -> float:
    """MEDIAN exp(SIGMA z), or ValueError where that leaves a float's range: a large SIGMA or an
    extreme MEDIAN overflows (math.exp raises OverflowError) or underflows to 0, and the
    simulated clock needs every speed > 0 and finite."""
    try:
        speed = median * math.exp(sigma * z)
    except OverflowError:
        speed = math.inf
    if not 0 < speed < math.inf:
        raise ValueError(f"{spec!r} draws client {cid} MEDIAN x exp(SIGMA z) = {median:g} x exp({sigma:g} x "
                         f"{z:.3g}) seconds per step, {'past' if speed else 'below'} a float's range; lower SIGMA "
                         "(or bring MEDIAN nearer 1) so that every client's speed is > 0 and finite")
    return speed


def sync_round_seconds(steps: list[int], speeds: list[float]) -> float:
    """A synchronous round's simulated length: its slowest client's steps x seconds per step (0
    without clients)."""
    return max((n * s for n, s in zip(steps, speeds)), default=0.0)


# -- the async schedule ---------------------------------------------------------------------

@dataclass(frozen=True)
class Flight:
    """One client's local training in async mode."""

    client: int
    start: int       # the run's start number (1, 2, ...): seeds its draw, its work and its training
    version: int     # the model version it trains from (server updates done when it started)
    start_s: float   # simulated seconds at its start
    finish_s: float  # and at its arrival


@dataclass(frozen=True)
class Clock:
    """The schedule's state between server updates: what a checkpoint keeps."""

    now_s: float = 0.0            # the simulated time of the last update
    version: int = 0              # server updates so far
    starts: int = 0               # clients started so far
    flights: tuple = ()           # the clients training now (Flight), none of them arrived yet


@dataclass(frozen=True)
class Schedule:
    """The fixed inputs of the schedule: N, C, B, run.seed, seconds per step of each client, and
    ``steps(client, start number) -> int``, a client's planned local steps for that start."""

    num_clients: int
    concurrency: int
    buffer: int
    seed: int
    speeds: tuple
    steps: object

    def duration(self, client: int, start: int) -> float:
        return self.steps(client, start) * self.speeds[client]


def _kth_idle(k: int, busy_sorted: list[int]) -> int:
    """The k-th (from 0) client id not in ``busy_sorted`` (ascending)."""
    for b in busy_sorted:
        if b > k:
            break
        k += 1
    return k


def pick(seed: int, start: int, num_idle: int) -> int:
    """Which of the idle clients (their index in id order) the start number ``start`` takes."""
    gen = torch.Generator().manual_seed(_mix(_PICK_STREAM, seed, start))
    return int(torch.randint(num_idle, (1,), generator=gen).item())


def _fill(flights: list[Flight], arrived: list[Flight], now: float, version: int, starts: int,
          sched: Schedule) -> int:
    """Start idle clients at ``now`` from ``version`` until C train or none is idle; returns the
    start count."""
    busy = sorted({f.client for f in flights} | {a.client for a in arrived})
    while len(flights) < sched.concurrency and len(busy) < sched.num_clients:
        starts += 1
        cid = _kth_idle(pick(sched.seed, starts, sched.num_clients - len(busy)), busy)
        flights.append(Flight(cid, starts, version, now, now + sched.duration(cid, starts)))
        busy = sorted(busy + [cid])
    return starts


def next_update(clock: Clock, sched: Schedule) -> tuple[list[Flight], Clock]:
    """The clients of the next server update (in arrival order) and the clock after it. Free
    slots are filled first (at the last update's time, from its version), then arrivals are
    taken one by one, each freed slot filled at that arrival, until the buffer holds B."""
    flights, arrived, now = list(clock.flights), [], clock.now_s
    starts = _fill(flights, arrived, now, clock.version, clock.starts, sched)
    while len(arrived) < sched.buffer:
        first = min(flights, key=lambda f: (f.finish_s, f.start))
        flights.remove(first)
        arrived.append(first)
        now = first.finish_s
        if len(arrived) < sched.buffer:
            starts = _fill(flights, arrived, now, clock.version, starts, sched)
    return arrived, Clock(now, clock.version + 1, starts, tuple(sorted(flights, key=lambda f: f.start)))


def staleness_weight(tau: int, kind: str, exponent: float) -> float:
    """s(tau): 1 (constant), or FedAsync's polynomial (1 + tau)^-a (FedBuff's experiments: a = 1/2)."""
    return 1.0 if kind == "constant" else (1.0 + tau) ** -exponent


def training_seed(seed: int, start: int, client: int) -> int:
    """The seed of a client's training started as start number ``start`` (batches, dropout)."""
    return _mix(_TRAIN_STREAM, seed, start, client)


def buffered_rows_(params_KP: torch.Tensor, bases: list[torch.Tensor], global_P: torch.Tensor,
                   weights: list[float]) -> None:
    """Rewrites each trained model w_k in place as w + s_k (w_k - w_{v_k}), so that FedAvg's
    server step over the rows, w + eta (sum_k p_k x_k - w), is FedBuff's
    w + eta sum_k p_k s_k (w_k - w_{v_k}) (the p_k sum to 1)."""
    for k, (base, s) in enumerate(zip(bases, weights)):
        row = params_KP[k]
        row.sub_(base)
        if s != 1.0:
            row.mul_(s)
        row.add_(global_P)


def update_record(before: Clock, after: Clock, ordered: list[Flight]) -> dict:
    """An update's keys for the round's rows: the simulated clock and the staleness for
    metrics.jsonl, and per client (``..._K``, rows in ``ordered``'s client-id order) for
    clients.jsonl: its staleness, the model version it trained from, when it started and arrived."""
    tau = [before.version - f.version for f in ordered]
    return {"sim_round_s": after.now_s - before.now_s, "sim_time_s": after.now_s,
            "staleness_mean": sum(tau) / len(tau), "staleness_max": max(tau),
            "staleness_K": torch.tensor(tau), "start_version_K": torch.tensor([f.version for f in ordered]),
            "start_s_K": torch.tensor([f.start_s for f in ordered], dtype=torch.float64),
            "arrive_s_K": torch.tensor([f.finish_s for f in ordered], dtype=torch.float64)}


# -- checkpoint form ------------------------------------------------------------------------

def saved(clock: Clock, versions: dict[int, torch.Tensor]) -> dict:
    """The clock and the model versions its training clients started from, for server.pt."""
    ids = sorted(versions)
    return {"now_s": clock.now_s, "version": clock.version, "starts": clock.starts,
            "flights": [[f.client, f.start, f.version, f.start_s, f.finish_s] for f in clock.flights],
            "version_ids": ids,
            "versions": torch.stack([versions[v].cpu() for v in ids]) if ids else torch.empty(0)}


def restored(entry: dict, device) -> tuple[Clock, dict[int, torch.Tensor]]:
    flights = tuple(Flight(int(c), int(n), int(v), float(a), float(b)) for c, n, v, a, b in entry["flights"])
    clock = Clock(float(entry["now_s"]), int(entry["version"]), int(entry["starts"]), flights)
    return clock, {v: entry["versions"][i].to(device) for i, v in enumerate(entry["version_ids"])}


# -- configuration --------------------------------------------------------------------------

def concurrency(cfg) -> int:
    """C: run.async_concurrency, or the sampled K when it is 0."""
    return cfg.run.async_concurrency or cfg.num_sampled()


def allowed_algorithms() -> list[str]:
    """The algorithm names async mode runs: those whose server rule's step is FedAvg's
    (Strategy.buffered: FedBuff applies that step to its buffered updates)."""
    return sorted(name for name, (_, server) in ALGORITHMS.items() if _buffered(server))


def _buffered(server: str) -> bool:
    return getattr(SERVER_RULES.get(server), "buffered", False)


def check(cfg) -> list[str]:
    """Configuration errors of data.client_speed and the async keys, each one line naming its key."""
    errors = []
    try:  # every client's speed, as the run draws them: a spec whose draws are unusable is refused here
        client_speeds(cfg.data.client_speed, cfg.data.num_clients, cfg.data.seed)
    except ValueError as exc:
        errors.append(f"data.client_speed: {exc}")
    rc, n = cfg.run, cfg.data.num_clients
    if rc.mode != "async":  # the async keys are read in async mode only
        return errors
    if not 0 <= rc.async_concurrency <= n:
        errors.append(f"run.async_concurrency: must be in [0, data.num_clients = {n}] (0: the sampled K), "
                      f"got {rc.async_concurrency}")
    if not 1 <= rc.async_buffer <= n:
        errors.append(f"run.async_buffer: must be in [1, data.num_clients = {n}] (a client reports at most "
                      f"once per update), got {rc.async_buffer}")
    if rc.async_staleness_exponent < 0:
        errors.append(f"run.async_staleness_exponent: must be >= 0, got {rc.async_staleness_exponent}")
    try:
        server = resolve(cfg.algorithm)[1]
    except KeyError:
        return errors  # an unknown algorithm is said by its own check
    if not _buffered(server):
        errors.append(f"run.mode: async runs FedBuff's rule on FedAvg's server step; algorithm.name = "
                      f"{cfg.algorithm.name} has the {server} server rule; async runs "
                      f"{', '.join(allowed_algorithms())} (or set run.mode=sync)")
    if rc.parallel_clients not in (1, "auto"):  # auto is 1 in async mode (client/parallel.py)
        errors.append("run.parallel_clients: async mode trains each client from the model version it "
                      "started from, one after another; set run.parallel_clients=1 (or run.mode=sync)")
    if rc.sampling == "poisson":
        errors.append("run.sampling: async mode starts a client whenever a slot frees (run.async_concurrency), "
                      "so there is no round's sample to draw; set run.sampling=auto (or run.mode=sync)")
    if rc.dropout > 0 or rc.deadline_steps > 0:
        errors.append("run.mode: async models slow clients by data.client_speed, not by run.dropout or "
                      "run.deadline_steps; set both to 0 (or run.mode=sync)")
    return errors
