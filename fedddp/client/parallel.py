"""How many clients a rank trains side by side: ``run.parallel_clients = auto`` resolved when the
run starts, and whether side by side pays on this CPU (the start line's warning).

Legend: B clients side by side, L clients of a group still stepping, P flat elements.

Each decision is a pure function of figures (tested with given ones), beside the measurement
that feeds it in a run:

- ``auto`` on CPU is 1, without a measurement: one after another is the reference, so every
  result stays bitwise what it was when 1 was the default, and a run's bits never depend on
  how loaded the machine was when it started. Side by side pays on CPU only for small models
  whose clients take similar numbers of steps (docs/running.md); set B for those.
- ``auto`` on CUDA: B from the device's free memory and the model's footprint per client,
  measured by one side-by-side step of groups of one and two clients (``cuda_footprint``;
  ``batch_from_memory`` decides), agreed by every rank (the smallest), at most the clients a
  rank trains in a round; 1 where side by side cannot run (a local rule, optimizer or model
  it does not batch) or the probe fails. ``cuda_footprint`` needs a GPU and is not tested
  here; the choice around it is, with given figures.
- ``auto`` on resume: the B the checkpoint ran with (its run identity holds the resolved B),
  so a resumed run neither is refused on another machine nor changes its bits mid-run.
- B > 1 on CPU (set by hand): ``measure_cpu`` times the first group of rank 0 both ways on
  copies (one step and three steps of each path, so a call's fixed cost and the cost of a step
  come apart; a few repeats, medians); ``predict`` turns the timings into a group's round time
  both ways from its clients' planned steps (side by side a step costs what the clients still
  stepping cost: the client with the most steps ends the group's round stepping alone, at a
  side-by-side step's price); ``cpu_verdict`` sums that over rank 0's groups of the first
  rounds and says in the start line how the two compare, with a warning when one after another
  is faster. The copies train with the plain rule, their own model and generators: the run's
  model, data, global random generator and result bits are untouched.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass, replace

import torch

from .. import strategies
from ..data import ClientData, LazyClients
from ..errors import ConfigError
from . import ClientContext, LocalTraining, train_client
from . import batched
from . import rules

AUTO = "auto"
SLOWER = 1.1        # the start line warns when side by side is predicted this much slower
PROBE_STEPS = (1, 3)  # local steps of the timed probes: their difference is the cost of a step
PROBE_CLIENTS = 8   # at most this many clients in the timed side-by-side probe (more: extrapolated)
PROBE_SEQUENTIAL = 3  # at most this many clients timed one after another
PROBE_REPEATS = 3   # timed repeats, unless the budget is spent first
PROBE_BUDGET_S = 3.0
MEMORY_USE = 0.8    # of the device's free memory, for the groups side by side
EXTRA_COPIES = 3    # parameter copies a client's local rule may add (SCAFFOLD, MOON, FedSMOO)


# -- decisions: pure functions of measured figures ----------------------------------------------

@dataclass
class Timings:
    """One client's cost one after another (a fixed cost per round and a cost per step) and a
    group's side by side: its fixed cost and the cost of a step with L clients stepping, measured
    at L = 1 and L = ``probe_clients`` (between and beyond: a straight line)."""

    one_call_s: float
    one_step_s: float
    side_call_s: float
    side_step_one_s: float
    side_step_many_s: float
    probe_clients: int

    def side_step_s(self, live: int) -> float:
        if self.probe_clients <= 1:
            return self.side_step_one_s * live  # nothing to draw the line through: as if one by one
        slope = (self.side_step_many_s - self.side_step_one_s) / (self.probe_clients - 1)
        return max(self.side_step_one_s + slope * (live - 1), 0.0)


def predict(t: Timings, steps_B: list[int]) -> tuple[float, float]:
    """(one after another, side by side): predicted seconds of a group whose clients take
    ``steps_B`` local steps. Side by side a client that has taken its steps leaves the group, so
    a step costs what the clients still stepping cost."""
    sequential = sum(t.one_call_s + s * t.one_step_s for s in steps_B)
    side, done = t.side_call_s, 0
    live = len(steps_B)
    for s in sorted(steps_B):  # between two clients' ends the number stepping is constant
        side += (s - done) * t.side_step_s(live)
        done, live = s, live - 1
    return sequential, side


def cpu_verdict(t: Timings, groups: list[list[int]], rounds: str, compiled: bool = False) -> tuple[bool, str]:
    """(one after another is faster, the start line's words) on CPU: the timings applied to
    ``groups`` (each the planned steps of a group's clients; rank 0's groups of ``rounds``).
    ``compiled``: the run compiles its side-by-side step (run.compile), which the timings, of
    eager steps, do not cover: the words say so and give no advice."""
    sequential = side = 0.0
    for steps_B in groups:
        one, many = predict(t, steps_B)
        sequential, side = sequential + one, side + many
    what = (f"rank 0's groups of {rounds} predicted from one group timed both ways: {side:.2f} s side by side, "
            f"{sequential:.2f} s one after another")
    if compiled:  # the warm-up's figure of the compiled step against the eager one follows in the line
        return side > SLOWER * sequential, (f"eager side by side {side / sequential:.2f}x the time of one after "
                                            f"another ({what}, eager steps; run.compile's step is timed against "
                                            f"the eager one in the warm-up)")
    if side > SLOWER * sequential:
        return True, (f"WARNING: side by side is {side / sequential:.1f}x slower than one after another on this "
                      f"CPU ({what}): run.parallel_clients=1 is faster here (docs/running.md)")
    if sequential > SLOWER * side:
        return False, f"{sequential / side:.1f}x faster than one after another ({what})"
    return False, f"about as fast as one after another ({what})"


def batch_from_memory(free_bytes: float, per_client_bytes: float, fixed_bytes: float, max_clients: int,
                      use: float = MEMORY_USE) -> int:
    """B for CUDA: as many clients as fit in ``use`` of the free memory after ``fixed_bytes`` (a
    group's own cost, data still to come), at most ``max_clients`` (the clients a rank trains in
    a round), else rounded down to a power of two (small changes of free memory then seldom
    change B); 1 when fewer than two fit."""
    room = free_bytes * use - fixed_bytes
    fit = max_clients if per_client_bytes <= 0 else int(room // per_client_bytes)
    b = min(fit, max_clients)
    if b < 2:
        return 1
    return b if b == max_clients else 1 << (b.bit_length() - 1)


def clients_per_rank(num_sampled: int, world_size: int) -> int:
    """The most clients a rank trains in a round (``num_sampled``: K): more side by side would
    leave ranks idle."""
    return max(1, math.ceil(num_sampled / world_size))


# -- resolving auto ----------------------------------------------------------------------------

def resolve(cfg, comm, model, layout, data, ids, task, resumed: int | None = None) -> tuple[int, str]:
    """(B, the start line's words for it): the B this run uses for ``cfg.run.parallel_clients``
    (auto resolved; the caller builds the run's config with it). ``resumed``: the B of the
    checkpoint the run resumes from (None: a fresh start). ``data``: the run's FederatedData (its
    train mapping holding ``ids``). Every rank calls it; on CUDA auto the ranks agree on B with
    one all-reduce."""
    rc = cfg.run
    if rc.parallel_clients != AUTO:
        b = rc.parallel_clients
        return b, "clients one after another" if b == 1 else f"clients up to {b} side by side"
    if resumed is not None:
        return int(resumed), (f"clients {_mode(resumed)} (run.parallel_clients=auto: the checkpoint's B = "
                              f"{resumed}, part of the run's identity)")
    if rc.mode == "async":
        return 1, "clients one after another (run.parallel_clients=auto: 1 in async mode)"
    if comm.device.type != "cuda":
        return 1, ("clients one after another (run.parallel_clients=auto: 1 on CPU, the reference; side by "
                   "side pays on CPU only for small models with even clients, docs/running.md)")
    try:
        b, why = _cuda_choice(LocalTraining.of(cfg, 2), cfg.model, cfg.num_sampled(), comm, model, layout, data,
                              ids, task)
    except Exception as exc:  # noqa: BLE001 - an optional probe: the other ranks wait at the all-reduce
        first = (str(exc).splitlines() or [""])[0]
        b, why = 1, f"the side-by-side probe failed: {type(exc).__name__}: {first}"
    mine = torch.zeros(comm.world_size, dtype=torch.float64, device=comm.device)
    mine[comm.rank] = b
    comm.all_reduce_sum_(mine)  # every rank's choice: they must cut the same groups
    agreed = int(mine.min().item())
    if agreed != b:
        why += f"; another rank fits only {agreed}"
    return agreed, f"clients {_mode(agreed)} (run.parallel_clients=auto: {why})"


def _mode(b: int) -> str:
    return "one after another" if b == 1 else f"up to {b} side by side"


def _cuda_choice(training: LocalTraining, mc, num_sampled: int, comm, model, layout, data, ids,
                 task) -> tuple[int, str]:
    """This rank's B on CUDA and why (``training`` at B = 2, ``mc`` the model section,
    ``num_sampled`` K); 1 where side by side cannot run or the probe fails."""
    reasons = batched.check(2, training.hp, training.train, mc)
    if reasons:
        return 1, _why(reasons[0])
    sizes = {c: data.num_samples[c] for c in ids if data.num_samples[c]}
    if not sizes:
        return 1, "no client has samples"
    try:
        probe = batched.BatchedTrainer(model, layout, training, rules.LocalRule(), strategies.ALWAYS, task)
        probe.try_first_client(data.train, data.num_samples, ids)
        largest = data.train[max(sizes, key=sizes.get)]
        per_client, group = cuda_footprint(model, layout, training, task, largest, comm.device)
    except ConfigError as exc:
        return 1, _why(str(exc))
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return 1, "two clients side by side do not fit in the device's memory"
    per_client += EXTRA_COPIES * layout.numel * 4
    free, _ = torch.cuda.mem_get_info(comm.device)
    pending = _pending_data_bytes(data, largest) if isinstance(data.train, LazyClients) else 0
    cap = clients_per_rank(num_sampled, comm.world_size)
    b = batch_from_memory(free, per_client, group + pending, cap)
    gib = 2.0 ** 30
    return b, (f"{per_client / gib:.2f} GiB a client, {free / gib:.1f} GiB free, at most {cap} clients a rank "
               "a round")


def _why(refusal: str) -> str:
    """A refusal of side by side (batched.check, BatchedTrainer) as the reason auto chose 1."""
    return refusal.removeprefix("run.parallel_clients: ").split("; set run.parallel_clients")[0]


def _pending_data_bytes(data, sample: ClientData) -> int:
    """The training data a rank may still put on the device: made on first use, any rank may
    train any client (and evaluate its held-out samples, data.client_test_fraction)."""
    per_sample = sample.x[0].numel() * sample.x.element_size() + sample.y[0].numel() * sample.y.element_size()
    return (sum(data.num_samples) + sum(data.num_held_out)) * per_sample


def _probe(training: LocalTraining, steps: int) -> LocalTraining:
    """``training`` for a probe: ``steps`` local steps, eager (run.compile would time its
    compilation), groups unpadded."""
    return replace(training, train=replace(training.train, local_steps=steps), compile=False, clients=1)


def cuda_footprint(model, layout, training: LocalTraining, task, data: ClientData, device) -> tuple[int, int]:
    """(bytes a client adds side by side, bytes of a group of one): the peak memory of one step
    of groups of one and of two copies of ``data``'s client, trained on a copy of the model."""
    probe_model = copy.deepcopy(model)
    global_P = layout.flatten(probe_model).clone()
    trainer = batched.BatchedTrainer(probe_model, layout, _probe(training, 1), rules.LocalRule(),
                                     strategies.ALWAYS, task)
    peaks = []
    with torch.random.fork_rng(devices=[device]):
        for size in (1, 2):
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            trainer.train_group(_group(global_P, layout, training.hp, task, [data] * size))
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_allocated(device) - base)
    del trainer, probe_model
    torch.cuda.empty_cache()
    return max(peaks[1] - peaks[0], 1), peaks[0]


# -- the CPU measurement ------------------------------------------------------------------------

def _group(global_P, layout, hp, task, clients: list[ClientData]) -> list[tuple]:
    """A probe group: (context, data, seed, work, report views) per client, nothing of the run's
    (``hp``: the AlgorithmConfig)."""
    return [(ClientContext(i, 1, global_P, layout, hp, task=task), d, i, 0,
             {"params_P": torch.empty_like(global_P)}) for i, d in enumerate(clients)]


def measure_cpu(model, layout, training: LocalTraining, task, clients: list[ClientData], global_P,
                budget_s: float = PROBE_BUDGET_S) -> Timings:
    """Time ``clients`` (a group's, with samples) one after another and side by side on copies
    of the model, with the plain rule and the run's optimizer, at 1 and 3 local steps; the
    global random generator is restored after. Medians over up to PROBE_REPEATS repeats, fewer
    once ``budget_s`` is spent (after one warm-up and one timed repeat)."""
    plain, needs = rules.LocalRule(), strategies.ALWAYS
    probe_model = copy.deepcopy(model)
    side_clients = clients[:PROBE_CLIENTS]
    trainings = {k: _probe(training, k) for k in PROBE_STEPS}
    trainers = {k: batched.BatchedTrainer(probe_model, layout, trainings[k], plain, needs, task) for k in PROBE_STEPS}

    def one_after_another(k: int, d: ClientData) -> float:
        layout.unflatten_into(global_P, probe_model)
        ctx = ClientContext(0, 1, global_P, layout, training.hp, task=task)
        start = time.perf_counter()
        train_client(probe_model, ctx, d, trainings[k], plain, needs, 0, {"params_P": torch.empty_like(global_P)})
        return time.perf_counter() - start

    def side_by_side(k: int, group: list[ClientData]) -> float:
        start = time.perf_counter()
        trainers[k].train_group(_group(global_P, layout, training.hp, task, group))
        return time.perf_counter() - start

    probes = {("one", k): (lambda k=k: statistics.median(one_after_another(k, d)
                                                         for d in clients[:PROBE_SEQUENTIAL]))
              for k in PROBE_STEPS}
    probes |= {("many", k): (lambda k=k: side_by_side(k, side_clients)) for k in PROBE_STEPS}
    probes |= {("single", k): (lambda k=k: side_by_side(k, side_clients[:1])) for k in PROBE_STEPS}
    seconds = {key: [] for key in probes}
    with torch.random.fork_rng(devices=[]):
        for probe in probes.values():  # warm-up: first calls, allocations
            probe()
        start = time.perf_counter()
        for repeat in range(PROBE_REPEATS):
            for key, probe in probes.items():
                seconds[key].append(probe())
            if time.perf_counter() - start > budget_s:
                break
    med = {key: statistics.median(values) for key, values in seconds.items()}
    lo, hi = PROBE_STEPS

    def split(kind: str) -> tuple[float, float]:  # (fixed cost, cost per step)
        step = max((med[(kind, hi)] - med[(kind, lo)]) / (hi - lo), 1e-9)
        return max(med[(kind, lo)] - lo * step, 0.0), step

    one_call, one_step = split("one")
    side_call, many_step = split("many")
    _, single_step = split("single")
    return Timings(one_call, one_step, side_call, single_step, many_step, len(side_clients))
