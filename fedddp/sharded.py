"""The sharded server (run.aggregation = sharded): every rank aggregates its own range of the
flat vector, and the ranges are all-gathered into the new model.

Legend: K reporting clients, P flat elements, F floats per report row, M report rows per rank,
W ranks, n = stop - start the columns of this rank's range, X floats per range row.

The flat vector is cut into fixed blocks (fedddp.blocks, run.aggregation_block columns each) and
rank r owns a contiguous range of whole blocks. A round:

  exchange   each reported row's columns of rank d's range (every [P] field of the report) and
             its scalars go to rank d, point to point (Comm.exchange: gloo has no all_to_all),
             straight from the sender's report row into the receiver's [K, X] rows, which are
             in client-id order; a rank's own rows are copied. Stragglers (run.deadline_steps)
             send nothing: the plan says who they are on every rank.
  aggregate  every rank runs the rule's ``aggregate_span`` over its range (strategies.Span):
             block by block, sums over the whole vector per block and then over every rank's
             blocks in block order.
  publish    the new ranges are all-gathered into a fresh [P] model on every rank, with the
             client-visible state (SCAFFOLD's c) that the rule returned as ranges.

Traffic per rank and round (float32, F_P the [P] fields' floats per row, s the scalars): it sends
its M rows' other ranges, about M F_P (W - 1) / W floats, plus M s per other rank, and receives
the K rows of its own range from the other ranks, about K F_P (W - 1) / W^2; the all-gather sends
n (W - 1) and receives P - n. The gathered round instead brings K F_P (W - 1) / W to rank 0 and
broadcasts P from it.

State: a [P] entry of the server state that clients do not see (FedMom's previous model,
FedAdam's moments, FedSMOO's drift sum) lives as this rank's range only; a client-visible one
whole on every rank; scalars on every rank. A checkpoint keeps the ranges in one file per rank
(checkpoint.write_files's ``server_shard``), read back over any world size.
"""

from __future__ import annotations

import torch

from .blocks import block_range, column_ranges, num_blocks
from .flat import runs_within
from .report import RangeRow
from .server import Server
from .strategies import Span, Strategy


def cut_static(static: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    """The static stacks of the range [start, stop): param_mask_P cut, conv_runs_R3 cut and
    counted from ``start``, the scalars as they are."""
    cut = dict(static)
    if "param_mask_P" in cut:
        cut["param_mask_P"] = static["param_mask_P"][start:stop]
    if "conv_runs_R3" in cut:
        cut["conv_runs_R3"] = runs_within(static["conv_runs_R3"].cpu(), start, stop).to(static["conv_runs_R3"].device)
    return cut


class ShardedServer(Server):
    """This rank's part of the sharded server: its range, the rows of every rank's range, the
    receive buffer (kept across rounds: fresh buffers cost page faults) and the Span its rule
    works on."""

    def __init__(self, comm, strategy: Strategy, report, static: dict, hp, every_round: bool, lrs, global_P, state,
                 block: int):
        super().__init__(comm, strategy, report, static, hp, every_round, lrs, global_P, state)
        numel = global_P.numel()
        self.numel, self.width = numel, block
        self.rank, self.world_size = comm.rank, comm.world_size
        self.ranges = column_ranges(numel, block, comm.world_size)
        self.start, self.stop = self.ranges[comm.rank]
        self.checkpoint_columns = (self.start, self.stop)
        self.range_rows = [RangeRow(report, c0, c1) for c0, c1 in self.ranges]
        self.mine = self.range_rows[comm.rank]
        self.visible = tuple(strategy.client_visible)
        self.range_static = cut_static(static, self.start, self.stop)
        self.device = global_P.device
        self.buffer = torch.empty(0, self.mine.width, device=self.device)
        self.span = Span(self.start, self.stop, numel, block, self.device, self._gather_blocks, self.gather_vector)
        self.pending: tuple | None = None   # (new range, new state) between aggregate and publish
        # the state entries kept as this rank's range: the [P] ones that clients do not see
        self.ranged = {k for k, v in state.items()
                       if k not in self.visible and v.dim() == 1 and v.shape[0] == self.numel}
        self.state = self.cut_state(state)

    def describe(self, form: str) -> str:
        return (f"sharded over {self.world_size} rank(s), {num_blocks(self.numel, self.width)} block(s) of "
                f"{self.width} columns; {form}")

    # -- state ------------------------------------------------------------------------------------

    def cut_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state as this rank keeps it: each ranged entry that is whole (init_state's, a gathered
        checkpoint's) cut to the range; one read back over the range (a sharded checkpoint's)
        stays."""
        return {k: v[self.start:self.stop].clone() if k in self.ranged and v.shape[0] == self.numel else v
                for k, v in state.items()}

    def restore(self, global_P: torch.Tensor, state: dict) -> None:
        self.global_P.copy_(global_P)
        self.state = self.cut_state(state)

    def checkpoint_parts(self) -> tuple[dict, dict]:
        """(the entries rank 0 saves in server.pt, this rank's shard: its range of the others)."""
        state = self.state
        shard = {"start": self.start, "stop": self.stop, "numel": self.numel,
                 "state": {k: state[k].cpu() for k in sorted(self.ranged)}}
        return {k: v for k, v in state.items() if k not in self.ranged}, shard

    # -- the round ------------------------------------------------------------------------------

    def exchange(self, plan, rows_MF: torch.Tensor):
        """Every reported client's row cut to this rank's range, in client-id order, on every rank:
        ([K, X], the reported clients, on rank 0 the seconds each of them trained (on the device:
        ``aggregate`` reads them with the rest), else None)."""
        rows_KX, reported = self._exchange(plan, rows_MF)
        if not self.comm.is_main:
            return rows_KX, reported, None
        return rows_KX, reported, self.mine.unpack(rows_KX)["train_time_K"]  # stragglers send none

    def _exchange(self, plan, rows_MF: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Every rank sends the pieces of its own rows to their ranks."""
        reported = [c for c in plan.reporting if not plan.straggles(c)]
        position = {c: i for i, c in enumerate(reported)}
        if self.world_size == 1:  # the rows are this rank's already: as the gathered path takes them
            index = [i for _, i in sorted((cid, i) for i, cid in enumerate(plan.per_rank[0]) if cid in position)]
            if index == list(range(len(index))):
                return rows_MF[:len(index)], reported
            return rows_MF[torch.tensor(index, dtype=torch.long, device=rows_MF.device)], reported
        if self.buffer.shape[0] < len(reported):
            self.buffer = torch.empty(len(reported), self.mine.width, device=self.device)
        rows_KX = self.buffer[:len(reported)]
        sends, recvs = [], []
        for src, clients in enumerate(plan.per_rank):
            for i, cid in enumerate(clients):
                if cid not in position:
                    continue
                if src != self.rank:
                    recvs += [(src, rows_KX[position[cid], piece]) for _, piece in self.mine.pieces]
                    continue
                for dst, row in enumerate(self.range_rows):
                    for full, piece in row.pieces:
                        if dst == self.rank:
                            rows_KX[position[cid], piece].copy_(rows_MF[i, full])
                        else:
                            sends.append((dst, rows_MF[i, full]))
        self.comm.exchange(sends, recvs)
        return rows_KX, reported

    def aggregates_here(self) -> bool:
        return True  # every rank, on its range

    def _apply(self, rows_KX: torch.Tensor) -> tuple[dict, dict]:
        """The rule on this rank's range: (its stacks, diagnostics); the new range (and the
        state's client-visible ranges) wait in ``pending`` for ``publish``. Client-visible
        entries reach the rule cut to the range."""
        stacks = self.mine.unpack(rows_KX) | self.range_static
        view = {k: v[self.start:self.stop] if k in self.visible and v.shape[0] == self.numel else v
                for k, v in self.state.items()}
        new_range, self.state, diagnostics = self.strategy.aggregate_span(self.global_P[self.start:self.stop], stacks,
                                                                          view, self.hp, self.span)
        self.pending = (new_range, self.state)
        return stacks, diagnostics

    def _failure_flags(self, error) -> torch.Tensor:
        """Every rank ran the rule on its range: one all-reduce of [ranks that failed, ranges not
        finite], left on the device for rank 0's one read (``read_once``)."""
        flags = torch.zeros(2, dtype=torch.float64, device=self.comm.device)
        flags[0] = float(error is not None)
        if self.pending is not None:
            flags[1] = torch.isfinite(self.pending[0]).all().logical_not()
        self.comm.all_reduce_sum_(flags)
        return flags

    def publish(self) -> None:
        """The pending ranges all-gathered: the new [P] model and the new state, client-visible
        entries whole, on every rank (a round without reports has none)."""
        if self.pending is None:
            return
        new_range, state = self.pending
        self.pending = None
        grow = [k for k in self.visible if state[k].shape[0] != self.numel]
        wholes = self._all_gather([new_range] + [state[k] for k in grow])
        self.global_P, self.state = wholes[0], state | dict(zip(grow, wholes[1:]))

    # -- collectives over the ranges --------------------------------------------------------------

    def _all_gather(self, ranges: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each of this rank's [n] ranges -> the whole [P] vector on every rank, in one exchange."""
        if self.world_size == 1:   # the range is the whole vector
            return list(ranges)
        wholes, sends, recvs = [], [], []
        for part in ranges:
            whole = torch.empty(self.numel, dtype=part.dtype, device=part.device)
            whole[self.start:self.stop] = part
            for peer, (c0, c1) in enumerate(self.ranges):
                if peer != self.rank and self.stop > self.start:
                    sends.append((peer, whole[self.start:self.stop]))
                if peer != self.rank and c1 > c0:
                    recvs.append((peer, whole[c0:c1]))
            wholes.append(whole)
        self.comm.exchange(sends, recvs)
        return wholes

    def gather_vector(self, part: torch.Tensor) -> torch.Tensor:
        return self._all_gather([part.contiguous()])[0]

    def _gather_blocks(self, rows_bX: torch.Tensor) -> torch.Tensor:
        """[this rank's blocks, X] -> [every block, X] in block order, on every rank."""
        owned = [block_range(self.numel, self.width, r, self.world_size) for r in range(self.world_size)]
        every = torch.empty(num_blocks(self.numel, self.width), rows_bX.shape[1], dtype=rows_bX.dtype,
                            device=rows_bX.device)
        b0, b1 = owned[self.rank]
        every[b0:b1] = rows_bX
        sends = [(peer, every[b0:b1]) for peer in range(self.world_size) if peer != self.rank and b1 > b0]
        recvs = [(peer, every[p0:p1]) for peer, (p0, p1) in enumerate(owned) if peer != self.rank and p1 > p0]
        self.comm.exchange(sends, recvs)
        return every
