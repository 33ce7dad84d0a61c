"""Client optimizers and learning-rate schedules.

Optimizer state policy: a client gets a fresh optimizer every round (the papers' default; no
momentum or Adam moments survive between rounds). StepLR is computed in closed form from the
round (``lr_schedule_unit = "round"``) or from the number of local epochs run so far by this
client's position in the schedule (``"epoch"``: (round - 1) * local_epochs + epoch), so it needs
no state and is identical on every rank.
"""

from __future__ import annotations

import torch


def lr_at(tc, round_idx: int, epochs_done: int) -> float:
    if tc.lr_schedule == "none":
        return tc.lr
    count = round_idx - 1 if tc.lr_schedule_unit == "round" else epochs_done
    return tc.lr * tc.lr_gamma ** (count // tc.lr_step_size)


def build_optimizer(tc, params, lr: float) -> torch.optim.Optimizer:
    if tc.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=tc.momentum, weight_decay=tc.weight_decay)
    if tc.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=tc.weight_decay)
    if tc.optimizer == "adamp":
        from adamp import AdamP
        return AdamP(params, lr=lr, betas=(0.9, 0.999), delta=0.1, wd_ratio=0.1,
                     weight_decay=tc.weight_decay)
    if tc.optimizer == "rmsgd":
        from rmsgd import RMSGD
        return RMSGD(params, lr=lr, weight_decay=tc.weight_decay)
    raise AssertionError(tc.optimizer)  # config validation names the choices


def epoch_end(optimizer, tc, round_idx: int, epochs_done: int) -> None:
    """Between local epochs: RMSGD's per-epoch step, and the epoch-unit StepLR."""
    if hasattr(optimizer, "epoch_step"):
        optimizer.epoch_step()
    if tc.lr_schedule != "none" and tc.lr_schedule_unit == "epoch":
        for group in optimizer.param_groups:
            group["lr"] = lr_at(tc, round_idx, epochs_done)
