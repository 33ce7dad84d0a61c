"""The round loop: setup, then synchronous rounds (``_run``) or FedBuff updates (``_run_async``).

Legend: K sampled clients, P flat elements, M report rows per rank, F floats per report row.

Rounds are counted from 1. Every rank runs this same function; rank 0 also aggregates, writes
metrics, checkpoints' server part and final.pt.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass

import torch

from . import (asynchrony, callbacks, checkpoint, client_eval, config, logs, outdir, participation, strategies,
               tasks, warmup)
from .algorithms import build_model, describe as describe_algorithm, sampling_of
from .client import ClientContext, check_one_sample_batches, planned_steps, train_client
from .client import parallel, precision, rules as local_rules
from .client.batched import BatchedTrainer, try_side_by_side
from .client.state import fetch as fetch_client_states, open_store as open_client_states, send_home
from .data import ClientData, LazyClients, build as build_data
from .data.build import BUILT_WHOLE
from .errors import ConfigError, DataError, DivergenceError, PluginError, UserError
from .flat import FlatLayout
from .registry import resolve
from .sampling import (assign_clients, assign_groups, client_seed, expected_cost, layout_rows, owned_clients, owner,
                       sample_clients, sample_poisson, travelling)
from .sharded import ShardedServer

# Report fields: (stack name, per-client key in the report, size in floats given P and L).
VECTOR_FIELDS = (("last_grad_KP", "last_grad_P"), ("full_grad_KP", "full_grad_P"),
                 ("control_delta_KP", "control_delta_P"), ("perturb_dual_KP", "perturb_dual_P"))
# train_time_K (seconds each client trained) rides along so rank 0 can tell local training on
# the slowest rank from communication without another collective.
SCALAR_FIELDS = (("num_samples_K", "num_samples"), ("train_loss_K", "train_loss"), ("train_time_K", "train_time"),
                 ("num_steps_K", "num_steps"), ("full_loss_K", "full_loss"))


# num_steps_K rides along so rank 0 can drop the clients that missed run.deadline_steps.
ALWAYS_PACKED = strategies.ALWAYS | {"train_time_K", "num_steps_K"}


# Every vector field starts at a multiple of ALIGN floats and a row is a multiple of ALIGN floats
# wide, so every row of every [K, P] stack starts on 64 bytes: the fused Triton kernels of the server
# rules (strategies/triton_kernels.py) then take 4-float vector loads. Padding columns are never read.
ALIGN = 16


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class ReportLayout:
    """Packs a client's report into one float32 row, so a round needs a single gather:
    [params P | vector fields P each | scalars | eff_rank L], each vector field and the row's
    width rounded up to ALIGN floats."""

    def __init__(self, needs: frozenset, numel: int, num_layers: int):
        self.slices: dict[str, slice] = {}
        offset = 0
        for stack, key in (("params_KP", "params_P"),) + VECTOR_FIELDS:
            if stack in needs:
                self.slices[stack] = slice(offset, offset + numel)
                offset = _aligned(offset + numel)
        scalars_start = offset
        for stack, key in SCALAR_FIELDS:
            if stack in needs or stack in ALWAYS_PACKED:
                self.slices[stack] = slice(offset, offset + 1)
                offset += 1
        if "eff_rank_KL" in needs:
            self.slices["eff_rank_KL"] = slice(offset, offset + num_layers)
            offset += num_layers
        # the scalars and eff_rank_L are contiguous: a client's are packed with one copy
        self.scalars = slice(scalars_start, offset)
        self.width = _aligned(offset)
        self.keys = {stack: key for stack, key in (("params_KP", "params_P"),) + VECTOR_FIELDS + SCALAR_FIELDS}
        self.keys["eff_rank_KL"] = "eff_rank_L"

    def views(self, row_F: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views into a row for the vector fields (train_client writes them in place)."""
        return {self.keys[s]: row_F[sl] for s, sl in self.slices.items() if s.endswith("_KP")}

    def pack_scalars(self, row_F: torch.Tensor, report: dict) -> None:
        """The scalars and eff_rank_L into the row: gathered on the host as float32 (the device
        cast's rounding) and written with one host-to-device copy, not one per field."""
        row_F[self.scalars].copy_(self._host_scalars(report))

    def pack_group(self, rows_MF: torch.Tensor, rows: list[int], reports: list[dict]) -> None:
        """``pack_scalars`` for a group of clients (their rows of ``rows_MF``): one host-to-device
        copy for the group, not one a client (each a wait on a GPU)."""
        values_nS = torch.stack([self._host_scalars(report) for report in reports])
        rows_MF[torch.tensor(rows, device=rows_MF.device), self.scalars] = values_nS.to(rows_MF.device)

    def _host_scalars(self, report: dict) -> torch.Tensor:
        return torch.cat([torch.as_tensor(report[self.keys[stack]]).detach().to("cpu", torch.float32).reshape(-1)
                          for stack in self.slices if not stack.endswith("_KP")])

    def unpack(self, rows_KF: torch.Tensor) -> dict[str, torch.Tensor]:
        stacks = {}
        for stack, sl in self.slices.items():
            block = rows_KF[:, sl]
            stacks[stack] = block[:, 0] if stack.endswith("_K") else block
        return stacks


class Progress:
    """One line on rank 0: round, test metric (accuracy or MAE), train loss, (DP-FedAvg) the last
    epsilon written, the last round's seconds and the steady mean (rounds after this process's
    first, which pays for warm-up: kernel builds, Triton compiles, first-touch allocations), ETA
    from the steady mean. Rewritten in place on a terminal; on a log file one line per evaluation."""

    def __init__(self, total: int, enabled: bool, metric_key: str = "test_accuracy"):
        self.total, self.enabled = total, enabled
        self.metric_key, self.metric_label = metric_key, metric_key.removeprefix("test_")[:3]
        self.tty = sys.stderr.isatty()
        self.last_end, self.seconds = time.perf_counter(), []
        self.epsilon = None  # the last epsilon written (DP-FedAvg: on the rounds that evaluate)

    def update(self, round_idx: int, start_round: int, metrics: dict) -> None:
        now = time.perf_counter()
        self.seconds.append(now - self.last_end)
        self.last_end = now
        if not self.enabled:
            return
        steady = self.seconds[1:] or self.seconds  # the first round alone: its own time
        mean = sum(steady) / len(steady)
        eta = mean * (self.total - round_idx)
        acc = metrics.get(self.metric_key)
        acc_text = f"{self.metric_label} {acc:.4f}" if acc is not None else f"{self.metric_label}   -   "
        loss = metrics["train_loss"]
        loss_text = f"{loss:.4f}" if loss is not None else "  -   (no reports)"
        if metrics.get("epsilon") is not None:
            self.epsilon = metrics["epsilon"]
        eps_text = f" | eps {self.epsilon:.3g}" if self.epsilon is not None else ""
        line = (f"round {round_idx}/{self.total} | {acc_text} | train loss {loss_text}{eps_text}"
                f" | {self.seconds[-1]:.2f} s this round, {mean:.2f} s/round steady"
                f" | ETA {int(eta) // 60}:{int(eta) % 60:02d}")
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if round_idx == self.total else ""))
        elif acc is not None or round_idx == self.total:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


@torch.no_grad()
def evaluate(model, test, comm, task: tasks.Task = tasks.CLASSIFICATION,
             batch_size: int = 1000) -> tuple[float, float]:
    """Global test loss and metric (accuracy, or MAE for regression); the test set is sharded
    over ranks, sums all-reduced."""
    model.eval()
    x_all, y_all = test.x[comm.rank::comm.world_size], test.y[comm.rank::comm.world_size]
    sums = torch.zeros(3, dtype=torch.float64, device=comm.device)  # loss, metric, count
    for start in range(0, len(y_all), batch_size):
        x, y = x_all[start:start + batch_size], y_all[start:start + batch_size]
        output = model(x)
        sums[0] += task.loss(output, y, reduction="sum").double()
        sums[1] += task.metric_sum(output, y).double()
        sums[2] += len(y)
    comm.all_reduce_sum_(sums)
    model.train()
    count = max(sums[2].item(), 1.0)
    return sums[0].item() / count, sums[1].item() / count


def _agree_on_failure(comm, error: Exception | None, what: str = "its data") -> None:
    """Every rank learns whether any rank failed to load its data (or checkpoint), so none waits
    forever at the next collective; the rank that failed re-raises its own (named) error."""
    flag = torch.tensor([1.0 if error else 0.0], device=comm.device)
    comm.all_reduce_sum_(flag)
    if error is not None:
        raise error
    if flag.item() > 0:
        raise DataError(f"data: another rank could not load {what} (see its message)")


class _RankZeroRefused(UserError):
    """Rank 0 stopped the run and said why in one line; the other ranks end with its status
    without saying it again."""

    def __init__(self, exit_code: int):
        super().__init__(f"rank 0 stopped the run (exit status {exit_code})")
        self.exit_code = exit_code


def _agree_with_rank_zero(comm, error: Exception | None, value: int = 0) -> int:
    """Rank 0's verdict (its error's exit status, or 0 and ``value``) reaches every rank, so no
    rank waits forever at the next collective for a rank 0 that has stopped."""
    verdict = torch.tensor([float(getattr(error, "exit_code", 1) if error else 0), float(value)],
                           dtype=torch.float64, device=comm.device)
    comm.broadcast_(verdict)
    if error is not None:
        raise error
    if verdict[0].item() != 0:
        raise _RankZeroRefused(int(verdict[0].item()))
    return int(verdict[1].item())


def run(cfg: config.Config, comm) -> dict:
    """One run, start to end. Before any data is loaded rank 0 checks and locks ``run.out_dir``
    (held to the end) and decides where the run starts: a fresh run refuses a folder holding
    results unless ``run.overwrite``; a resume takes the newest complete checkpoint of the
    same run identity and cuts the metrics files back to its round."""
    lock, error, resume_round = None, None, 0
    if comm.is_main:
        try:
            lock = outdir.open_out_dir(cfg.run.out_dir)
            resume_round = _start(cfg, refuse_before_data(cfg))
        except Exception as exc:  # noqa: BLE001 - every rank learns of it, then it is re-raised
            error = exc
    try:
        resume_round = _agree_with_rank_zero(comm, error, resume_round)
        return _run(cfg, comm, resume_round)
    finally:
        if lock is not None:
            lock.release()


@dataclass
class Resume:
    """What a resume continues: the newest complete checkpoint's folder and manifest (None: none
    yet, the run starts from round 1), the round folders skipped and why, and the metrics files'
    lines it keeps (logs.kept_rows)."""

    folder: str | None
    manifest: dict | None
    skipped: list[str]
    kept: dict[str, list[str]]


def refuse_before_data(cfg: config.Config) -> Resume | None:
    """Rank 0's refusals before any data loads, reading and changing nothing: the run makes them
    with run.out_dir locked, ``python -m fedddp --check`` (fedddp.__main__.check) before any rank
    starts, so it exits with the status the run would. No TensorBoard for run.tensorboard; a fresh
    run into a folder holding results without run.overwrite; a resume whose round folders are all
    incomplete though some save finished (damaged, not interrupted), whose newest complete
    checkpoint is of another run or past run.rounds, or whose metrics files have a damaged line.
    A resume's choice (for ``_start``); None for a fresh run."""
    if cfg.run.tensorboard:
        logs.require_tensorboard()
    if not cfg.run.resume:
        outdir.refuse_fresh_run(cfg.run.out_dir, cfg.run.overwrite)
        return None
    ckpt_root = os.path.join(cfg.run.out_dir, "checkpoints")
    folder, manifest, skipped = checkpoint.newest_complete(ckpt_root)
    if folder is None:
        if skipped and any(os.path.exists(os.path.join(f, checkpoint.MANIFEST))
                           for _, f in checkpoint.round_folders(ckpt_root)):
            raise DataError(f"checkpoints: {len(skipped)} round folder(s) in {ckpt_root} but none is "
                            f"complete ({'; '.join(skipped)}); nothing to resume: start over with "
                            "run.resume=false run.overwrite=true")
        return Resume(None, None, skipped, {})
    changes = checkpoint.identity_changes(manifest["identity"], checkpoint.identity(cfg))
    if changes:
        raise ConfigError(f"run.resume: the checkpoint {folder} is of another run: {'; '.join(changes)}; "
                          "resume with its values, or start a new run in another run.out_dir")
    if manifest["round"] > cfg.run.rounds:
        raise ConfigError(f"run.rounds: {cfg.run.rounds} is below the round of the checkpoint {folder} "
                          f"({manifest['round']}); set run.rounds >= {manifest['round']} to continue it")
    # a damaged row is one line (exit 3) here, before any data loads
    return Resume(folder, manifest, skipped, logs.kept_rows(cfg.run.out_dir, manifest["round"]))


def _start(cfg: config.Config, resume: Resume | None) -> int:
    """Where the run starts, after ``refuse_before_data``: a fresh run clears the folder's earlier
    results (run.overwrite); a resume cuts the metrics files back to its checkpoint's round.
    Returns that round (0: the run starts from round 1)."""
    if resume is None:
        outdir.refuse_or_clear(cfg.run.out_dir, cfg.run.overwrite)
        return 0
    ckpt_root = os.path.join(cfg.run.out_dir, "checkpoints")
    if resume.folder is None:
        if resume.skipped:
            # No save ever finished (a full disk or a kill during the first checkpoint): there is
            # nothing to continue and nothing to lose, so the rerun that the exit-5 line advises
            # and a torchrun restart start from round 1 instead of refusing.
            for _, f in checkpoint.round_folders(ckpt_root):
                shutil.rmtree(f)
            print(f"fedddp: no checkpoint in {ckpt_root} was ever completed ({'; '.join(resume.skipped)}); "
                  "removed its round folder(s), starting from round 1", file=sys.stderr, flush=True)
        else:
            print(f"fedddp: run.resume=true but {ckpt_root} holds no checkpoint; starting from round 1",
                  file=sys.stderr, flush=True)
        return 0
    with outdir.disk_full_is_one_line("metrics.jsonl, metrics.csv and clients.jsonl", cfg.run.out_dir,
                                      resume.folder):
        logs.cut_back(resume.kept)
    why = f"; skipped {'; '.join(resume.skipped)}" if resume.skipped else ""
    print(f"fedddp: resuming from round {resume.manifest['round']} ({resume.folder}){why}", file=sys.stderr,
          flush=True)
    return resume.manifest["round"]


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


def plan_round(cfg: config.Config, round_idx: int, num_samples: list[int], cost_K: list[int], rank: int,
               world_size: int, balanced: bool) -> RoundPlan:
    """sample -> drop -> assign: the round's clients, who trains them and their report rows."""
    rc = cfg.run
    if sampling_of(cfg) == "poisson":  # each client with probability q: the cohort may be empty
        sampled = sample_poisson(cfg.data.num_clients, cfg.sampling_rate(), rc.seed, round_idx)
    else:
        sampled = sample_clients(cfg.data.num_clients, cfg.num_sampled(), rc.seed, round_idx)
    reporting = [c for c in sampled if not participation.drops_out(rc.dropout, rc.seed, round_idx, c)]
    if rc.parallel_clients > 1:  # groups trained side by side, cut whatever the world size
        per_rank, groups_R = assign_groups(reporting, cost_K.__getitem__, world_size, balanced, rc.parallel_clients)
        groups = groups_R[rank]
    else:
        per_rank = assign_clients(reporting, cost_K.__getitem__, world_size, balanced)
        groups = [[c] for c in per_rank[rank]]
    rows_per_rank, row_order = layout_rows(reporting, world_size, per_rank)
    # every reporting client's work and steps, alike on every rank, so all agree on the stragglers
    work_of = {c: participation.local_work(cfg.train, rc.seed, round_idx, c) for c in reporting}
    steps_of = {c: planned_steps(num_samples[c], cfg.train, work_of[c]) for c in reporting}
    return RoundPlan(round_idx, sampled, reporting, per_rank, groups, rows_per_rank, row_order, work_of, steps_of,
                     rc.deadline_steps)


@dataclass
class Job:
    """One client's training this round: its report row, context, data, seed and local work;
    ``out`` holds the views of its row that training writes and the scalars it returns."""

    row: int
    ctx: ClientContext
    data: ClientData
    seed: int
    work: int
    out: dict


class OneAfterAnother:
    """The trainer of run.parallel_clients = 1: each client in turn on the rank's one model."""

    def __init__(self, model, layout: FlatLayout, cfg: config.Config, rule, needs: frozenset, task):
        self.model, self.layout, self.cfg, self.rule, self.needs = model, layout, cfg, rule, needs

    def train(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.layout.unflatten_into(job.ctx.global_P, self.model)
            t_client = time.perf_counter()
            train_client(self.model, job.ctx, job.data, self.cfg, self.rule, self.needs, job.seed, job.out, job.work)
            if job.ctx.global_P.device.type == "cuda":  # the client's kernels, not their queueing
                torch.cuda.synchronize(job.ctx.global_P.device)
            job.out["train_time"] = time.perf_counter() - t_client


class SideBySide:
    """The trainer of run.parallel_clients = B > 1: a group of up to B clients as one batched
    computation (client/batched.py)."""

    def __init__(self, model, layout: FlatLayout, cfg: config.Config, rule, needs: frozenset, task):
        self.batched = BatchedTrainer(model, layout, cfg, rule, needs, task)

    def train(self, jobs: list[Job]) -> None:
        self.batched.train_group([(job.ctx, job.data, job.seed, job.work, job.out) for job in jobs])


@dataclass
class Setup:
    """What a run builds once and every round uses; ``global_P``, ``state`` and ``last_ckpt``
    change round by round."""

    cfg: config.Config
    data: object                  # fedddp.data.Data
    task: tasks.Task
    model: torch.nn.Module
    layout: FlatLayout
    strategy: strategies.Strategy
    rule: object                  # the local rule
    trainer: OneAfterAnother | SideBySide
    report: ReportLayout
    static: dict[str, torch.Tensor]
    client_states: object         # client.state store of the clients this rank owns
    balanced: bool
    cost_K: list[int]
    ckpt_root: str
    global_P: torch.Tensor
    state: dict[str, torch.Tensor]
    start_round: int = 1
    last_ckpt: str | None = None
    rows_buffer: torch.Tensor | None = None
    gather_buffer: torch.Tensor | None = None
    clients_note: str = ""        # the start line's words on run.parallel_clients (client/parallel.py)
    speeds: list[float] | None = None  # each client's simulated seconds per local step
    sim_time_s: float = 0.0            # the simulated clock after the last round
    clock: asynchrony.Clock | None = None  # async mode: the schedule after the last update
    versions: dict[int, torch.Tensor] | None = None  # async: the model versions training clients started from
    # a private rule under Poisson sampling aggregates every round, also one without reports
    every_round: bool = False
    sharded: ShardedServer | None = None   # run.aggregation = sharded, for a rule with a range form
    client_eval: client_eval.Evaluator | None = None  # run.client_eval_every > 0: built on its first round


def _run(cfg: config.Config, comm, resume_round: int) -> dict:
    """The rounds: sample -> train -> gather -> aggregate -> broadcast -> evaluate -> checkpoint
    -> log, each a function below; rank 0's bookkeeping lives in ``Book``."""
    rc = cfg.run
    run = _setup(cfg, comm, resume_round)
    book = Book(run, comm) if comm.is_main else None
    if rc.mode == "async":
        return _finish(run, comm, book, _run_async(run, comm, book))
    last_round = run.start_round - 1
    for round_idx in range(run.start_round, rc.rounds + 1):
        clock = {"start": time.perf_counter()}
        if book is not None:
            book.callbacks.round_start(round_idx)
        plan = plan_round(cfg, round_idx, run.data.num_samples, run.cost_K, comm.rank, comm.world_size, run.balanced)
        rows_MF = _report_rows(run, comm, plan.rows_per_rank)
        train_clients(run, comm, plan, rows_MF)
        rows_KF, reported, train_s_R = gather_reports(run, comm, plan, rows_MF)
        clock["gather"] = time.perf_counter()
        diagnostics, train_loss, stacks = aggregate(run, comm, round_idx, rows_KF, reported,
                                                    reporting=_evaluates(rc, round_idx))
        diagnostics |= _sync_clock(run, plan)
        clock["aggregate"] = time.perf_counter()
        broadcast_model(run, comm)
        clock["broadcast"] = time.perf_counter()
        stopping = close_round(run, comm, book, round_idx, clock, plan, reported, train_s_R,
                               (diagnostics, train_loss, stacks))
        last_round = round_idx
        if stopping:
            break
    return _finish(run, comm, book, last_round)


def close_round(run: Setup, comm, book: Book | None, round_idx: int, clock: dict, plan: RoundPlan,
                reported: list[int], train_s_R: list[float], aggregated: tuple) -> bool:
    """evaluate -> checkpoint -> log, the end every round shares (sync or async): the checkpoint's
    files, then the round's rows, then the checkpoint completes. ``aggregated``: aggregate's
    (diagnostics, train loss, stacks). True when run.stop_after, or a callback (run.callbacks), stops
    the run here."""
    rc = run.cfg.run
    test_loss, test_metric = evaluate_round(run, comm, round_idx)
    clients_evaluated = client_eval.evaluate_round(run, comm, round_idx)  # run.client_eval_every; None: off
    if book is not None and (test_loss is not None or clients_evaluated is not None):
        book.callbacks.evaluate(round_idx, ({"test_loss": test_loss, run.task.metric_key: test_metric}
                                            if test_loss is not None else {})
                                | (clients_evaluated.metrics if clients_evaluated is not None else {}))
    clock["evaluate"] = time.perf_counter()
    stopping = bool(rc.stop_after) and round_idx == rc.stop_after
    written = checkpoint_files(run, comm, round_idx, stopping)
    clock["checkpoint"] = time.perf_counter()
    if book is not None:
        book.write_round(plan, reported, train_s_R, clock, *aggregated, test_loss, test_metric,
                         sync=written is not None, clients_evaluated=clients_evaluated)
    complete_checkpoint(run, comm, round_idx, written)
    if book is not None and written is not None:
        book.callbacks.checkpoint(round_idx, run.last_ckpt)
    if callbacks.paths(rc.callbacks):
        stopping = _callbacks_stop(run, comm, book, round_idx) or stopping
    return stopping


def _callbacks_stop(run: Setup, comm, book: Book | None, round_idx: int) -> bool:
    """run.callbacks' on_round_end on rank 0, then its verdict to every rank: stop after this
    round (a callback returned True), or end with the first failure of a callback this round
    (one line, exit 7). One broadcast a round, only in runs with callbacks."""
    error, stop = None, False
    if book is not None:
        stop = book.callbacks.round_end(round_idx, book.last_row, run.global_P, run.layout)
        error = book.callbacks.error
    return bool(_agree_with_rank_zero(comm, error, int(stop)))


def _round_seconds(run: Setup, plan: RoundPlan) -> float:
    """A synchronous round's simulated length: the slowest client that trained and reported
    (dropouts and stragglers are not waited for), its planned steps x its seconds per step."""
    trained = [c for c in plan.reporting if not plan.straggles(c)]
    return asynchrony.sync_round_seconds([plan.steps_of[c] for c in trained], [run.speeds[c] for c in trained])


def _sync_clock(run: Setup, plan: RoundPlan) -> dict:
    """metrics.jsonl's simulated clock in sync mode: the round's length and the time after it."""
    round_s = _round_seconds(run, plan)
    run.sim_time_s += round_s
    return {"sim_round_s": round_s, "sim_time_s": run.sim_time_s}


def _run_async(run: Setup, comm, book: Book | None) -> int:
    """run.mode = async: each round is one server update of FedBuff through the same stages as a
    synchronous round. The schedule (asynchrony.next_update) says which clients arrive and from
    which model version each started; they train from those versions (kept while a training
    client refers to one), rank 0 turns their models into staleness-weighted updates and FedAvg's
    server step applies them. Returns the last round done."""
    rc = run.cfg.run
    sched = asynchrony.Schedule(run.cfg.data.num_clients, asynchrony.concurrency(run.cfg), rc.async_buffer, rc.seed,
                                tuple(run.speeds), lambda cid, start: _async_steps(run, cid, start)[1])
    last_round = run.start_round - 1
    for round_idx in range(run.start_round, rc.rounds + 1):
        clock, before = {"start": time.perf_counter()}, run.clock
        if book is not None:
            book.callbacks.round_start(round_idx)
        run.versions[before.version] = run.global_P.clone()  # clients may start from it in this update
        arrivals, run.clock = asynchrony.next_update(before, sched)
        plan = plan_update(run, comm, round_idx, arrivals)
        rows_MF = _report_rows(run, comm, plan.rows_per_rank)
        train_clients(run, comm, plan, rows_MF)
        rows_KF, reported, train_s_R = gather_reports(run, comm, plan, rows_MF)
        extra = _buffered(run, comm, before, arrivals, rows_KF)
        clock["gather"] = time.perf_counter()
        diagnostics, train_loss, stacks = aggregate(run, comm, round_idx, rows_KF, reported)
        clock["aggregate"] = time.perf_counter()
        broadcast_model(run, comm)
        in_flight = {f.version for f in run.clock.flights}
        run.versions = {v: P for v, P in run.versions.items() if v in in_flight}
        run.sim_time_s = run.clock.now_s
        clock["broadcast"] = time.perf_counter()
        stopping = close_round(run, comm, book, round_idx, clock, plan, reported, train_s_R,
                               (diagnostics | extra, train_loss, stacks))
        last_round = round_idx
        if stopping:
            break
    return last_round


def _async_steps(run: Setup, cid: int, start: int) -> tuple[int, int]:
    """(local epochs or steps drawn, planned optimizer steps) of a client's training started as start
    number ``start``: drawn as a round's work is, with the start number in place of the round."""
    work = participation.local_work(run.cfg.train, run.cfg.run.seed, start, cid)
    return work, planned_steps(run.data.num_samples[cid], run.cfg.train, work)


def plan_update(run: Setup, comm, round_idx: int, arrivals: list) -> RoundPlan:
    """An async update as a round's plan: its arrivals are the reporting clients (distinct, in
    client-id order, assigned to ranks by cost as a round's), each trained from the model version
    it started from, with the seed of its start."""
    rc, of = run.cfg.run, {f.client: f for f in arrivals}
    clients = sorted(of)
    per_rank = assign_clients(clients, run.cost_K.__getitem__, comm.world_size, run.balanced)
    rows_per_rank, row_order = layout_rows(clients, comm.world_size, per_rank)
    drawn = {c: _async_steps(run, c, of[c].start) for c in clients}
    starts = {c: ClientStart(of[c].version + 1, run.versions[of[c].version],
                             asynchrony.training_seed(rc.seed, of[c].start, c)) for c in clients}
    return RoundPlan(round_idx, clients, clients, per_rank, [[c] for c in per_rank[comm.rank]], rows_per_rank,
                     row_order, {c: w for c, (w, _) in drawn.items()}, {c: n for c, (_, n) in drawn.items()}, 0,
                     starts)


def _buffered(run: Setup, comm, before: asynchrony.Clock, arrivals: list, rows_KF) -> dict:
    """FedBuff through FedAvg's server step: on rank 0 each arrival's model w_k becomes
    w + s(tau_k) (w_k - w_{v_k}) in its row (asynchrony.buffered_rows_), tau_k = the versions
    since it started. Returns the update's simulated clock and staleness for metrics.jsonl and,
    per client in client-id order, for clients.jsonl."""
    rc = run.cfg.run
    ordered = sorted(arrivals, key=lambda f: f.client)
    if comm.is_main:
        weights = [asynchrony.staleness_weight(before.version - f.version, rc.async_staleness,
                                               rc.async_staleness_exponent) for f in ordered]
        asynchrony.buffered_rows_(rows_KF[:, run.report.slices["params_KP"]],
                                  [run.versions[f.version] for f in ordered], run.global_P, weights)
    return asynchrony.update_record(before, run.clock, ordered)


def _setup(cfg: config.Config, comm, resume_round: int) -> Setup:
    """Data, model, flat layout, rules, trainer and report layout; the checkpoint's model and
    state when resuming; config.toml and the log files on rank 0."""
    rc = cfg.run
    rc.sampling = sampling_of(cfg)  # auto resolved (checks.load has done it for a loaded config)
    torch.set_num_threads(rc.num_threads)
    # A caller's default dtype (fedddp.run from a float64 session) would build a float64 model.
    torch.set_default_dtype(torch.float32)
    device = comm.device
    local_name, server_name = resolve(cfg.algorithm)
    strategy = strategies.get(server_name)
    rule = local_rules.get(local_name)
    needs = strategies.ALWAYS | strategy.needs_for(cfg.algorithm)

    # -- data: the clients this rank may train; a client's tensors are made when it first trains
    # Each round's clients are balanced over ranks by cost, so any rank may train any client
    # (per-client state travels from its owner rank for the round); only data sets built whole,
    # whose clients exist on their owner alone, train there (docs/architecture.md, "Which rank
    # trains a client").
    balanced = cfg.data.name not in BUILT_WHOLE
    owned = owned_clients(cfg.data.num_clients, comm.rank, comm.world_size)
    error = None
    try:
        data = build_data(cfg, cfg.data.seed, list(range(cfg.data.num_clients)) if balanced else owned)
    except DataError as exc:
        error = exc
    _agree_on_failure(comm, error)
    if device.type != "cpu":
        to_device = lambda d: ClientData(d.x.to(device), d.y.to(device))  # noqa: E731
        data.train = data.train.mapped(to_device) if isinstance(data.train, LazyClients) else \
            {c: to_device(d) for c, d in data.train.items()}
        data.test = to_device(data.test)
        if data.held_out is not None:  # data.client_test_fraction: the clients' held-out samples
            data.held_out = data.held_out.mapped(to_device)

    # -- model and flat vectors: the seeded init is identical on every rank ----------------
    torch.manual_seed(rc.seed)
    model = build_model(cfg, data.input_shape, data.num_classes, data.task).to(device)
    task = tasks.get(data.task)
    layout = FlatLayout(model, buffers=cfg.model.flat_buffers)
    global_P = layout.flatten(model).clone()
    ckpt_root = os.path.join(rc.out_dir, "checkpoints")
    # run.parallel_clients = auto becomes the B this run uses (in cfg: config.toml and the
    # checkpoints' identity record it); on resume the checkpoint's B, which decides the bits
    resumed = checkpoint.identity_of(checkpoint.round_dir(ckpt_root, resume_round)).get("run.parallel_clients", 1) \
        if resume_round and rc.parallel_clients == parallel.AUTO else None
    clients_note = parallel.resolve(cfg, comm, model, layout, data, range(cfg.data.num_clients) if balanced else owned,
                                    task, resumed)
    if cfg.train.precision != "fp32":
        clients_note += "; " + precision.words(cfg.train.precision, device)
    if rc.compile:
        clients_note += ("; run.compile: compile applies to side by side only, one after another runs eagerly"
                         if rc.parallel_clients == 1 else "; run.compile: the side-by-side step compiles in the warm-up")
    trainer = (SideBySide if rc.parallel_clients > 1 else OneAfterAnother)(model, layout, cfg, rule, needs, task)
    speeds = refuse_before_round_one(cfg, model, data, trainer.batched if rc.parallel_clients > 1 else None,
                                     range(cfg.data.num_clients) if balanced else owned)
    # per-client persistent state of the clients this rank owns (run.client_state: RAM or mmap),
    # after the refusals: an mmap store writes its files in run.out_dir
    client_states = open_client_states(rc.client_state, owned, device=device, folder=os.path.join(
        rc.out_dir, "client_state", f"rank{comm.rank}"))
    run = Setup(cfg, data, task, model, layout, strategy, rule, trainer,
                ReportLayout(needs, layout.numel, len(layout.conv_entries())), _static_stacks(needs, cfg, layout, device),
                client_states, balanced, [expected_cost(n, cfg.train) for n in data.num_samples],
                ckpt_root, global_P, strategy.init_state(global_P, cfg.algorithm),
                rows_buffer=torch.empty(0, 0, device=device), clients_note=clients_note,
                every_round=strategy.private and rc.sampling == "poisson", speeds=speeds)
    if rc.mode == "async":
        run.clock, run.versions = asynchrony.Clock(), {}
    if rc.aggregation == "sharded" and strategy.aggregate_span is not None:
        run.sharded = ShardedServer(comm, run.report, layout.numel, rc.aggregation_block, strategy, run.static, device)
        run.state = run.sharded.adopt(run.state)

    if resume_round:
        run.last_ckpt = checkpoint.round_dir(run.ckpt_root, resume_round)
        columns = (run.sharded.start, run.sharded.stop) if run.sharded is not None else None
        try:
            saved, saved_clients = checkpoint.load(run.last_ckpt, set(owned), device, columns)
        except DataError as exc:
            error = exc
        _agree_on_failure(comm, error, "the checkpoint")
        client_states.restore(saved_clients)
        del saved_clients
        global_P.copy_(saved["global_P"])
        run.state = saved["state"] if run.sharded is None else run.sharded.cut_state(saved["state"])
        run.start_round = int(saved["round"]) + 1
        _restore_clock(run, comm, saved)
    if comm.is_main and rc.progress and device.type == "cpu" and rc.parallel_clients > 1:
        run.clients_note += "; " + _side_by_side_on_cpu(run, comm)
    run.clients_note = "; ".join(filter(None, [run.clients_note, warmup.warm_up(run, comm)]))
    comm.broadcast_(global_P)
    return run


def refuse_before_round_one(cfg: config.Config, model, data, batched: BatchedTrainer | None = None,
                            ids=None) -> list[float]:
    """The refusals that need the built data and model, made before round 1 by the run's setup
    and by ``python -m fedddp --check`` (fedddp.__main__.check) alike, so --check exits with the
    status the run would: a train.batch_size that leaves a client a last batch of one sample for
    a model with BatchNorm; a model whose side-by-side step cannot run (run.parallel_clients > 1,
    tried on the first client of ``ids`` with samples by ``batched``, the run's trainer; --check
    has none and builds one); a data.client_speed file that changed since the config loaded.
    Returns each client's simulated seconds per local step."""
    check_one_sample_batches(model, data.input_shape, data.num_samples, cfg.train.batch_size, cfg.model.name)
    # auto is resolved by the run's setup (client/parallel.py) and falls back to 1 where side by side fails
    if cfg.run.parallel_clients != parallel.AUTO and cfg.run.parallel_clients > 1:
        # one step tried on a client's samples: what vmap cannot run is one line now, not round 1's traceback
        if batched is None:
            try_side_by_side(cfg, model, data)
        else:
            batched.try_first_client(data.train, data.num_samples, ids)
    try:
        return asynchrony.client_speeds(cfg.data.client_speed, cfg.data.num_clients, cfg.data.seed)
    except ValueError as exc:  # checked when the config loaded; a file changed since
        raise ConfigError(f"data.client_speed: {exc}") from None


def _schedule_words(cfg) -> str:
    """The start line's words on who trains when: K of N a round, Poisson sampling, or async."""
    rc, n = cfg.run, cfg.data.num_clients
    if rc.mode == "async":
        staleness = (f"(1 + tau)^-{rc.async_staleness_exponent:g}" if rc.async_staleness == "polynomial"
                     else "constant")
        return (f"async (FedBuff): {asynchrony.concurrency(cfg)} of {n} clients training at once on the "
                f"simulated clock, a server update every {rc.async_buffer} arrivals, staleness weight {staleness}")
    if rc.sampling == "poisson":
        return f"each of {n} clients a round with probability {cfg.sampling_rate():g} (Poisson sampling)"
    return f"{cfg.num_sampled()} of {n} clients a round"


# Rounds whose groups the start line's prediction for side by side on CPU covers.
PREDICTED_ROUNDS = 5


def _side_by_side_on_cpu(run: Setup, comm) -> str:
    """The start line's words on side by side on this CPU: rank 0's first group timed both ways
    on copies (client/parallel.py; nothing of the run changes), the timings applied to rank 0's
    groups of the first rounds, with a warning when one after another is predicted faster."""
    cfg, first = run.cfg, run.start_round
    last = min(cfg.run.rounds, first + PREDICTED_ROUNDS - 1)
    timed, groups = [], []  # the clients of the first group; every group's planned steps
    for round_idx in range(first, last + 1):
        plan = plan_round(cfg, round_idx, run.data.num_samples, run.cost_K, comm.rank, comm.world_size, run.balanced)
        for group in plan.groups:
            trained = [c for c in group if run.data.num_samples[c] and not plan.straggles(c)]
            if trained:
                timed = timed or trained
                groups.append([plan.steps_of[c] for c in trained])
    rounds = f"round {first}" if last == first else f"rounds {first}-{last}"
    if not timed:
        return f"side by side not measured (rank 0 trains no client in {rounds})"
    timings = parallel.measure_cpu(run.model, run.layout, cfg, run.task, [run.data.train[c] for c in timed],
                                   run.global_P)
    return parallel.cpu_verdict(timings, groups, rounds)[1]


def _restore_clock(run: Setup, comm, saved: dict) -> None:
    """The simulated clock of a checkpoint: async mode's schedule and the model versions its
    training clients started from; the sync clock's time, replayed from the rounds' plans (no
    training) for a checkpoint written before it was kept."""
    if run.cfg.run.mode == "async":
        run.clock, run.versions = asynchrony.restored(saved["async"], comm.device)
        run.sim_time_s = run.clock.now_s
    elif "sim_time_s" in saved:
        run.sim_time_s = float(saved["sim_time_s"])
    else:
        for r in range(1, run.start_round):
            run.sim_time_s += _round_seconds(run, plan_round(run.cfg, r, run.data.num_samples, run.cost_K, comm.rank,
                                                             comm.world_size, run.balanced))


def _report_rows(run: Setup, comm, rows_per_rank: int) -> torch.Tensor:
    """This rank's [M, F] report rows. The buffers live across rounds (fresh ones cost page faults
    every round); padding rows keep stale values and are never read."""
    if run.rows_buffer.shape[0] < rows_per_rank:
        device, width = comm.device, run.report.width
        run.rows_buffer = torch.empty(rows_per_rank, width, device=device)
        run.gather_buffer = torch.empty(comm.world_size * rows_per_rank, width, device=device) \
            if comm.is_main and comm.world_size > 1 and run.sharded is None else None
    return run.rows_buffer[:rows_per_rank]


def train_clients(run: Setup, comm, plan: RoundPlan, rows_MF: torch.Tensor) -> None:
    """This rank's clients of the round, group by group, each client's report into its row.
    Per-client state of the clients trained away from their owner is fetched first and sent home
    after; a client trained on its owner uses the store directly."""
    rc, rule, report = run.cfg.run, run.rule, run.report
    server_view = {k: run.state[k] for k in run.strategy.client_visible}
    row_of = {cid: i for i, cid in enumerate(plan.per_rank[comm.rank])}
    moves = travelling([c for c in plan.reporting if not plan.straggles(c)], plan.per_rank, comm.world_size) \
        if rule.client_state else []
    visiting = fetch_client_states(comm, run.client_states, moves)

    def job(cid: int) -> Job | None:
        """The client's training, or None for a straggler, whose row then says only its step count."""
        i = row_of[cid]
        if plan.straggles(cid):
            _straggler_row(rows_MF[i], report, plan.steps_of[cid])
            return None
        # a rule that declares no client_state keeps none, wherever its clients train
        home = rule.client_state and owner(cid, comm.world_size) == comm.rank
        start = plan.starts[cid] if plan.starts is not None else \
            ClientStart(plan.round_idx, run.global_P, client_seed(rc.seed, plan.round_idx, cid))
        ctx = ClientContext(cid, start.round_idx, start.global_P, run.layout, run.cfg.algorithm, server_view,
                            run.client_states.client(cid) if home else visiting.get(cid, {}), task=run.task)
        return Job(i, ctx, run.data.train[cid], start.seed, plan.work_of[cid], report.views(rows_MF[i]))

    for group in plan.groups:
        jobs = [j for j in map(job, group) if j is not None]
        if jobs:
            run.trainer.train(jobs)
        if jobs:
            report.pack_group(rows_MF, [j.row for j in jobs], [j.out for j in jobs])
    send_home(comm, run.client_states, moves, visiting)


def gather_reports(run: Setup, comm, plan: RoundPlan, rows_MF: torch.Tensor):
    """All ranks' rows to rank 0, in client-id order, less the rows of the clients past the
    deadline: (rows_KF, the reporting clients, each rank's training seconds); on other ranks
    (None, the reporting clients, None). Sharded: every rank gets the rows cut to its range
    (sharded.ShardedServer.exchange), [K, X], and the reported clients."""
    if run.sharded is not None:
        rows_KX, reported = run.sharded.exchange(plan, rows_MF)
        if not comm.is_main:
            return rows_KX, reported, None
        train_time_K = run.sharded.mine.unpack(rows_KX)["train_time_K"]  # stragglers' 0 s left out
        return rows_KX, reported, _per_rank_seconds(train_time_K, reported, plan.per_rank)
    gathered = run.gather_buffer[:comm.world_size * plan.rows_per_rank] if run.gather_buffer is not None else None
    rows_KF = comm.gather_rows(rows_MF, gathered)
    if not comm.is_main:
        return None, plan.reporting, None
    report, reported = run.report, plan.reporting
    if plan.row_order != list(range(rows_KF.shape[0])):
        rows_KF = rows_KF[torch.tensor(plan.row_order, dtype=torch.long, device=comm.device)]
    train_s_R = _per_rank_seconds(rows_KF[:, report.slices["train_time_K"]][:, 0], plan.reporting, plan.per_rank)
    if plan.deadline_steps:
        keep = participation.reporting_rows(rows_KF[:, report.slices["num_steps_K"]][:, 0], plan.deadline_steps)
        rows_KF, reported = rows_KF[keep], [plan.reporting[i] for i in keep.tolist()]
    return rows_KF, reported, train_s_R


def aggregate(run: Setup, comm, round_idx: int, rows_KF, reported: list[int], reporting: bool = True):
    """The server rule on rank 0 (a round without reports leaves model and state as they were,
    but for a private rule under Poisson sampling, whose noise is released every round), then
    every rank learns whether the run diverged: a non-finite model or loss ends the run before
    this round writes anything. ``reporting``: the round evaluates (every run.eval_every rounds
    and the last), so the privacy spent is written with its accuracy. Returns (diagnostics, train
    loss, stacks) on rank 0.
    Sharded: the rule on every rank's range (``_aggregate_ranges``)."""
    if run.sharded is not None:
        return _aggregate_ranges(run, comm, round_idx, rows_KF, reported, reporting)
    cfg, diagnostics, train_loss, stacks, error = run.cfg, {}, None, {}, None
    if comm.is_main:
        try:
            if reported or run.every_round:
                stacks = run.report.unpack(rows_KF) | run.static
                run.global_P, run.state, diagnostics = run.strategy.aggregate(run.global_P, stacks, run.state,
                                                                              cfg.algorithm)
            if reported:
                train_loss = (strategies.client_weights_K(stacks, cfg.algorithm) @ stacks["train_loss_K"]).item()
            diagnostics.update(_state_rows(run, reporting))
        except PluginError as exc:  # a plugin rule's own failure: every rank ends with its status
            error = exc
        if error is None and not ((train_loss is None or math.isfinite(train_loss))
                                  and bool(torch.isfinite(run.global_P).all())):
            error = _diverged(cfg, round_idx, train_loss, run.global_P, run.last_ckpt)
    _agree_with_rank_zero(comm, error)
    return diagnostics, train_loss, stacks


def _state_rows(run: Setup, reporting: bool) -> dict:
    """Rank 0's rows on the server state itself: the rule's ledger (every round) and the privacy
    spent (epsilon, on the rounds that evaluate; None on the others)."""
    rows, strategy, hp = {}, run.strategy, run.cfg.algorithm
    if strategy.ledger is not None:
        rows.update(strategy.ledger(run.state, run.static, hp))
    if strategy.spent is not None:
        eps = strategy.spent(run.state, run.static, hp) if reporting else None
        rows["epsilon"] = torch.tensor(eps, dtype=torch.float64) if eps is not None else None
    return rows


def _aggregate_ranges(run: Setup, comm, round_idx: int, rows_KX, reported: list[int], reporting: bool):
    """``aggregate`` of a sharded run: every rank runs the rule's range form on its columns (the
    new range waits for ``broadcast_model``; a private rule under Poisson sampling also without
    reports); the train loss, from every client's scalars, is the same on every rank, and so is
    the state's scalars that rank 0's ledger and privacy spent read. One all-reduce tells rank 0
    whether any rank's range is not finite or its plugin rule raised; rank 0's verdict then
    reaches every rank."""
    cfg, diagnostics, train_loss, stacks, error = run.cfg, {}, None, {}, None
    try:
        if reported or run.every_round:
            stacks, run.state, diagnostics = run.sharded.aggregate(run.strategy, run.global_P, rows_KX, run.state,
                                                                   cfg.algorithm)
        if reported:
            train_loss = (strategies.client_weights_K(stacks, cfg.algorithm) @ stacks["train_loss_K"]).item()
        if comm.is_main:
            diagnostics.update(_state_rows(run, reporting))
    except PluginError as exc:  # a plugin rule's own failure: this rank says it, every rank ends
        error = exc
    flags = torch.tensor([float(error is not None), float(not run.sharded.range_finite())], dtype=torch.float64,
                         device=comm.device)
    comm.all_reduce_sum_(flags)
    if comm.is_main and error is None:
        if flags[0].item() > 0:
            error = PluginError(f"algorithm.name: the server rule {run.strategy.name} raised on another rank "
                                "(see its message)")
        elif flags[1].item() > 0 or not (train_loss is None or math.isfinite(train_loss)):
            error = _diverged(cfg, round_idx, train_loss, None, run.last_ckpt, model_finite=flags[1].item() == 0)
    _agree_with_rank_zero(comm, error)
    return diagnostics, train_loss, stacks


def broadcast_model(run: Setup, comm) -> None:
    """The new global model, and the server state clients must see (SCAFFOLD's c), to every rank.
    Sharded: every rank's new range, all-gathered (a round without reports has none)."""
    if run.sharded is not None:
        if run.sharded.pending is not None:
            run.global_P, run.state = run.sharded.publish()
        return
    run.global_P = run.global_P.contiguous()
    comm.broadcast_(run.global_P)
    for key in run.strategy.client_visible:
        comm.broadcast_(run.state[key])


def evaluate_round(run: Setup, comm, round_idx: int) -> tuple[float | None, float | None]:
    """Test loss and metric every run.eval_every rounds and at the last; (None, None) between."""
    if not _evaluates(run.cfg.run, round_idx):
        return None, None
    run.layout.unflatten_into(run.global_P, run.model)
    return evaluate(run.model, run.data.test, comm, run.task)


def _evaluates(rc: config.RunConfig, round_idx: int) -> bool:
    """Every run.eval_every rounds and at the last."""
    return not round_idx % rc.eval_every or round_idx == rc.rounds


def checkpoint_files(run: Setup, comm, round_idx: int, stopping: bool):
    """Every run.ckpt_every rounds, and at run.stop_after (also with run.ckpt_every = 0: a stopped run
    is continued from it, as --help promises): rank 0 writes the server part, every rank
    its clients' states; the manifest that completes the checkpoint waits for the round's rows
    (``complete_checkpoint``). None on other rounds."""
    rc = run.cfg.run
    if not stopping and (not rc.ckpt_every or round_idx % rc.ckpt_every):
        return None
    # sharded: every rank's range of the ranged state entries in a file of its own
    state, shard = run.sharded.checkpoint_parts(run.state) if run.sharded is not None else (run.state, None)
    server = {"round": round_idx, "global_P": run.global_P.cpu(), "state": {k: v.cpu() for k, v in state.items()},
              "torch_rng": torch.get_rng_state(), "sim_time_s": run.sim_time_s} if comm.is_main else None
    if comm.is_main and run.clock is not None:  # async: the clock, its training clients and their versions
        server["async"] = asynchrony.saved(run.clock, run.versions)
    with outdir.disk_full_is_one_line(f"the checkpoint of round {round_idx}", run.ckpt_root, run.last_ckpt):
        return checkpoint.write_files(comm, run.ckpt_root, round_idx, server, run.client_states,
                                      checkpoint.identity(run.cfg), server_shard=shard)


def complete_checkpoint(run: Setup, comm, round_idx: int, written) -> None:
    """The manifest, after the round's rows are durable. A checkpoint must never be complete
    without its round's rows: a run killed in between would resume after the round and its rows
    would be missing for good. In this order a kill in between leaves the round folder
    incomplete; resume takes the previous checkpoint and cuts the rows back to it
    (logs.cut_back)."""
    if written is None:
        return
    with outdir.disk_full_is_one_line(f"the checkpoint of round {round_idx}", run.ckpt_root, run.last_ckpt):
        run.last_ckpt = checkpoint.complete(comm, written)


class Book:
    """Rank 0's bookkeeping in one place: config.toml, the start line, each round's row of
    metrics.jsonl, metrics.csv and clients.jsonl (logs.py) with its phase timings, and the
    progress line."""

    def __init__(self, run: Setup, comm):
        rc, self.run, self.world_size = run.cfg.run, run, comm.world_size
        with outdir.disk_full_is_one_line("config.toml and metrics.jsonl", rc.out_dir, run.last_ckpt):
            checkpoint.atomic_write_text(config.dumps(run.cfg), os.path.join(rc.out_dir, "config.toml"))
            # metrics.jsonl, metrics.csv, clients.jsonl, tensorboard/: replaced by a fresh run; a
            # resumed one's were cut back to its checkpoint's round in run()
            self.logs = logs.RunLogs(rc.out_dir, run.start_round, rc.tensorboard)
        self.progress = Progress(rc.rounds, rc.progress, run.task.metric_key)
        self.last_row: dict | None = None  # the last round's metrics.jsonl row (the closing line's epsilon)
        # run.callbacks, on rank 0: a failure here is said at round 1's end, as every callback's
        self.callbacks = callbacks.Runner(rc.callbacks)
        self.callbacks.run_start({"out_dir": rc.out_dir, "start_round": run.start_round, "rounds": rc.rounds,
                                  "config": dataclasses.asdict(run.cfg)})
        # Builds the fused CPU kernels now (if not cached), so round 1's aggregate_s leaves it
        # out; the line says which form of the rules produced this run's bits.
        form = strategies.kernels.describe(comm.device, rule=run.strategy.name)
        if run.sharded is not None:
            form = f"{run.sharded.describe()}; {form}"
        elif rc.aggregation == "sharded":
            form = f"gathered on rank 0 (the server rule {run.strategy.name} has no sharded form); {form}"
        if rc.progress:
            print(f"fedddp: {comm.describe()}; {describe_algorithm(run.cfg)}; "
                  f"{_schedule_words(run.cfg)}; aggregation: {form}; {run.clients_note}", file=sys.stderr, flush=True)

    def write_round(self, plan: RoundPlan, reported: list[int], train_s_R: list[float], clock: dict,
                    diagnostics: dict, train_loss, stacks: dict, test_loss, test_metric, sync: bool,
                    clients_evaluated: client_eval.Result | None = None) -> None:
        """The round's rows (fsynced when ``sync``: a checkpoint completes after them) and the
        progress line; ``clients_evaluated``: the round's client evaluation (its keys after the
        loop's, its rows to client_eval.jsonl)."""
        run, t = self.run, clock
        # test_accuracy is always a key (the output contract). The metric goes under its task's
        # key: test_accuracy itself for classification; for regression test_mae, and
        # test_accuracy stays null, as it is on rounds without evaluation.
        line = {"round": plan.round_idx, "train_loss": train_loss, "test_loss": test_loss, "test_accuracy": None,
                run.task.metric_key: test_metric, "time_s": t["checkpoint"] - t["start"],
                # rank 0's wait for slower ranks is their local training, not communication
                "train_s": max(train_s_R), "train_imbalance_s": max(train_s_R) - min(train_s_R),
                "communicate_s": max(0.0, (t["gather"] - t["start"]) - max(train_s_R))
                + (t["broadcast"] - t["aggregate"]),
                "aggregate_s": t["aggregate"] - t["gather"], "evaluate_s": t["evaluate"] - t["broadcast"],
                "checkpoint_s": t["checkpoint"] - t["evaluate"], "clients": plan.sampled,
                "num_reports": len(reported), "dropped": sorted(set(plan.sampled) - set(reported)),
                # of those, the clients that were drawn to report but planned more steps than
                # run.deadline_steps (stragglers); the others dropped out (run.dropout)
                "missed_deadline": sorted(set(plan.reporting) - set(reported))}
        if clients_evaluated is not None:
            line |= clients_evaluated.metrics
        rank_of = {c: r for r, clients in enumerate(plan.per_rank) for c in clients}
        line = self.logs.write_round(line, diagnostics, stacks, reported, rank_of, run.last_ckpt, sync=sync,
                                     client_eval=clients_evaluated.rows if clients_evaluated is not None else None)
        self.last_row = line
        self.progress.update(plan.round_idx, run.start_round, line)

    def finish(self, last_round: int, final: dict) -> None:
        """final.pt after the last round, or the line that says how to continue a stopped run."""
        rc, last_ckpt = self.run.cfg.run, self.run.last_ckpt
        if last_round == rc.rounds or self.callbacks.stop:  # a callback's stop ends the run as the last round
            with outdir.disk_full_is_one_line("final.pt", rc.out_dir, last_ckpt):
                checkpoint.atomic_save(final, os.path.join(rc.out_dir, "final.pt"))
            self.logs.close()
            if rc.progress:
                newline = "\n" if self.progress.tty and last_round != rc.rounds else ""  # the progress line's end
                print(newline + self.closing_line(last_round), file=sys.stderr, flush=True)
            return
        if last_round == rc.stop_after:
            print(f"fedddp: stopped after round {last_round} (run.stop_after); continue from {last_ckpt} with "
                  "run.resume=true", file=sys.stderr, flush=True)
        self.logs.close()

    def closing_line(self, last_round: int | None = None) -> str:
        """What a finished run leaves: the folder, its files and (DP-FedAvg) the final epsilon."""
        out_dir, rounds = self.run.cfg.run.out_dir, self.run.cfg.run.rounds
        names = [n + ("/" if os.path.isdir(os.path.join(out_dir, n)) else "") for n in
                 ("config.toml", "metrics.jsonl", "metrics.csv", "clients.jsonl", "client_eval.jsonl", "final.pt",
                  "checkpoints", "tensorboard", "client_state") if os.path.exists(os.path.join(out_dir, n))]
        eps, params = (self.last_row or {}).get("epsilon"), self.run.cfg.algorithm.params
        cohort = f" (for a noise cohort of {params['dp_noise_cohort']} a round)" \
            if params.get("dp_noise_cohort") else ""
        dp = f"; epsilon {eps:.4g} at delta {params['dp_delta']:g}{cohort}" if eps is not None else ""
        done = f"finished {rounds} rounds" if last_round in (None, rounds) else \
            f"stopped after round {last_round} of {rounds} (a callback of run.callbacks)"
        return f"fedddp: {done}; {out_dir} holds {', '.join(names)}{dp}"


def _finish(run: Setup, comm, book: Book | None, last_round: int) -> dict:
    final = run.layout.state_dict(run.global_P)  # every rank holds the broadcast model (fedddp.run's result)
    if book is not None:
        book.finish(last_round, final)
    if callbacks.paths(run.cfg.run.callbacks):  # on_run_end on rank 0; a failure ends every rank alike
        error = None
        if book is not None:
            book.callbacks.run_end(last_round)
            error = book.callbacks.error
        _agree_with_rank_zero(comm, error)
    comm.barrier()
    run.client_states.close()
    return {"last_round": last_round, "global_P": run.global_P, "state_dict": final}


def _straggler_row(row_F: torch.Tensor, report: ReportLayout, steps: int) -> None:
    """A straggler does not train: only its step count travels, and rank 0 leaves its row out
    (one filter on rank 0 for the deadline, beside the drawn dropouts)."""
    row_F.fill_(math.nan)
    row_F[report.slices["num_steps_K"]] = steps
    row_F[report.slices["train_time_K"]] = 0.0


def _static_stacks(needs: frozenset, cfg, layout: FlatLayout, device) -> dict[str, torch.Tensor]:
    """Stacks that are not client reports but fixed for the run: conv_runs_R3 (FedER),
    param_mask_P (FedSMOO), and the scalars num_clients (N: SCAFFOLD, FedSMOO, DP-FedAvg),
    client_momentum (FedNova's rho), num_sampled (K, or the expected cohort q N under Poisson
    sampling), sampling_rate (q), poisson and noise_seed (DP-FedAvg), aggregation_block (CGW,
    DP-FedAvg: the block width of their sums over the whole vector)."""
    static = {}
    if "conv_runs_R3" in needs:
        static["conv_runs_R3"] = layout.conv_runs_R3().to(device)
    if "param_mask_P" in needs:
        static["param_mask_P"] = layout.param_mask_P(device)
    if "num_clients" in needs:
        static["num_clients"] = torch.tensor(float(cfg.data.num_clients), device=device)
    if "client_momentum" in needs:
        static["client_momentum"] = torch.tensor(float(cfg.train.momentum), device=device)
    if "num_sampled" in needs:
        static["num_sampled"] = torch.tensor(cfg.expected_cohort(), device=device)
    if "sampling_rate" in needs:
        static["sampling_rate"] = torch.tensor(cfg.sampling_rate(), dtype=torch.float64)
    if "poisson" in needs:
        static["poisson"] = torch.tensor(cfg.run.sampling == "poisson")
    if "noise_seed" in needs:
        static["noise_seed"] = torch.tensor(cfg.run.seed, dtype=torch.int64)
    if "aggregation_block" in needs:
        static["aggregation_block"] = torch.tensor(cfg.run.aggregation_block, dtype=torch.int64)
    return static


def _per_rank_seconds(train_time_K: torch.Tensor, sampled: list[int], per_rank: list[list[int]]) -> list[float]:
    rank_of = {c: r for r, clients in enumerate(per_rank) for c in clients}
    seconds = [0.0] * len(per_rank)
    for cid, sec in zip(sampled, train_time_K.tolist()):
        seconds[rank_of[cid]] += sec
    return seconds


def _diverged(cfg: config.Config, round_idx: int, train_loss: float, global_P: torch.Tensor | None,
              last_ckpt: str | None, model_finite: bool | None = None) -> DivergenceError:
    if model_finite is None:
        model_finite = bool(torch.isfinite(global_P).all())
    what = "the global model" if not model_finite else "the training loss"
    saved = f"last checkpoint {last_ckpt}" if last_ckpt else "no checkpoint yet"
    return DivergenceError(
        f"round {round_idx}: the run diverged: {what} is not finite (train loss {train_loss}); stopped "
        f"before writing anything of round {round_idx} ({saved}); likely cause: steps too large for this "
        f"model and data (train.lr = {cfg.train.lr}, algorithm.server_lr = {cfg.algorithm.server_lr}): "
        "lower them and start over with run.overwrite=true")

