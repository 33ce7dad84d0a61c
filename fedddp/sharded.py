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
from .strategies import Span, Strategy

# As round.ALIGN: every [P] field of a range row starts on a multiple of 16 floats and a row is a
# multiple of 16 floats wide, so the fused Triton kernels take 4-float vector loads here too.
ALIGN = 16


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class RangeRow:
    """The row of one rank's range: [its columns of each [P] field | the report's scalars and
    eff_rank_L], each field from a multiple of ALIGN floats. ``pieces`` pairs the slices of a full
    report row (round.ReportLayout) with the slices of this row that they fill."""

    def __init__(self, report, start: int, stop: int):
        self.slices: dict[str, slice] = {}
        self.pieces: list[tuple[slice, slice]] = []
        offset, n = 0, stop - start
        for stack, sl in report.slices.items():
            if stack.endswith("_KP"):
                self.slices[stack] = slice(offset, offset + n)
                if n:
                    self.pieces.append((slice(sl.start + start, sl.start + stop), slice(offset, offset + n)))
                offset = _aligned(offset + n)
        tail = report.scalars
        for stack, sl in report.slices.items():
            if not stack.endswith("_KP"):
                self.slices[stack] = slice(offset + sl.start - tail.start, offset + sl.stop - tail.start)
        self.pieces.append((tail, slice(offset, offset + tail.stop - tail.start)))
        self.width = _aligned(offset + tail.stop - tail.start)

    def unpack(self, rows_KX: torch.Tensor) -> dict[str, torch.Tensor]:
        return {stack: rows_KX[:, sl][:, 0] if stack.endswith("_K") else rows_KX[:, sl]
                for stack, sl in self.slices.items()}


def cut_static(static: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    """The static stacks of the range [start, stop): param_mask_P cut, conv_runs_R3 cut and
    counted from ``start``, the scalars as they are."""
    cut = dict(static)
    if "param_mask_P" in cut:
        cut["param_mask_P"] = static["param_mask_P"][start:stop]
    if "conv_runs_R3" in cut:
        cut["conv_runs_R3"] = runs_within(static["conv_runs_R3"].cpu(), start, stop).to(static["conv_runs_R3"].device)
    return cut


class ShardedServer:
    """This rank's part of the sharded server: its range, the rows of every rank's range, the
    receive buffer (kept across rounds: fresh buffers cost page faults) and the Span its rule
    works on."""

    def __init__(self, comm, report, numel: int, width: int, strategy: Strategy, static: dict, device):
        self.comm, self.numel, self.width = comm, numel, width
        self.rank, self.world_size = comm.rank, comm.world_size
        self.ranges = column_ranges(numel, width, comm.world_size)
        self.start, self.stop = self.ranges[comm.rank]
        self.rows = [RangeRow(report, c0, c1) for c0, c1 in self.ranges]
        self.mine = self.rows[comm.rank]
        self.visible = tuple(strategy.client_visible)
        self.static = cut_static(static, self.start, self.stop)
        self.device = torch.device(device)
        self.buffer = torch.empty(0, self.mine.width, device=self.device)
        self.span = Span(self.start, self.stop, numel, width, self.device, self._gather_blocks, self.gather_vector)
        self.pending: tuple | None = None   # (new range, new state) between aggregate and publish
        self.ranged: set[str] = set()       # the state entries kept as this rank's range (adopt)

    def describe(self) -> str:
        return (f"sharded over {self.world_size} rank(s), {num_blocks(self.numel, self.width)} block(s) of "
                f"{self.width} columns")

    # -- state ------------------------------------------------------------------------------------

    def adopt(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The round-1 state (init_state's, whole) as this rank keeps it; it also says which
        entries live as ranges: the [P] ones that clients do not see."""
        self.ranged = {k for k, v in state.items()
                       if k not in self.visible and v.dim() == 1 and v.shape[0] == self.numel}
        return self.cut_state(state)

    def cut_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state as this rank keeps it: each ranged entry that is whole (init_state's, a gathered
        checkpoint's) cut to the range; one read back over the range (a sharded checkpoint's)
        stays."""
        return {k: v[self.start:self.stop].clone() if k in self.ranged and v.shape[0] == self.numel else v
                for k, v in state.items()}

    def checkpoint_parts(self, state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        """(the entries rank 0 saves in server.pt, this rank's shard: its range of the others)."""
        shard = {"start": self.start, "stop": self.stop, "numel": self.numel,
                 "state": {k: state[k].cpu() for k in sorted(self.ranged)}}
        return {k: v for k, v in state.items() if k not in self.ranged}, shard

    # -- the round ------------------------------------------------------------------------------

    def exchange(self, plan, rows_MF: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Every reported client's row cut to this rank's range, in client-id order: ([K, X], the
        reported clients). Every rank sends the pieces of its own rows to their ranks."""
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
                for dst, row in enumerate(self.rows):
                    for full, piece in row.pieces:
                        if dst == self.rank:
                            rows_KX[position[cid], piece].copy_(rows_MF[i, full])
                        else:
                            sends.append((dst, rows_MF[i, full]))
        self.comm.exchange(sends, recvs)
        return rows_KX, reported

    def aggregate(self, strategy: Strategy, global_P: torch.Tensor, rows_KX: torch.Tensor, state: dict, hp):
        """The rule on this rank's range: (its stacks, the new state, diagnostics); the new range
        (and the state's client-visible ranges) wait in ``pending`` for ``publish``. Client-visible
        entries reach the rule cut to the range."""
        stacks = self.mine.unpack(rows_KX) | self.static
        view = {k: v[self.start:self.stop] if k in self.visible and v.shape[0] == self.numel else v
                for k, v in state.items()}
        new_range, new_state, diagnostics = strategy.aggregate_span(global_P[self.start:self.stop], stacks, view, hp,
                                                                    self.span)
        self.pending = (new_range, new_state)
        return stacks, new_state, diagnostics

    def publish(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The pending ranges all-gathered: (the new [P] model, the new state, client-visible
        entries whole) on every rank."""
        new_range, state = self.pending
        self.pending = None
        grow = [k for k in self.visible if state[k].shape[0] != self.numel]
        wholes = self._all_gather([new_range] + [state[k] for k in grow])
        return wholes[0], state | dict(zip(grow, wholes[1:]))

    def range_finite(self) -> bool:
        return self.pending is None or bool(torch.isfinite(self.pending[0]).all())

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
