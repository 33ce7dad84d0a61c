"""The server: how a round's reports reach the server rule, and the new model every rank.

Two forms behind one interface: ``GatheredServer`` brings every report row to rank 0, which runs
the rule's whole-vector form and broadcasts the model; ``ShardedServer`` (sharded.py,
run.aggregation = sharded, for a rule with a range form) has every rank run the rule on its own
range of the flat vector. Setup chooses one (prepare.server_of); the round calls the same methods
of either: ``rows``, ``exchange``, ``aggregate``, ``publish``, ``checkpoint_parts``. A third form
(hierarchical, secure aggregation) would be a third class.

Legend: K reporting clients, P flat elements, F floats per report row, M report rows per rank.
"""

from __future__ import annotations

import math

import torch

from . import logs, participation, strategies
from .errors import PluginError
from .report import ReportLayout
from .verdict import agree_with_rank_zero, diverged

# the report columns clients.jsonl writes of each client (logs.py), read with the round's checks
CLIENT_COLUMNS = ("train_loss_K", "train_time_K", "num_samples_K", "num_steps_K")


class Server:
    """What both forms share: the model and server state after the last publish (``global_P``,
    ``state``), the round's report rows, and one verdict on a failed rule or a diverged run."""

    def __init__(self, comm, strategy: strategies.Strategy, report: ReportLayout, static: dict, hp,
                 every_round: bool, lrs: tuple[float, float], global_P: torch.Tensor, state: dict):
        self.comm, self.strategy, self.report, self.static, self.hp = comm, strategy, report, static, hp
        # a private rule under Poisson sampling aggregates every round, also one without reports
        self.every_round = every_round
        self.lrs = lrs  # (train.lr, algorithm.server_lr): the divergence line names them
        self.global_P, self.state = global_P, state
        # the report rows live across rounds (fresh ones cost page faults every round); padding
        # rows keep stale values and are never read
        self.rows_buffer = torch.empty(0, report.width, device=comm.device)

    def rows(self, rows_per_rank: int) -> torch.Tensor:
        """This rank's [M, F] report rows for the round."""
        if self.rows_buffer.shape[0] < rows_per_rank:
            self.rows_buffer = torch.empty(rows_per_rank, self.report.width, device=self.comm.device)
            self._rows_grown(rows_per_rank)
        return self.rows_buffer[:rows_per_rank]

    def aggregate(self, round_idx: int, rows, reported: list[int], reporting: bool, last_ckpt: str | None,
                  train_time_K: torch.Tensor | None = None):
        """The server rule (a round without reports leaves model and state as they were, but for
        a private rule under Poisson sampling, whose noise is released every round), then every
        rank learns whether the rule failed or the run diverged: a non-finite model or loss ends
        the run before this round writes anything. ``reporting``: the round evaluates, so the
        privacy spent is written with its accuracy. ``train_time_K``: ``exchange``'s seconds of
        each client. Returns (diagnostics, train loss, client columns, seconds of each client).
        On rank 0 the round's checks, losses, client columns and diagnostics are read from the
        device at once (``read_once``: one wait on a GPU, not one a value): the diagnostics and
        columns come back as host values (floats, lists), the seconds as a list; other ranks get
        their own (diagnostics, None, stacks, None)."""
        diagnostics, train_loss_t, stacks, error = {}, None, {}, None
        if self.aggregates_here():
            try:
                if reported or self.every_round:
                    stacks, diagnostics = self._apply(rows)
                if reported:
                    train_loss_t = strategies.client_weights_K(stacks, self.hp) @ stacks["train_loss_K"]
                if self.comm.is_main:
                    diagnostics.update(self._state_rows(reporting))
            except PluginError as exc:  # a plugin rule's own failure: every rank ends with its status
                error = exc
        flags = self._failure_flags(error)
        train_loss, seconds = None, None
        if self.comm.is_main and error is None:
            # keyed by (part, name): a rule's diagnostic may share a name with a column
            parts = {("round", "flags"): flags, ("round", "train_loss"): train_loss_t,
                     ("round", "seconds"): train_time_K} \
                | {("column", k): stacks[k] for k in CLIENT_COLUMNS if k in stacks} \
                | {("diagnostic", k): v for k, v in diagnostics.items()}
            read = read_once(parts, self.global_P.device, as_lists={("round", "seconds")} | {
                (part, k) for part, k in parts if part == "column" or logs.per_client_name(k)})
            train_loss, seconds = read["round", "train_loss"], read["round", "seconds"]
            stacks = {k: v for (part, k), v in read.items() if part == "column"}
            diagnostics = {k: v for (part, k), v in read.items() if part == "diagnostic"}
            failed_elsewhere, model_finite = read["round", "flags"][0] > 0, read["round", "flags"][1] == 0
            if failed_elsewhere:
                error = PluginError(f"algorithm.name: the server rule {self.strategy.name} raised on another rank "
                                    "(see its message)")
            elif not (model_finite and (train_loss is None or math.isfinite(train_loss))):
                error = diverged(round_idx, train_loss, model_finite, last_ckpt, *self.lrs)
        agree_with_rank_zero(self.comm, error)
        return diagnostics, train_loss, stacks, seconds

    def _state_rows(self, reporting: bool) -> dict:
        """Rank 0's rows on the server state itself: the rule's ledger (every round) and the
        privacy spent (epsilon, on the rounds that evaluate; None on the others)."""
        rows, strategy = {}, self.strategy
        if strategy.ledger is not None:
            rows.update(strategy.ledger(self.state, self.static, self.hp))
        if strategy.spent is not None:
            eps = strategy.spent(self.state, self.static, self.hp) if reporting else None
            rows["epsilon"] = torch.tensor(eps, dtype=torch.float64) if eps is not None else None
        return rows

    def warm_up(self, num_rows: int) -> None:
        """Runs the rule once on made-up rows where its fused form compiles on first use; a form
        without such a step does nothing."""

    # the form's own parts
    def _rows_grown(self, rows_per_rank: int) -> None: ...
    def aggregates_here(self) -> bool: ...
    def _apply(self, rows) -> tuple[dict, dict]: ...
    def _failure_flags(self, error) -> torch.Tensor | None: ...
    def exchange(self, plan, rows_MF: torch.Tensor): ...
    def publish(self) -> None: ...
    def checkpoint_parts(self) -> tuple[dict, dict | None]: ...
    def restore(self, global_P: torch.Tensor, state: dict) -> None: ...
    def describe(self, form: str) -> str: ...
    checkpoint_columns: tuple[int, int] | None = None  # the columns of a checkpoint this rank reads


class GatheredServer(Server):
    """Every report row to rank 0 in one gather; rank 0 runs the rule on the whole vector and
    broadcasts the new model (and the state entries clients see, e.g. SCAFFOLD's c)."""

    def __init__(self, *args, unsharded_rule: bool = False):
        super().__init__(*args)
        self.gather_buffer: torch.Tensor | None = None
        # run.aggregation = sharded for a rule without a range form: the start line says so
        self.unsharded_rule = unsharded_rule

    def _rows_grown(self, rows_per_rank: int) -> None:
        comm = self.comm
        self.gather_buffer = torch.empty(comm.world_size * rows_per_rank, self.report.width, device=comm.device) \
            if comm.is_main and comm.world_size > 1 else None

    def exchange(self, plan, rows_MF: torch.Tensor):
        """All ranks' rows to rank 0, in client-id order, less the rows of the clients past the
        deadline: (rows_KF, the reporting clients, the seconds each of them trained, on the
        device: ``aggregate`` reads them with the rest); on other ranks (None, the reporting
        clients, None)."""
        comm = self.comm
        gathered = self.gather_buffer[:comm.world_size * plan.rows_per_rank] if self.gather_buffer is not None else None
        rows_KF = comm.gather_rows(rows_MF, gathered)
        if not comm.is_main:
            return None, plan.reporting, None
        slices, reported = self.report.slices, plan.reporting
        if plan.row_order != list(range(rows_KF.shape[0])):
            rows_KF = rows_KF[torch.tensor(plan.row_order, dtype=torch.long, device=comm.device)]
        if plan.deadline_steps:
            keep = participation.reporting_rows(rows_KF[:, slices["num_steps_K"]][:, 0], plan.deadline_steps)
            rows_KF, reported = rows_KF[keep], [plan.reporting[i] for i in keep.tolist()]
        train_time_K = rows_KF[:, slices["train_time_K"]][:, 0]  # the stragglers' 0 s left out
        return rows_KF, reported, train_time_K

    def aggregates_here(self) -> bool:
        return self.comm.is_main

    def _apply(self, rows_KF) -> tuple[dict, dict]:
        stacks = self.report.unpack(rows_KF) | self.static
        self.global_P, self.state, diagnostics = self.strategy.aggregate(self.global_P, stacks, self.state, self.hp)
        return stacks, diagnostics

    def _failure_flags(self, error) -> torch.Tensor | None:
        """[a rank failed, the model is not finite] on the device, for ``read_once``; only rank 0
        ran the rule: no other rank can have failed, and only its model is new."""
        if not self.comm.is_main or error is not None:
            return None
        flags = torch.zeros(2, dtype=torch.float64, device=self.global_P.device)
        flags[1] = torch.isfinite(self.global_P).all().logical_not()
        return flags

    def publish(self) -> None:
        self.global_P = self.global_P.contiguous()
        self.comm.broadcast_(self.global_P)
        for key in self.strategy.client_visible:
            self.comm.broadcast_(self.state[key])

    def checkpoint_parts(self) -> tuple[dict, None]:
        return self.state, None

    def restore(self, global_P: torch.Tensor, state: dict) -> None:
        self.global_P.copy_(global_P)
        self.state = state

    def describe(self, form: str) -> str:
        if self.unsharded_rule:
            return f"gathered on rank 0 (the server rule {self.strategy.name} has no sharded form); {form}"
        return form

    def warm_up(self, num_rows: int) -> None:
        """The rule on a made-up stack, every report zero but one sample a client, where its fused
        form (strategies/kernels.py) compiles on first use."""
        if not self.comm.is_main or self.strategy.name not in strategies.kernels.RULES:
            return
        rows = 1 if num_rows == 1 else 16 if num_rows % 16 == 0 else 2  # Triton's specialisations of K
        rows_KF = torch.zeros(rows, self.report.width, device=self.comm.device)
        stacks = self.report.unpack(rows_KF) | self.static
        stacks["num_samples_K"].fill_(1.0)
        hp, global_P = self.hp, self.global_P
        self.strategy.aggregate(global_P.clone(), stacks, self.strategy.init_state(global_P.clone(), hp), hp)


def per_rank_seconds(train_time_K: list[float], sampled: list[int], per_rank: list[list[int]]) -> list[float]:
    """Each rank's seconds of local training this round, from the clients' rows (read on the host)."""
    rank_of = {c: r for r, clients in enumerate(per_rank) for c in clients}
    seconds = [0.0] * len(per_rank)
    for cid, sec in zip(sampled, train_time_K):
        seconds[rank_of[cid]] += sec
    return seconds


def read_once(parts: dict, device: torch.device, as_lists=()) -> dict:
    """The round's host values in one read from the device: every floating tensor of ``parts``
    on ``device`` flattened into one float64 vector and read with a single ``.tolist()`` (float64
    holds every float32 value exactly, so each comes back as its own ``.item()`` would), then
    cut back as ``.tolist()`` gives them for the keys ``as_lists``, and for the others as
    logs.to_json does (a one-element tensor a float, others ``.tolist()``). Other values (None,
    Python numbers, integer tensors, tensors on the host) as they are."""
    read = {k: v for k, v in parts.items()
            if isinstance(v, torch.Tensor) and v.device == device and v.is_floating_point()}
    if not read:
        return dict(parts)
    flat = torch.cat([v.detach().reshape(-1).to(torch.float64) for v in read.values()]).tolist()
    out, at = dict(parts), 0
    for key, value in read.items():
        n = value.numel()
        out[key] = flat[at] if n == 1 and key not in as_lists else _nested(flat[at:at + n], list(value.shape))
        at += n
    return out


def _nested(flat: list, shape: list[int]) -> list:
    """``flat`` in ``shape``, as ``.tolist()`` nests it."""
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nested(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
