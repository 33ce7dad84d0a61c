"""Client (federated) evaluation: a cohort of clients evaluates the global model on its own
held-out samples, before and (run.client_eval_steps = k > 0) after k local steps.

Legend: K evaluated clients (the cohort), M rows per rank, F = 5 floats a row.

Every run.client_eval_every rounds (and at the last), after the round's test evaluation:

- held-out samples: data.client_test_fraction of each client's samples, taken out of its training
  samples when the data is built (fedddp.data.clients.hold_out: a permutation seeded by
  (data.seed, client id)); a client without held-out samples is never evaluated;
- cohort: run.client_eval_clients of the clients with held-out samples (0: all of them), drawn
  from (run.seed, round) on a stream of its own (fedddp.sampling.eval_cohort);
- who evaluates: the cohort is split over ranks as a round's clients are (by cost, or side by side
  in groups of run.parallel_clients cut without regard to the world size: ``assign_groups``); each
  rank's rows [n, loss sum, metric sum, personalized loss sum, personalized metric sum] (float64)
  are gathered to rank 0 in client-id order. A client's numbers depend only on the global model,
  its data, its seed and its group, never on the rank: bitwise the same on any world size;
- k = 0: the global model on the held-out samples, in eval mode, in chunks of ``EVAL_BATCH``
  (the loss and metric summed in float64, as the test evaluation does). One after another
  (run.parallel_clients = 1) a client at a time; side by side (B > 1) a group's held-out samples
  concatenated through the one model in chunks (what vmap over B stacked copies of the same
  parameters computes, without the copies), each client's sums over its own outputs: equal to one
  after another to float32 rounding (the forward's batch differs), bitwise where the group is one
  client;
- k > 0 (personalization, pfl-research's "after local training"): the client also takes k local
  steps of the run's local rule and optimizer (train.*, train.local_steps = k, run.compile off) on
  its training samples, starting from the global model and an empty client state (its first
  round's), seeded by (run.seed, round, client id) apart from its training seed, at the round's
  learning rate; the personalized model is evaluated on the held-out samples one client at a
  time. The steps run one after another (``train_client``) or side by side (``BatchedTrainer``),
  as the run trains. Nothing of it stays: the global model, the server state, the clients' states
  and torch's global generators are as they were (``torch.random.fork_rng``), so training is
  bitwise the same with client evaluation on or off.

Rank 0 writes metrics.jsonl's client_eval_* keys (``summary``: the metric's mean over clients,
sample-weighted mean and 10/50/90th percentiles, the loss's mean and weighted mean, the same for
client_eval_personalized_* with k > 0; null on the rounds between) and a client_eval.jsonl row per
(round, client) (fedddp.logs).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from .client import ClientContext, LocalTraining, train_client
from .client.batched import BatchedTrainer
from .data import ClientData
from .sampling import assign_clients, assign_groups, batch_size_of, eval_cohort, eval_seed, layout_rows

EVAL_BATCH = 1000  # samples a forward, as the test evaluation's
PERCENTILES = (10, 50, 90)
F = 5  # a client's row: n, loss sum, metric sum, then the personalized loss and metric sums


def evaluates(rc, round_idx: int) -> bool:
    """Every run.client_eval_every rounds and at the last; never with 0."""
    return rc.client_eval_every > 0 and (not round_idx % rc.client_eval_every or round_idx == rc.rounds)


def cohort(rc, num_held_out: list[int], round_idx: int) -> list[int]:
    """The round's evaluated clients, sorted: run.client_eval_clients of those with held-out
    samples, drawn from (run.seed, round); the same on every rank (``rc``: the run section)."""
    eligible = [c for c, m in enumerate(num_held_out) if m > 0]
    return eval_cohort(eligible, rc.client_eval_clients, rc.seed, round_idx)


def keys(task, steps: int) -> list[str]:
    """metrics.jsonl's client evaluation keys, in their order (``task``: fedddp.tasks.Task)."""
    metric = task.metric_key.removeprefix("test_")
    prefixes = ["client_eval_"] + (["client_eval_personalized_"] if steps > 0 else [])
    names = ["client_eval_clients"]
    for prefix in prefixes:
        names += [f"{prefix}{metric}_mean", f"{prefix}{metric}_wmean"]
        names += [f"{prefix}{metric}_p{q}" for q in PERCENTILES]
        names += [f"{prefix}loss_mean", f"{prefix}loss_wmean"]
    return names + ["client_eval_s"]


@dataclasses.dataclass
class Result:
    """Rank 0's share of a round's client evaluation: metrics.jsonl's keys and the
    client_eval.jsonl rows (none on a round without client evaluation)."""

    metrics: dict
    rows: list[dict]


class Evaluator:
    """What client evaluation keeps across rounds: the personalization's local training (the
    run's, ``training``, with train.local_steps = k = run.client_eval_steps, uncompiled) and,
    side by side, its trainer, built on first use."""

    def __init__(self, training: LocalTraining, k: int):
        self.training_k = dataclasses.replace(
            training, train=dataclasses.replace(training.train, local_steps=k, local_work_min=0), compile=False)
        self.batched: BatchedTrainer | None = None

    def trainer(self, run) -> BatchedTrainer:
        if self.batched is None:
            self.batched = BatchedTrainer(run.model, run.layout, self.training_k, run.rule, frozenset(), run.task)
        return self.batched


def evaluate_round(run, comm, round_idx: int) -> Result | None:
    """The round's client evaluation on every rank (``run``: fedddp.prepare.Run). None when
    run.client_eval_every = 0 or on ranks other than 0; on rank 0 a Result, its keys null on a
    round without client evaluation."""
    cfg = run.cfg
    if cfg.run.client_eval_every <= 0:
        return None
    steps = cfg.run.client_eval_steps
    if not evaluates(cfg.run, round_idx):
        return Result(dict.fromkeys(keys(run.task, steps)), []) if comm.is_main else None
    t_start = time.perf_counter()
    clients = cohort(cfg.run, run.data.num_held_out, round_idx)
    if not clients:  # no client holds a sample out: every rank knows it, nothing is gathered
        return Result(dict.fromkeys(keys(run.task, steps)) | {"client_eval_clients": 0}, []) if comm.is_main else None
    held, trained = run.data.num_held_out, run.data.num_samples
    cost = lambda c: held[c] + steps * batch_size_of(trained[c], cfg.train.batch_size)  # noqa: E731
    B = cfg.run.parallel_clients if isinstance(cfg.run.parallel_clients, int) else 1
    if B > 1:
        per_rank, groups_R = assign_groups(clients, cost, comm.world_size, run.balanced, B)
        groups = groups_R[comm.rank]
    else:
        per_rank = assign_clients(clients, cost, comm.world_size, run.balanced)
        groups = [[c] for c in per_rank[comm.rank]]
    rows_per_rank, row_order = layout_rows(clients, comm.world_size, per_rank)
    rows_MF = torch.zeros(rows_per_rank, F, dtype=torch.float64, device=comm.device)
    row_of = {c: i for i, c in enumerate(per_rank[comm.rank])}
    device = run.global_P.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for group in groups:
            _evaluate_group(run, round_idx, group, [rows_MF[row_of[c]] for c in group], B > 1)
    run.layout.unflatten_into(run.global_P, run.model)
    run.model.train()
    gathered = torch.empty(comm.world_size * rows_per_rank, F, dtype=torch.float64, device=comm.device) \
        if comm.is_main and comm.world_size > 1 else None
    rows_KF = comm.gather_rows(rows_MF, gathered)
    if not comm.is_main:
        return None
    rows_KF = rows_KF[torch.tensor(row_order, dtype=torch.long, device=rows_KF.device)].cpu()
    rank_of = {c: r for r, p in enumerate(per_rank) for c in p}
    return summary(run.task, clients, rows_KF.tolist(), rank_of, round_idx, steps, time.perf_counter() - t_start)


def _evaluate_group(run, round_idx: int, group: list[int], rows_F: list[torch.Tensor], side_by_side: bool) -> None:
    """One group's (one client one after another) sums into its rows: the global model's, then
    with k > 0 the personalized models', their steps side by side (``BatchedTrainer``) when the
    run trains so."""
    model, layout, task, steps = run.model, run.layout, run.task, run.cfg.run.client_eval_steps
    held = [run.data.held_out[c] for c in group]
    layout.unflatten_into(run.global_P, model)
    for row_F, data, output in zip(rows_F, held, _group_outputs(model, held)):
        row_F[0] = float(len(data))
        _sums_into(row_F[1:3], output, data.y, task)
    if steps <= 0:
        return
    server_view = {k: run.state[k] for k in run.strategy.client_visible}
    P = run.global_P.numel()
    params_BP = torch.empty(len(group), P, device=run.global_P.device)
    jobs = []
    for b, cid in enumerate(group):
        ctx = ClientContext(cid, round_idx, run.global_P, layout, run.cfg.algorithm, server_view, {}, task=task)
        jobs.append((ctx, run.data.train[cid], eval_seed(run.cfg.run.seed, round_idx, cid), 0,
                     {"params_P": params_BP[b]}))
    if side_by_side:
        run.client_eval.trainer(run).train_group(jobs)
    else:
        ctx, data, seed, work, out = jobs[0]
        layout.unflatten_into(run.global_P, model)
        train_client(model, ctx, data, run.client_eval.training_k, run.rule, frozenset(), seed, out, work)
    for b, (row_F, data) in enumerate(zip(rows_F, held)):
        layout.unflatten_into(params_BP[b], model)
        _sums_into(row_F[3:5], _group_outputs(model, [data])[0], data.y, task)


@torch.no_grad()
def _group_outputs(model, held: list[ClientData]) -> list[torch.Tensor]:
    """The model's outputs on each client's held-out samples, in eval mode: the clients' samples
    concatenated and passed in chunks of EVAL_BATCH (one client: its own chunks), then split."""
    model.eval()
    x = held[0].x if len(held) == 1 else torch.cat([d.x for d in held])
    outputs = torch.cat([model(x[start:start + EVAL_BATCH]) for start in range(0, x.shape[0], EVAL_BATCH)])
    return list(outputs.split([len(d) for d in held]))


@torch.no_grad()
def _sums_into(out_2: torch.Tensor, output: torch.Tensor, y: torch.Tensor, task) -> None:
    """The loss and metric summed over a client's outputs (float64 sums of chunks of
    EVAL_BATCH, as the test evaluation sums) into ``out_2``."""
    for start in range(0, len(y), EVAL_BATCH):
        o, t = output[start:start + EVAL_BATCH], y[start:start + EVAL_BATCH]
        out_2[0] += task.loss(o, t, reduction="sum").double()
        out_2[1] += task.metric_sum(o, t).double()


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile of ascending values, linear between the closest ranks (numpy's
    default): position q/100 x (n - 1)."""
    pos = q / 100 * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summary(task, clients: list[int], rows: list[list[float]], rank_of: dict[int, int], round_idx: int, steps: int,
            seconds: float) -> Result:
    """metrics.jsonl's keys and the client_eval.jsonl rows of the gathered rows (client-id order:
    [n, loss sum, metric sum, personalized loss sum, personalized metric sum] each)."""
    metric = task.metric_key.removeprefix("test_")
    metrics = {"client_eval_clients": len(clients)}
    total = sum(r[0] for r in rows)
    parts = [("client_eval_", 1, "")] + ([("client_eval_personalized_", 3, "personalized_")] if steps > 0 else [])
    for prefix, at, _ in parts:
        values = [r[at + 1] / r[0] for r in rows]
        losses = [r[at] / r[0] for r in rows]
        metrics[f"{prefix}{metric}_mean"] = sum(values) / len(values)
        metrics[f"{prefix}{metric}_wmean"] = sum(r[at + 1] for r in rows) / total
        ordered = sorted(values)
        for q in PERCENTILES:
            metrics[f"{prefix}{metric}_p{q}"] = percentile(ordered, q)
        metrics[f"{prefix}loss_mean"] = sum(losses) / len(losses)
        metrics[f"{prefix}loss_wmean"] = sum(r[at] for r in rows) / total
    metrics["client_eval_s"] = seconds
    lines = []
    for cid, r in zip(clients, rows):
        line = {"round": round_idx, "client": cid, "rank": rank_of[cid], "num_samples": int(r[0]), "steps": steps}
        for _, at, name in parts:
            line[f"{name}loss"] = r[at] / r[0]
            line[f"{name}{metric}"] = r[at + 1] / r[0]
        lines.append(line)
    return Result(metrics, lines)
