"""Client optimizers and learning-rate schedules.

Optimizer state policy: a client gets a fresh optimizer every round (the papers' default; no
momentum buffer, Adam moment or RMSGD metric survives between rounds).

  sgd    torch SGD (train.momentum, train.weight_decay, train.nesterov)
  adam   torch Adam, betas (0.9, 0.999)
  adamp  the ``adamp`` package (Heo et al. 2021): betas (0.9, 0.999), delta 0.1, wd_ratio 0.1
  rmsgd  the ``rmsgd`` package (Hosseini et al.): RMSGD(params, lr, beta, momentum, weight_decay);
         its own step_size/gamma schedule is not used. It keeps one rate per layer
         (``lr_vector``, from the conv layers' stable rank) and ignores ``param_groups``' lr.

StepLR is computed in closed form, so it needs no state and is identical on every rank:
lr * gamma ** (count // step_size), where count is the round - 1 (``lr_schedule_unit =
"round"``: fixed within a round) or the local-epoch clock (round - 1) * local_epochs + epoch
(``"epoch"``: the rate changes between a client's local epochs). RMSGD ignores the group lr,
so with RMSGD the schedule only sets each fresh optimizer's initial rate: a change between the
local epochs of a round is refused by config validation.

Between local epochs ``epoch_end`` calls RMSGD's ``epoch_step()`` (its per-layer rates adapt
from the second local epoch on; with one local epoch per round RMSGD is plain SGD) and moves
the epoch-unit StepLR. The call after the last epoch is skipped: the optimizer is discarded.
"""

from __future__ import annotations

import torch


def _eager(cls: type) -> type:
    """``cls`` without the wrappers by which torch.optim keeps its code out of torch.compile
    graphs: the first call of any of them imports torch._dynamo (about 5 s on a 2-core machine,
    longer than ``import torch``). fedddp never compiles. Methods under ``torch._disable_dynamo``
    become the plain function (what that wrapper caches on its first call), and step its own
    body under no_grad: with ``differentiable=False`` that is all its wrapper does besides the
    graph break, so the updates are bitwise the same (tests/test_fast_start.py)."""
    guard_code = torch._disable_dynamo(_eager).__code__
    plain = {name: fn.__wrapped__ for name in dir(cls)
             if getattr(fn := getattr(cls, name), "__code__", None) is guard_code}
    plain["step"] = torch.no_grad()(cls.step.__wrapped__)  # the body under _use_grad_for_differentiable
    return type(cls.__name__, (cls,), plain | {"__module__": __name__})


_SGD, _Adam = _eager(torch.optim.SGD), _eager(torch.optim.Adam)


def lr_at(tc, round_idx: int, epochs_done: int) -> float:
    if tc.lr_schedule == "none":
        return tc.lr
    count = round_idx - 1 if tc.lr_schedule_unit == "round" else epochs_done
    return tc.lr * tc.lr_gamma ** (count // tc.lr_step_size)


def build_optimizer(tc, params, lr: float) -> torch.optim.Optimizer:
    params = list(params)
    if tc.optimizer == "sgd":
        return _SGD(params, lr=lr, momentum=tc.momentum, weight_decay=tc.weight_decay, nesterov=tc.nesterov)
    if tc.optimizer == "adam":
        return _Adam(params, lr=lr, betas=(0.9, 0.999), weight_decay=tc.weight_decay)
    if tc.optimizer == "adamp":
        from adamp import AdamP
        return AdamP(params, lr=lr, betas=(0.9, 0.999), delta=0.1, wd_ratio=0.1,
                     weight_decay=tc.weight_decay)
    if tc.optimizer == "rmsgd":
        from rmsgd import RMSGD
        return RMSGD(params, lr=lr, beta=tc.rmsgd_beta, momentum=tc.momentum,
                     weight_decay=tc.weight_decay)
    raise AssertionError(tc.optimizer)  # config validation names the choices


def epoch_end(optimizer, tc, round_idx: int, epochs_done: int) -> None:
    """Between local epochs: RMSGD's per-epoch step, and the epoch-unit StepLR."""
    if hasattr(optimizer, "epoch_step"):
        optimizer.epoch_step()
    if tc.lr_schedule != "none" and tc.lr_schedule_unit == "epoch":
        for group in optimizer.param_groups:
            group["lr"] = lr_at(tc, round_idx, epochs_done)


def check_optimizer(tc) -> list[str]:
    """Combinations of train.* that cannot work, each naming its key and the fix."""
    errors = []
    epoch_steplr = tc.lr_schedule == "steplr" and tc.lr_schedule_unit == "epoch"
    if epoch_steplr and tc.local_steps > 0:
        errors.append("train.lr_schedule_unit: epoch counts local epochs, but train.local_steps > 0 "
                      "runs a fixed number of steps; use lr_schedule_unit = round or local_epochs")
    if epoch_steplr and tc.optimizer == "rmsgd" and tc.local_epochs > 1:
        errors.append("train.lr_schedule_unit: rmsgd sets its own per-layer rates and ignores a rate "
                      "changed between the local epochs of a round; use lr_schedule_unit = round, "
                      "local_epochs = 1, or lr_schedule = none (as the thesis runs RMSGD)")
    if tc.nesterov and (tc.optimizer != "sgd" or tc.momentum <= 0):
        errors.append(f"train.nesterov: needs train.optimizer = sgd and train.momentum > 0 (got {tc.optimizer}, "
                      f"momentum {tc.momentum}); set train.nesterov = false")
    if not 0.0 <= tc.rmsgd_beta < 1.0:
        errors.append(f"train.rmsgd_beta: must be in [0, 1), got {tc.rmsgd_beta}")
    if tc.momentum > 0 and tc.optimizer in ("adam", "adamp"):
        errors.append(f"train.momentum: {tc.optimizer} has no momentum setting (its betas are fixed at "
                      "(0.9, 0.999)); set train.momentum = 0")
    return errors
