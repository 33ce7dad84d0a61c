"""A client's report as one float32 row, so a round needs a single collective whatever the rule
needs.

Legend: K clients, P flat elements, L conv layers, M report rows per rank, F floats per row.
"""

from __future__ import annotations

import math

import torch

from . import strategies

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

    def pack_round(self, rows_MF: torch.Tensor, rows: list[int], reports: list[dict]) -> None:
        """``pack_scalars`` for every client trained this round (their rows of ``rows_MF``): each
        field stacked across the clients on the device it was computed on, cast to float32 there
        (the same rounding on any device), the host's fields written with one host-to-device copy
        for the round (each a wait on a GPU), not one a client or a group."""
        if not rows:
            return
        order = sorted(range(len(rows)), key=rows.__getitem__)
        rows, reports = [rows[i] for i in order], [reports[i] for i in order]
        n, device, offset = len(rows), rows_MF.device, self.scalars.start
        # consecutive rows (a round without stragglers) are a slice: no index to copy over
        target = slice(rows[0], rows[0] + n) if rows[-1] - rows[0] == n - 1 else \
            torch.tensor(rows, dtype=torch.long, device=device)
        # pinned on a GPU run, so the copy over is queued, not waited for
        host_nS = torch.empty(n, self.scalars.stop - offset, pin_memory=device.type == "cuda")
        on_device = []
        for stack, sl in self.slices.items():
            if stack.endswith("_KP"):
                continue
            values_nW = torch.stack([torch.as_tensor(report[self.keys[stack]]).detach() for report in reports])
            columns = slice(sl.start - offset, sl.stop - offset)
            if values_nW.device == host_nS.device:
                host_nS[:, columns] = values_nW.reshape(n, -1)
            else:
                on_device.append((sl, values_nW.reshape(n, -1).to(torch.float32)))
        rows_MF[target, self.scalars] = host_nS.to(device, non_blocking=True) if device != host_nS.device else host_nS
        for sl, values_nW in on_device:
            rows_MF[target, sl] = values_nW.to(device)

    def _host_scalars(self, report: dict) -> torch.Tensor:
        return torch.cat([torch.as_tensor(report[self.keys[stack]]).detach().to("cpu", torch.float32).reshape(-1)
                          for stack in self.slices if not stack.endswith("_KP")])

    def unpack(self, rows_KF: torch.Tensor) -> dict[str, torch.Tensor]:
        stacks = {}
        for stack, sl in self.slices.items():
            block = rows_KF[:, sl]
            stacks[stack] = block[:, 0] if stack.endswith("_K") else block
        return stacks

    def straggler_row(self, row_F: torch.Tensor, steps: int) -> None:
        """A straggler does not train: only its step count travels, and rank 0 leaves its row out
        (one filter on rank 0 for the deadline, beside the drawn dropouts)."""
        row_F.fill_(math.nan)
        row_F[self.slices["num_steps_K"]] = steps
        row_F[self.slices["train_time_K"]] = 0.0


class RangeRow:
    """The row of one rank's range: [its columns of each [P] field | the report's scalars and
    eff_rank_L], each field from a multiple of ALIGN floats. ``pieces`` pairs the slices of a full
    report row (ReportLayout) with the slices of this row that they fill."""

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
