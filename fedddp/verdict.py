"""What every rank must agree on before it goes on: a failure on any rank, rank 0's refusal, and
a run that diverged. Each verdict is one small collective, so no rank waits forever at the next
one for a rank that has stopped."""

from __future__ import annotations

import torch

from .errors import DataError, DivergenceError, UserError


def agree_on_failure(comm, error: Exception | None, what: str = "its data") -> None:
    """Every rank learns whether any rank failed to load its data (or checkpoint), so none waits
    forever at the next collective; the rank that failed re-raises its own (named) error."""
    flag = torch.tensor([1.0 if error else 0.0], device=comm.device)
    comm.all_reduce_sum_(flag)
    if error is not None:
        raise error
    if flag.item() > 0:
        raise DataError(f"data: another rank could not load {what} (see its message)")


class RankZeroRefused(UserError):
    """Rank 0 stopped the run and said why in one line; the other ranks end with its status
    without saying it again."""

    def __init__(self, exit_code: int):
        super().__init__(f"rank 0 stopped the run (exit status {exit_code})")
        self.exit_code = exit_code


def agree_with_rank_zero(comm, error: Exception | None, value: int = 0) -> int:
    """Rank 0's verdict (its error's exit status, or 0 and ``value``) reaches every rank, so no
    rank waits forever at the next collective for a rank 0 that has stopped."""
    if comm.world_size == 1:  # no other rank to tell: no tensor made, none read
        if error is not None:
            raise error
        return int(value)
    verdict = torch.tensor([float(getattr(error, "exit_code", 1) if error else 0), float(value)],
                           dtype=torch.float64, device=comm.device)
    comm.broadcast_(verdict)
    if error is not None:
        raise error
    if verdict[0].item() != 0:
        raise RankZeroRefused(int(verdict[0].item()))
    return int(verdict[1].item())


def diverged(round_idx: int, train_loss: float | None, model_finite: bool, last_ckpt: str | None,
             lr: float, server_lr: float) -> DivergenceError:
    """The one line of a run whose model or training loss is not finite (exit 4)."""
    what = "the global model" if not model_finite else "the training loss"
    saved = f"last checkpoint {last_ckpt}" if last_ckpt else "no checkpoint yet"
    return DivergenceError(
        f"round {round_idx}: the run diverged: {what} is not finite (train loss {train_loss}); stopped "
        f"before writing anything of round {round_idx} ({saved}); likely cause: steps too large for this "
        f"model and data (train.lr = {lr}, algorithm.server_lr = {server_lr}): "
        "lower them and start over with run.overwrite=true")
