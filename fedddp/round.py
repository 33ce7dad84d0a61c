"""The round loop. Every rank runs ``run``; rank 0 also keeps the book (book.py): metrics,
the start, progress and closing lines.

    plan -> train -> exchange -> aggregate -> publish -> evaluate -> checkpoint -> log

``Run.schedule`` plans each round (synchronous rounds, or FedBuff's buffered updates: plan.py)
and ``Run.server`` moves the reports to the server rule and the new model to every rank
(gathered on rank 0, or sharded over the ranks: server.py); the loop is the same for each.
Rounds are counted from 1.

Legend: K sampled clients, P flat elements, M report rows per rank, F floats per report row.
"""

from __future__ import annotations

import time

import torch

from . import callbacks, checkpoint, client_eval, config, outdir, tasks
from .book import Book
from .client import ClientContext
from .client.state import fetch as fetch_client_states, send_home
from .client.trainers import Job
from .plan import ClientStart, RoundPlan, evaluates
from .prepare import Run, prepare
from .resume import refuse_before_data, start
from .sampling import client_seed, owner, travelling
from .server import per_rank_seconds
from .verdict import agree_with_rank_zero


def run(cfg: config.Config, comm) -> dict:
    """One run, start to end. Before any data is loaded rank 0 checks and locks ``run.out_dir``
    (held to the end) and decides where the run starts: a fresh run refuses a folder holding
    results unless ``run.overwrite``; a resume takes the newest complete checkpoint of the
    same run identity and cuts the metrics files back to its round. Returns the last round run,
    the model and the run's config with its start-time choices resolved (run.parallel_clients)."""
    lock, error, resume_round = None, None, 0
    if comm.is_main:
        try:
            lock = outdir.open_out_dir(cfg.run.out_dir)
            resume_round = start(cfg.run, refuse_before_data(cfg.run, checkpoint.identity(cfg)))
        except Exception as exc:  # noqa: BLE001 - every rank learns of it, then it is re-raised
            error = exc
    try:
        resume_round = agree_with_rank_zero(comm, error, resume_round)
        return _rounds(prepare(cfg, comm, resume_round), comm)
    finally:
        if lock is not None:
            lock.release()


def _rounds(run: Run, comm) -> dict:
    """The rounds from run.start_round to run.rounds (or a stop), each stage a call below."""
    book = Book(run, comm) if comm.is_main else None
    server, schedule = run.server, run.schedule
    last_round = run.start_round - 1
    for round_idx in range(run.start_round, run.cfg.run.rounds + 1):
        clock = {"start": time.perf_counter()}
        if book is not None:
            book.callbacks.round_start(round_idx)
        plan = schedule.plan(round_idx, server.global_P)
        rows_MF = server.rows(plan.rows_per_rank)
        train_clients(run, comm, plan, rows_MF)
        rows, reported, train_time_K = server.exchange(plan, rows_MF)
        arrived = schedule.arrived(comm.is_main, rows, run.report, server.global_P)
        clock["gather"] = time.perf_counter()
        # rank 0: the round's checks, losses and client columns read from the device once
        diagnostics, train_loss, stacks, seconds_K = server.aggregate(
            round_idx, rows, reported, schedule.reporting(round_idx), run.checkpoints.last, train_time_K)
        train_s_R = per_rank_seconds(seconds_K, reported, plan.per_rank) if comm.is_main else None
        clock["aggregate"] = time.perf_counter()
        server.publish()
        diagnostics |= arrived | schedule.advanced(plan)
        clock["broadcast"] = time.perf_counter()
        last_round = round_idx
        if close_round(run, comm, book, round_idx, clock, plan, reported, train_s_R,
                       (diagnostics, train_loss, stacks)):
            break
    return _finish(run, comm, book, last_round)


def train_clients(run: Run, comm, plan: RoundPlan, rows_MF: torch.Tensor) -> None:
    """This rank's clients of the round, group by group, each client's report into its row.
    Per-client state of the clients trained away from their owner is fetched first and sent home
    after; a client trained on its owner uses the store directly."""
    rule, report = run.rule, run.report
    server_view = {k: run.server.state[k] for k in run.strategy.client_visible}
    row_of = {cid: i for i, cid in enumerate(plan.per_rank[comm.rank])}
    moves = travelling([c for c in plan.reporting if not plan.straggles(c)], plan.per_rank, comm.world_size) \
        if rule.client_state else []
    visiting = fetch_client_states(comm, run.client_states, moves)

    def job(cid: int) -> Job | None:
        """The client's training, or None for a straggler, whose row then says only its step count."""
        i = row_of[cid]
        if plan.straggles(cid):
            report.straggler_row(rows_MF[i], plan.steps_of[cid])
            return None
        # a rule that declares no client_state keeps none, wherever its clients train
        home = rule.client_state and owner(cid, comm.world_size) == comm.rank
        begin = plan.starts[cid] if plan.starts is not None else \
            ClientStart(plan.round_idx, run.server.global_P, client_seed(run.cfg.run.seed, plan.round_idx, cid))
        ctx = ClientContext(cid, begin.round_idx, begin.global_P, run.layout, run.cfg.algorithm, server_view,
                            run.client_states.client(cid) if home else visiting.get(cid, {}), task=run.task)
        return Job(i, ctx, run.data.train[cid], begin.seed, plan.work_of[cid], report.views(rows_MF[i]))

    trained = []
    for group in plan.groups:
        jobs = [j for j in map(job, group) if j is not None]
        if jobs:
            run.trainer.train(jobs)
            trained += jobs
    report.pack_round(rows_MF, [j.row for j in trained], [j.out for j in trained])  # one copy a round
    send_home(comm, run.client_states, moves, visiting)


def close_round(run: Run, comm, book: Book | None, round_idx: int, clock: dict, plan: RoundPlan,
                reported: list[int], train_s_R: list[float], aggregated: tuple) -> bool:
    """evaluate -> checkpoint -> log: the checkpoint's files, then the round's rows, then the
    checkpoint completes. ``aggregated``: the server's (diagnostics, train loss, stacks). True when
    run.stop_after, or a callback (run.callbacks), stops the run here."""
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
        book.callbacks.checkpoint(round_idx, run.checkpoints.last)
    if callbacks.paths(rc.callbacks):
        stopping = _callbacks_stop(run, comm, book, round_idx) or stopping
    return stopping


def _callbacks_stop(run: Run, comm, book: Book | None, round_idx: int) -> bool:
    """run.callbacks' on_round_end on rank 0, then its verdict to every rank: stop after this
    round (a callback returned True), or end with the first failure of a callback this round
    (one line, exit 7). One broadcast a round, only in runs with callbacks."""
    error, stop = None, False
    if book is not None:
        stop = book.callbacks.round_end(round_idx, book.last_row, run.server.global_P, run.layout)
        error = book.callbacks.error
    return bool(agree_with_rank_zero(comm, error, int(stop)))


def evaluate_round(run: Run, comm, round_idx: int) -> tuple[float | None, float | None]:
    """Test loss and metric every run.eval_every rounds and at the last; (None, None) between."""
    if not evaluates(run.cfg.run, round_idx):
        return None, None
    run.layout.unflatten_into(run.server.global_P, run.model)
    return evaluate(run.model, run.data.test, comm, run.task)


@torch.no_grad()
def evaluate(model, test, comm, task: tasks.Task = tasks.CLASSIFICATION,
             batch_size: int = 1000) -> tuple[float, float]:
    """Global test loss and metric (accuracy, or MAE for regression); the test set is sharded
    over ranks, sums all-reduced."""
    model.eval()
    x_all, y_all = test.x[comm.rank::comm.world_size], test.y[comm.rank::comm.world_size]
    sums = torch.zeros(3, dtype=torch.float64, device=comm.device)  # loss, metric, count
    for start_at in range(0, len(y_all), batch_size):
        x, y = x_all[start_at:start_at + batch_size], y_all[start_at:start_at + batch_size]
        output = model(x)
        sums[0] += task.loss(output, y, reduction="sum").double()
        sums[1] += task.metric_sum(output, y).double()
        sums[2] += len(y)
    comm.all_reduce_sum_(sums)
    model.train()
    count = max(sums[2].item(), 1.0)
    return sums[0].item() / count, sums[1].item() / count


def checkpoint_files(run: Run, comm, round_idx: int, stopping: bool):
    """Every run.ckpt_every rounds, and at run.stop_after (also with run.ckpt_every = 0: a stopped
    run is continued from it, as --help promises): rank 0 writes the server part, every rank its
    clients' states; the manifest that completes the checkpoint waits for the round's rows
    (``complete_checkpoint``). None on other rounds."""
    rc, saves = run.cfg.run, run.checkpoints
    if not stopping and (not rc.ckpt_every or round_idx % rc.ckpt_every):
        return None
    # sharded: every rank's range of the ranged state entries in a file of its own
    state, shard = run.server.checkpoint_parts()
    server = {"round": round_idx, "global_P": run.server.global_P.cpu(),
              "state": {k: v.cpu() for k, v in state.items()}, "torch_rng": torch.get_rng_state()} \
        | run.schedule.saved() if comm.is_main else None
    with outdir.disk_full_is_one_line(f"the checkpoint of round {round_idx}", saves.root, saves.last):
        return checkpoint.write_files(comm, saves.root, round_idx, server, run.client_states,
                                      checkpoint.identity(run.cfg), server_shard=shard)


def complete_checkpoint(run: Run, comm, round_idx: int, written) -> None:
    """The manifest, after the round's rows are durable. A checkpoint must never be complete
    without its round's rows: a run killed in between would resume after the round and its rows
    would be missing for good. In this order a kill in between leaves the round folder
    incomplete; resume takes the previous checkpoint and cuts the rows back to it
    (logs.cut_back)."""
    if written is None:
        return
    saves = run.checkpoints
    with outdir.disk_full_is_one_line(f"the checkpoint of round {round_idx}", saves.root, saves.last):
        saves.last = checkpoint.complete(comm, written)


def _finish(run: Run, comm, book: Book | None, last_round: int) -> dict:
    """final.pt and the closing line on rank 0, run.callbacks' on_run_end, the result."""
    final = run.layout.state_dict(run.server.global_P)  # every rank holds the published model
    if book is not None:
        book.finish(last_round, final)
    if callbacks.paths(run.cfg.run.callbacks):  # on_run_end on rank 0; a failure ends every rank alike
        error = None
        if book is not None:
            book.callbacks.run_end(last_round)
            error = book.callbacks.error
        agree_with_rank_zero(comm, error)
    comm.barrier()
    run.client_states.close()
    return {"last_round": last_round, "global_P": run.server.global_P, "state_dict": final, "config": run.cfg}
