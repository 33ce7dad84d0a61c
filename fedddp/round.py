"""The round loop, top to bottom.

Legend: K sampled clients, P flat elements, M report rows per rank, F floats per report row.

Rounds are counted from 1. Every rank runs this same function; rank 0 also aggregates, writes
metrics, checkpoints' server part and final.pt.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch

from . import checkpoint, config, logs, outdir, participation, strategies, tasks
from .algorithms import describe as describe_algorithm, resolve as resolve_algorithm
from .client import ClientContext, check_one_sample_batches, planned_steps, train_client
from .client import rules as local_rules
from .client.state import fetch as fetch_client_states, open_store as open_client_states, send_home
from .data import ClientData, build as build_data
from .data.build import BUILT_WHOLE, LazyClients
from .errors import ConfigError, DataError, DivergenceError, UserError
from .flat import FlatLayout
from .models import build_model
from .sampling import (assign_clients, assign_groups, client_seed, expected_cost, layout_rows, owned_clients, owner,
                       sample_clients, travelling)

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
        values = [torch.as_tensor(report[self.keys[stack]]).detach().to("cpu", torch.float32).reshape(-1)
                  for stack in self.slices if not stack.endswith("_KP")]
        row_F[self.scalars].copy_(torch.cat(values))

    def unpack(self, rows_KF: torch.Tensor) -> dict[str, torch.Tensor]:
        stacks = {}
        for stack, sl in self.slices.items():
            block = rows_KF[:, sl]
            stacks[stack] = block[:, 0] if stack.endswith("_K") else block
        return stacks


class Progress:
    """One line on rank 0: round, test metric (accuracy or MAE), seconds per round, ETA.
    Rewritten in place on a terminal; on a log file one line per evaluation."""

    def __init__(self, total: int, enabled: bool, metric_key: str = "test_accuracy"):
        self.total, self.enabled = total, enabled
        self.metric_key, self.metric_label = metric_key, metric_key.removeprefix("test_")[:3]
        self.tty = sys.stderr.isatty()
        self.start, self.first = time.perf_counter(), None

    def update(self, round_idx: int, start_round: int, metrics: dict) -> None:
        if not self.enabled:
            return
        done = round_idx - start_round + 1
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - round_idx)
        acc = metrics.get(self.metric_key)
        acc_text = f"{self.metric_label} {acc:.4f}" if acc is not None else f"{self.metric_label}   -   "
        loss = metrics["train_loss"]
        loss_text = f"{loss:.4f}" if loss is not None else "  -   (no reports)"
        line = (f"round {round_idx}/{self.total} | {acc_text} | train loss {loss_text}"
                f" | {elapsed / done:.2f} s/round | ETA {int(eta) // 60}:{int(eta) % 60:02d}")
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
    same run identity."""
    lock, error, resume_round = None, None, 0
    if comm.is_main:
        try:
            lock = outdir.open_out_dir(cfg.run.out_dir)
            if cfg.run.tensorboard:
                logs.require_tensorboard()
            if cfg.run.resume:
                resume_round = _choose_checkpoint(cfg)
            else:
                outdir.refuse_or_clear(cfg.run.out_dir, cfg.run.overwrite)
        except Exception as exc:  # noqa: BLE001 - every rank learns of it, then it is re-raised
            error = exc
    try:
        resume_round = _agree_with_rank_zero(comm, error, resume_round)
        return _run(cfg, comm, resume_round)
    finally:
        if lock is not None:
            lock.release()


def _choose_checkpoint(cfg: config.Config) -> int:
    """The round of the newest complete checkpoint in out_dir, of this run (0: none yet)."""
    ckpt_root = os.path.join(cfg.run.out_dir, "checkpoints")
    folder, manifest, skipped = checkpoint.newest_complete(ckpt_root)
    if folder is None:
        if skipped:
            raise DataError(f"checkpoints: {len(skipped)} round folder(s) in {ckpt_root} but none is "
                            f"complete ({'; '.join(skipped)}); nothing to resume: start over with "
                            "run.resume=false run.overwrite=true")
        return 0
    changes = checkpoint.identity_changes(manifest["identity"], checkpoint.identity(cfg))
    if changes:
        raise ConfigError(f"run.resume: the checkpoint {folder} is of another run: {'; '.join(changes)}; "
                          "resume with its values, or start a new run in another run.out_dir")
    if manifest["round"] > cfg.run.rounds:
        raise ConfigError(f"run.rounds: {cfg.run.rounds} is below the round of the checkpoint {folder} "
                          f"({manifest['round']}); set run.rounds >= {manifest['round']} to continue it")
    why = f"; skipped {'; '.join(skipped)}" if skipped else ""
    print(f"fedddp: resuming from round {manifest['round']} ({folder}){why}", file=sys.stderr, flush=True)
    return manifest["round"]


def _run(cfg: config.Config, comm, resume_round: int) -> dict:
    rc = cfg.run
    torch.set_num_threads(rc.num_threads)
    # A caller's default dtype (fedddp.run from a float64 session) would build a float64 model.
    torch.set_default_dtype(torch.float32)
    device = comm.device
    ckpt_root = os.path.join(rc.out_dir, "checkpoints")
    local_name, server_name = resolve_algorithm(cfg)
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
    cost_K = [expected_cost(n, cfg.train) for n in data.num_samples]

    # -- model and flat vectors: the seeded init is identical on every rank ----------------
    torch.manual_seed(rc.seed)
    model = build_model(cfg, data.input_shape, data.num_classes, data.task).to(device)
    check_one_sample_batches(model, data.input_shape, data.num_samples, cfg)
    task = tasks.get(data.task)
    layout = FlatLayout(model, buffers=cfg.model.flat_buffers)
    global_P = layout.flatten(model).clone()
    state = strategy.init_state(global_P, cfg.algorithm)
    # per-client persistent state of the clients this rank owns (run.client_state: RAM or mmap)
    client_states = open_client_states(rc.client_state, owned, device=device, folder=os.path.join(
        rc.out_dir, "client_state", f"rank{comm.rank}"))
    num_layers = len(layout.conv_entries())
    static = _static_stacks(needs, cfg, layout, device)
    if rc.parallel_clients > 1:
        from .client.batched import BatchedTrainer
        batched = BatchedTrainer(model, layout, cfg, rule, needs, task)
        # one step tried on a client's samples: what vmap cannot run is one line now, not round 1's traceback
        first = next((c for c in (range(cfg.data.num_clients) if balanced else owned) if data.num_samples[c]), None)
        if first is not None:
            batched.try_step(data.train[first])
    report = ReportLayout(needs, layout.numel, num_layers)

    start_round, last_ckpt = 1, None
    if resume_round:
        last_ckpt = checkpoint.round_dir(ckpt_root, resume_round)
        try:
            saved, saved_clients = checkpoint.load(last_ckpt, set(owned), device)
        except DataError as exc:
            error = exc
        _agree_on_failure(comm, error, "the checkpoint")
        client_states.restore(saved_clients)
        del saved_clients
        global_P.copy_(saved["global_P"])
        state = saved["state"]
        start_round = int(saved["round"]) + 1
    comm.broadcast_(global_P)
    run_identity = checkpoint.identity(cfg)

    if comm.is_main:
        with outdir.disk_full_is_one_line("config.toml and metrics.jsonl", rc.out_dir, last_ckpt):
            checkpoint.atomic_write_text(config.dumps(cfg), os.path.join(rc.out_dir, "config.toml"))
            # metrics.jsonl, metrics.csv, clients.jsonl, tensorboard/: replaced by a fresh run,
            # cut back to the checkpoint's round by a resumed one
            run_logs = logs.RunLogs(rc.out_dir, start_round, rc.tensorboard)
    progress = Progress(rc.rounds, rc.progress and comm.is_main, task.metric_key)
    if comm.is_main:
        # Builds the fused CPU kernels now (if not cached), so round 1's aggregate_s leaves it
        # out; the line says which form of the rules produced this run's bits.
        form = strategies.kernels.describe(device, rule=server_name)
        if rc.progress:
            print(f"fedddp: {comm.world_size} rank(s) on {device.type}; {describe_algorithm(cfg)}; "
                  f"aggregation: {form}", file=sys.stderr, flush=True)
    num_sampled = cfg.num_sampled()
    last_round = start_round - 1

    rows_buffer, gather_buffer = torch.empty(0, report.width, device=device), None
    for round_idx in range(start_round, rc.rounds + 1):
        t_round = time.perf_counter()
        # -- sample: identical on every rank, no communication ------------------------------
        sampled = sample_clients(cfg.data.num_clients, num_sampled, rc.seed, round_idx)
        # clients that drop out neither train nor take a row; also drawn identically on every rank
        reporting = [c for c in sampled if not participation.drops_out(cfg, round_idx, c)]
        if rc.parallel_clients > 1:  # groups trained side by side, cut whatever the world size
            per_rank, groups_R = assign_groups(reporting, cost_K.__getitem__, comm.world_size, balanced,
                                               rc.parallel_clients)
        else:
            per_rank = assign_clients(reporting, cost_K.__getitem__, comm.world_size, balanced)
        mine = per_rank[comm.rank]
        rows_per_rank, row_order = layout_rows(reporting, comm.world_size, per_rank)
        # Report buffers live across rounds (fresh ones cost page faults every round); padding
        # rows keep stale values and are never read.
        if rows_buffer.shape[0] < rows_per_rank:
            rows_buffer = torch.empty(rows_per_rank, report.width, device=device)
            gather_buffer = torch.empty(comm.world_size * rows_per_rank, report.width, device=device) \
                if comm.is_main and comm.world_size > 1 else None
        rows_MF = rows_buffer[:rows_per_rank]

        # -- local training of this rank's sampled clients, one after another ----------------
        # (run.parallel_clients > 1: a group at a time, side by side; stragglers as below)
        server_view = {k: state[k] for k in strategy.client_visible}
        row_of = {cid: i for i, cid in enumerate(mine)}
        # every reporting client's local work and steps, drawn alike on every rank, so all agree
        # on the stragglers, which do not train and whose state stays home
        work_of = {c: participation.local_work(cfg, round_idx, c) for c in reporting}
        steps_of = {c: planned_steps(data.num_samples[c], cfg.train, work_of[c]) for c in reporting}
        straggles = lambda c: bool(rc.deadline_steps) and steps_of[c] > rc.deadline_steps  # noqa: E731
        # -- per-client state of the clients trained away from their owner: fetched here, sent
        # home after training; a client trained on its owner uses the store directly
        moves = travelling([c for c in reporting if not straggles(c)], per_rank, comm.world_size) \
            if rule.client_state else []
        visiting = fetch_client_states(comm, client_states, moves)

        def start(cid):
            """(row, local work, context) of a client that trains this round; None for a straggler,
            whose row then says only its step count."""
            i, work = row_of[cid], work_of[cid]
            if straggles(cid):
                _straggler_row(rows_MF[i], report, steps_of[cid])
                return None
            # a rule that declares no client_state keeps none, wherever its clients train
            home = rule.client_state and owner(cid, comm.world_size) == comm.rank
            return i, work, ClientContext(cid, round_idx, global_P, layout, cfg.algorithm, server_view,
                                          client_states.client(cid) if home else visiting.get(cid, {}), task=task)

        for group in groups_R[comm.rank] if rc.parallel_clients > 1 else ():
            trained = [(i, (ctx, data.train[ctx.client_id], client_seed(rc.seed, round_idx, ctx.client_id), work,
                            report.views(rows_MF[i]))) for i, work, ctx in filter(None, map(start, group))]
            if trained:
                batched.train_group([client for _, client in trained])
            for i, (*_, out) in trained:
                report.pack_scalars(rows_MF[i], out)
        for cid in mine if rc.parallel_clients == 1 else ():
            job = start(cid)
            if job is None:
                continue
            i, work, ctx = job
            layout.unflatten_into(global_P, model)
            out = report.views(rows_MF[i])
            t_client = time.perf_counter()
            train_client(model, ctx, data.train[cid], cfg, rule, needs,
                         client_seed(rc.seed, round_idx, cid), out, work)
            if device.type == "cuda":  # the client's kernels, not their queueing; one wait a client
                torch.cuda.synchronize(device)
            out["train_time"] = time.perf_counter() - t_client
            report.pack_scalars(rows_MF[i], out)
        send_home(comm, client_states, moves, visiting)

        # -- gather the reports, ordered by client id ---------------------------------------
        gathered = gather_buffer[:comm.world_size * rows_per_rank] if gather_buffer is not None else None
        rows_KF = comm.gather_rows(rows_MF, gathered)
        reported = reporting
        if comm.is_main:
            if row_order != list(range(rows_KF.shape[0])):
                rows_KF = rows_KF[torch.tensor(row_order, dtype=torch.long, device=device)]
            train_s_R = _per_rank_seconds(rows_KF[:, report.slices["train_time_K"]][:, 0], reporting,
                                          per_rank)
            if rc.deadline_steps:
                keep = participation.reporting_rows(rows_KF[:, report.slices["num_steps_K"]][:, 0],
                                                    rc.deadline_steps)
                rows_KF, reported = rows_KF[keep], [reporting[i] for i in keep.tolist()]
        t_gather = time.perf_counter()

        # -- aggregate on rank 0 (a round without reports leaves model and state as they were) --
        diagnostics, train_loss, stacks = {}, None, {}
        if comm.is_main and reported:
            stacks = report.unpack(rows_KF) | static
            global_P, state, diagnostics = strategy.aggregate(global_P, stacks, state, cfg.algorithm)
            train_loss = (strategies.client_weights_K(stacks, cfg.algorithm) @ stacks["train_loss_K"]).item()
        if comm.is_main and strategy.ledger is not None:
            diagnostics.update(strategy.ledger(state, static, cfg.algorithm))
        # -- divergence: a non-finite model or loss ends the run before this round writes anything
        error = None
        if comm.is_main and not ((train_loss is None or math.isfinite(train_loss))
                                 and bool(torch.isfinite(global_P).all())):
            error = _diverged(cfg, round_idx, train_loss, global_P, last_ckpt)
        _agree_with_rank_zero(comm, error)
        t_agg = time.perf_counter()

        # -- broadcast the new global model (and the state clients must see) ----------------
        global_P = global_P.contiguous()
        comm.broadcast_(global_P)
        for key in strategy.client_visible:
            comm.broadcast_(state[key])
        t_bcast = time.perf_counter()

        # -- evaluate ------------------------------------------------------------------------
        test_loss = test_metric = None
        if round_idx % rc.eval_every == 0 or round_idx == rc.rounds:
            layout.unflatten_into(global_P, model)
            test_loss, test_metric = evaluate(model, data.test, comm, task)
        t_eval = time.perf_counter()

        # -- checkpoint ----------------------------------------------------------------------
        stopping = rc.stop_after and round_idx == rc.stop_after
        if rc.ckpt_every and (round_idx % rc.ckpt_every == 0 or stopping):
            server = {"round": round_idx, "global_P": global_P.cpu(),
                      "state": {k: v.cpu() for k, v in state.items()},
                      "torch_rng": torch.get_rng_state()} if comm.is_main else None
            with outdir.disk_full_is_one_line(f"the checkpoint of round {round_idx}", ckpt_root, last_ckpt):
                last_ckpt = checkpoint.save(comm, ckpt_root, round_idx, server, client_states, run_identity)
        t_ckpt = time.perf_counter()

        if comm.is_main:
            # test_accuracy is always a key (the output contract). The metric goes under its
            # task's key: test_accuracy itself for classification; for regression test_mae, and
            # test_accuracy stays null, as it is on rounds without evaluation.
            line = {"round": round_idx, "train_loss": train_loss, "test_loss": test_loss,
                    "test_accuracy": None, task.metric_key: test_metric, "time_s": t_ckpt - t_round,
                    # rank 0's wait for slower ranks is their local training, not communication
                    "train_s": max(train_s_R), "train_imbalance_s": max(train_s_R) - min(train_s_R),
                    "communicate_s": max(0.0, (t_gather - t_round) - max(train_s_R)) + (t_bcast - t_agg),
                    "aggregate_s": t_agg - t_gather, "evaluate_s": t_eval - t_bcast,
                    "checkpoint_s": t_ckpt - t_eval, "clients": sampled, "num_reports": len(reported),
                    "dropped": sorted(set(sampled) - set(reported))}
            # metrics.jsonl and .csv, clients.jsonl (per-client diagnostics), tensorboard/
            rank_of = {c: r for r, clients in enumerate(per_rank) for c in clients}
            line = run_logs.write_round(line, diagnostics, stacks, reported, rank_of, last_ckpt)
            progress.update(round_idx, start_round, line)
        last_round = round_idx
        if stopping:
            break

    final = layout.state_dict(global_P)  # every rank holds the broadcast model (fedddp.run's result)
    if comm.is_main and last_round == rc.rounds:
        with outdir.disk_full_is_one_line("final.pt", rc.out_dir, last_ckpt):
            checkpoint.atomic_save(final, os.path.join(rc.out_dir, "final.pt"))
    elif comm.is_main and last_round == rc.stop_after:
        how = (f"continue from {last_ckpt} with run.resume=true" if last_ckpt else
               "no checkpoint was written (run.ckpt_every = 0), so run.resume=true would start over")
        print(f"fedddp: stopped after round {last_round} (run.stop_after); {how}", file=sys.stderr, flush=True)
    if comm.is_main:
        run_logs.close()
    comm.barrier()
    client_states.close()
    return {"last_round": last_round, "global_P": global_P, "state_dict": final}


def _straggler_row(row_F: torch.Tensor, report: ReportLayout, steps: int) -> None:
    """A straggler does not train: only its step count travels, and rank 0 leaves its row out
    (one filter on rank 0 for the deadline, beside the drawn dropouts)."""
    row_F.fill_(math.nan)
    row_F[report.slices["num_steps_K"]] = steps
    row_F[report.slices["train_time_K"]] = 0.0


def _static_stacks(needs: frozenset, cfg, layout: FlatLayout, device) -> dict[str, torch.Tensor]:
    """Stacks that are not client reports but fixed for the run: conv_runs_R3 (FedER),
    param_mask_P (FedSMOO), and the scalars num_clients (N: SCAFFOLD, FedSMOO, DP-FedAvg),
    client_momentum (FedNova's rho), num_sampled and noise_seed (DP-FedAvg)."""
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
        static["num_sampled"] = torch.tensor(float(cfg.num_sampled()), device=device)
    if "noise_seed" in needs:
        static["noise_seed"] = torch.tensor(cfg.run.seed, dtype=torch.int64)
    return static


def _per_rank_seconds(train_time_K: torch.Tensor, sampled: list[int], per_rank: list[list[int]]) -> list[float]:
    rank_of = {c: r for r, clients in enumerate(per_rank) for c in clients}
    seconds = [0.0] * len(per_rank)
    for cid, sec in zip(sampled, train_time_K.tolist()):
        seconds[rank_of[cid]] += sec
    return seconds


def _diverged(cfg: config.Config, round_idx: int, train_loss: float, global_P: torch.Tensor,
              last_ckpt: str | None) -> DivergenceError:
    what = "the global model" if not bool(torch.isfinite(global_P).all()) else "the training loss"
    saved = f"last checkpoint {last_ckpt}" if last_ckpt else "no checkpoint yet"
    return DivergenceError(
        f"round {round_idx}: the run diverged: {what} is not finite (train loss {train_loss}); stopped "
        f"before writing anything of round {round_idx} ({saved}); likely cause: steps too large for this "
        f"model and data (train.lr = {cfg.train.lr}, algorithm.server_lr = {cfg.algorithm.server_lr}): "
        "lower them and start over with run.overwrite=true")

