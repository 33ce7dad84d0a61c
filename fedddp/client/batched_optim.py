"""The optimizers of clients trained side by side (``fedddp.client.batched``): functional updates
of state stacked on a client dimension, each written from the update of the optimizer the
sequential path uses (``fedddp.client.optim.build_optimizer``).

Legend: L clients still stepping (the first dimension of every stacked tensor), T parameter
tensors of a client, B clients of a group.

- ``sgd``, ``adam``: torch.optim.SGD's and torch.optim.Adam's updates;
- ``adamp``: the ``adamp`` package's AdamP (betas (0.9, 0.999), delta 0.1, wd_ratio 0.1): Adam's
  moments, then for a tensor of more than one dimension the projection that removes the radial
  part of the step, decided per client from that client's cosine similarity of gradient and
  weights (channel view first, then layer view, else none) and chosen by masks, so the group
  needs no loop over clients; a projected tensor gets the decoupled weight decay times wd_ratio;
- ``rmsgd``: the ``rmsgd`` package's RMSGD: SGD with momentum whose rate is per client and per
  tensor (its ``lr_vector``). The rates are the package's own: each client has an RMSGD object
  over copies of its tensors, refreshed from the stacks before its ``epoch_step()`` at that
  client's own epoch boundaries (clients of a group have different batches per epoch), which
  computes the EVBMF metrics of the conv layers and the new rates.

Every per-client tensor of an optimizer lives in ``stacks`` (momentum, moments), so it leaves
the stacks with a client that has taken its steps; RMSGD's objects are kept by the client's
index in its group.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

OPTIMIZERS = ("sgd", "adam", "adamp", "rmsgd")
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8
# adamp.AdamP as fedddp.client.optim.build_optimizer makes it (its eps is the package default)
ADAMP_DELTA, ADAMP_WD_RATIO, ADAMP_EPS = 0.1, 0.1, 1e-8


def _per_client(values_L: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[L] reshaped to broadcast over a stacked [L, ...] tensor."""
    return values_L.view((-1,) + (1,) * (like.dim() - 1))


class StackedOptimizer:
    """One group's optimizer: its state in ``stacks``, its update per step over the clients still
    stepping (``live``: their indices in the group, in the order of the stacks' rows)."""

    def __init__(self, tc, stacks: dict, lr_B: list[float]):
        self.tc, self.lr_B = tc, lr_B
        if tc.optimizer not in OPTIMIZERS:
            raise AssertionError(tc.optimizer)  # fedddp.client.batched.check refuses the others
        if tc.optimizer in ("adam", "adamp"):
            stacks["exp_avg"] = [torch.zeros_like(p) for p in stacks["params"]]
            stacks["exp_avg_sq"] = [torch.zeros_like(p) for p in stacks["params"]]
        # RMSGD: one object per client of the group, made at the client's first epoch boundary
        # (before it, its rates are its initial learning rate)
        self.rmsgd_B = [None] * len(lr_B)

    def epoch_start(self, b: int, params_T: list[torch.Tensor]) -> None:
        """Client ``b`` of the group begins a local epoch after its first, its parameters now
        ``params_T`` (its rows of the stacks): RMSGD's ``epoch_step()``, as ``optim.epoch_end``."""
        if self.tc.optimizer != "rmsgd":
            return
        if self.rmsgd_B[b] is None:
            from rmsgd import RMSGD
            # leaf tensors that require grad: RMSGD's metrics leave out those that do not
            copies_T = [torch.nn.Parameter(p.detach().clone()) for p in params_T]
            self.rmsgd_B[b] = RMSGD(copies_T, lr=self.lr_B[b], beta=self.tc.rmsgd_beta, momentum=self.tc.momentum,
                                    weight_decay=self.tc.weight_decay)
        optimizer = self.rmsgd_B[b]
        with torch.no_grad():
            for copy, p in zip(optimizer.metrics.params, params_T):
                copy.copy_(p)
        optimizer.epoch_step()

    def rates_L(self, live: list[int], tensor: int) -> list[float]:
        """RMSGD's rate of the client tensor ``tensor`` for each client stepping."""
        return [self.lr_B[b] if self.rmsgd_B[b] is None else float(self.rmsgd_B[b].lr_vector[tensor])
                for b in live]

    def step(self, stacks: dict, direction_T: list[torch.Tensor], lr_L: list[float], t: int, live: list[int]) -> None:
        """One update of every client stepping (``t``: their shared step count, from 1), in place
        of ``stacks``; ``lr_L`` the learning rates of their schedules."""
        tc, name = self.tc, self.tc.optimizer
        if name == "sgd":
            stacks["params"], momentum_T = _sgd(stacks["params"], direction_T, stacks.get("momentum"), tc, lr_L)
            if momentum_T is not None:
                stacks["momentum"] = momentum_T
        elif name == "adam":
            stacks["params"], stacks["exp_avg"], stacks["exp_avg_sq"] = _adam(
                stacks["params"], direction_T, stacks["exp_avg"], stacks["exp_avg_sq"], tc, lr_L, t)
        elif name == "adamp":
            stacks["params"], stacks["exp_avg"], stacks["exp_avg_sq"] = _adamp(
                stacks["params"], direction_T, stacks["exp_avg"], stacks["exp_avg_sq"], tc.weight_decay, lr_L, t)
        else:
            stacks["params"], momentum_T = _rmsgd(stacks["params"], direction_T, stacks.get("momentum"), tc,
                                                  [self.rates_L(live, i) for i in range(len(direction_T))])
            if momentum_T is not None:
                stacks["momentum"] = momentum_T


def _shared_lr(lr_L: list[float]) -> float | None:
    """The clients' one learning rate (the common case), or None when they differ."""
    return lr_L[0] if all(lr == lr_L[0] for lr in lr_L) else None


def _lr_views(lr_L: list[float], like_T: list[torch.Tensor], divisor: float = 1.0) -> list[torch.Tensor]:
    """The clients' rates (over ``divisor``) as one float32 tensor [L], viewed to broadcast over
    each stacked tensor of ``like_T``: one tensor a step, not one per parameter tensor."""
    lr_L_t = torch.tensor(lr_L, device=like_T[0].device)
    if divisor != 1.0:
        lr_L_t = lr_L_t / divisor
    return [_per_client(lr_L_t, t) for t in like_T]


def _descend(params_T, step_T, lr_L: list[float]) -> list[torch.Tensor]:
    """p - lr * step for every stacked tensor, as ``torch._foreach_*`` ops (one kernel launch a
    list on a GPU, not one a tensor); each client's own rate where they differ."""
    lr = _shared_lr(lr_L)
    if lr is not None:
        return torch._foreach_add(params_T, step_T, alpha=-lr)
    return torch._foreach_sub(params_T, torch._foreach_mul(step_T, _lr_views(lr_L, params_T)))


def _sgd(params_T, direction_T, momentum_T, tc, lr_L):
    """torch.optim.SGD's update (dampening 0); the momentum buffer starts as the first direction.
    Each line one ``torch._foreach_*`` op over the stacked tensors, the same arithmetic as the
    per-tensor form (mul, then add)."""
    d_T, new_momentum_T = _sgd_step_direction(params_T, direction_T, momentum_T, tc)
    return _descend(params_T, d_T, lr_L), new_momentum_T


def _sgd_step_direction(params_T, direction_T, momentum_T, tc):
    """SGD's step before the rate (weight decay, momentum, Nesterov) and the new momentum buffer
    (None without momentum; the first direction where ``momentum_T`` is None)."""
    d_T = list(direction_T)
    if tc.weight_decay:
        d_T = torch._foreach_add(d_T, params_T, alpha=tc.weight_decay)
    new_momentum_T = None
    if tc.momentum:
        if momentum_T is None:
            new_momentum_T = d_T  # never written in place: each step's buffers are new tensors
        else:
            new_momentum_T = torch._foreach_mul(momentum_T, tc.momentum)
            torch._foreach_add_(new_momentum_T, d_T)
        d_T = torch._foreach_add(d_T, new_momentum_T, alpha=tc.momentum) if tc.nesterov else new_momentum_T
    return d_T, new_momentum_T


def _adam(params_T, direction_T, exp_avg_T, exp_avg_sq_T, tc, lr_L, t: int):
    """torch.optim.Adam's update (no amsgrad), step count t shared by the clients stepping, as
    ``torch._foreach_*`` ops over the stacked tensors."""
    beta1, beta2 = ADAM_BETAS
    bias_correction1, bias_correction2_sqrt = 1 - beta1 ** t, math.sqrt(1 - beta2 ** t)
    g_T = list(direction_T)
    if tc.weight_decay:
        g_T = torch._foreach_add(g_T, params_T, alpha=tc.weight_decay)
    avg_T = torch._foreach_lerp(exp_avg_T, g_T, 1 - beta1)
    sq_T = torch._foreach_mul(exp_avg_sq_T, beta2)
    torch._foreach_addcmul_(sq_T, g_T, g_T, value=1 - beta2)
    denom_T = torch._foreach_sqrt(sq_T)
    torch._foreach_div_(denom_T, bias_correction2_sqrt)
    torch._foreach_add_(denom_T, ADAM_EPS)
    lr = _shared_lr(lr_L)
    if lr is not None:
        new_T = torch._foreach_addcdiv(params_T, avg_T, denom_T, value=-lr / bias_correction1)
    else:  # p - (lr / bias_correction1) * avg / denom, each client's own lr
        step_T = torch._foreach_mul(avg_T, _lr_views(lr_L, params_T, bias_correction1))
        new_T = torch._foreach_sub(params_T, torch._foreach_div(step_T, denom_T))
    return new_T, avg_T, sq_T


def _rmsgd(params_T, direction_T, momentum_T, tc, rates_TL):
    """RMSGD's step (``rmsgd.RMSGD.step``): SGD's update with weight decay and momentum (dampening
    0, no Nesterov: build_optimizer passes neither), at a rate per tensor and client."""
    sgd_tc = SimpleNamespace(momentum=tc.momentum, weight_decay=tc.weight_decay, nesterov=False)
    new_T, new_momentum_T = [], []
    for i, (p, d, rates_L) in enumerate(zip(params_T, direction_T, rates_TL)):
        (new,), buf_T = _sgd([p], [d], None if momentum_T is None else [momentum_T[i]], sgd_tc, rates_L)
        new_T.append(new)
        if buf_T is not None:
            new_momentum_T.append(buf_T[0])
    return new_T, (new_momentum_T if tc.momentum else None)


def _adamp(params_T, direction_T, exp_avg_T, exp_avg_sq_T, weight_decay: float, lr_L, t: int):
    """adamp.AdamP's update (no Nesterov), step count t shared by the clients stepping. Its
    moments are written as the package writes them (mul then add, not torch Adam's lerp)."""
    beta1, beta2 = ADAM_BETAS
    bias_correction1, bias_correction2_sqrt = 1 - beta1 ** t, math.sqrt(1 - beta2 ** t)
    new_T, new_avg_T, new_sq_T = [], [], []
    for p, g, avg, sq in zip(params_T, direction_T, exp_avg_T, exp_avg_sq_T):
        avg = avg.mul(beta1).add(g, alpha=1 - beta1)
        sq = sq.mul(beta2).addcmul(g, g, value=1 - beta2)
        perturb = avg / (sq.sqrt() / bias_correction2_sqrt).add(ADAMP_EPS)
        projected_L = None
        if p.dim() > 2:  # a client's tensor of more than one dimension
            perturb, projected_L = _adamp_projection(p, g, perturb)
        if weight_decay > 0:
            # decoupled: p * (1 - lr wd wd_ratio), wd_ratio only where the step was projected;
            # the factor in float64 as the package's Python arithmetic, then float32 as its mul
            lr_f64_L = torch.tensor(lr_L, dtype=torch.float64, device=p.device)
            ratio_f64_L = torch.ones_like(lr_f64_L)
            if projected_L is not None:
                ratio_f64_L.masked_fill_(projected_L, ADAMP_WD_RATIO)
            p = p * _per_client((1 - lr_f64_L * weight_decay * ratio_f64_L).float(), p)
        lr = _shared_lr(lr_L)
        new_T.append(p.add(perturb, alpha=-lr / bias_correction1) if lr is not None
                     else p - _lr_views(lr_L, [p], bias_correction1)[0] * perturb)
        new_avg_T.append(avg)
        new_sq_T.append(sq)
    return new_T, new_avg_T, new_sq_T


def _adamp_projection(p, g, perturb):
    """AdamP's projection per client of a stacked [L, C, ...] tensor: with the channel view
    ([C, rest]) if the client's largest |cos(g, p)| over channels is below delta / sqrt(rest),
    else with the layer view ([1, C rest]) if that one is below delta / sqrt(C rest), else none.
    Returns the new perturbation and which clients were projected [L] (bool)."""
    L, C = p.shape[0], p.shape[1]
    out = perturb
    chosen_L = torch.zeros(L, dtype=torch.bool, device=p.device)
    for rows in (C, 1):  # channel view, then layer view: the first that applies wins
        p_LRX, g_LRX = p.reshape(L, rows, -1), g.reshape(L, rows, -1)
        cosine_LR = F.cosine_similarity(g_LRX, p_LRX, dim=2, eps=ADAMP_EPS).abs()
        applies_L = (cosine_LR.amax(dim=1) < ADAMP_DELTA / math.sqrt(p_LRX.shape[2])) & ~chosen_L
        expand = (L, rows) + (1,) * (p.dim() - 2)
        p_n = p / p_LRX.norm(dim=2).reshape(expand).add(ADAMP_EPS)
        projected = perturb - p_n * (p_n * perturb).reshape(L, rows, -1).sum(dim=2).reshape(expand)
        out = torch.where(_per_client(applies_L, p), projected, out)
        chosen_L = chosen_L | applies_L
    return out, chosen_L


# The optimizers whose update is part of run.compile's whole step (client/compiled.py,
# ``WholeStep``); AdamP (a projection chosen per client) and RMSGD (rates from the package,
# per client at its own epoch boundaries) keep the compiled gradients and the eager update.
WHOLE_STEP_OPTIMIZERS = ("sgd", "adam")


def whole_state(tc, stacks: dict) -> None:
    """The optimizer's state in ``stacks`` for the whole step, every buffer there from step 1 so
    the step's inputs keep one structure: SGD's momentum starts at zeros (momentum * 0 + d is d,
    the buffer torch's SGD starts with), Adam's moments as ``StackedOptimizer`` makes them and
    its step count per client (float64, as the eager update's Python arithmetic), counted in
    the graph, so a step passes no tensor for it."""
    if tc.optimizer == "sgd" and tc.momentum:
        stacks["momentum"] = [torch.zeros_like(p) for p in stacks["params"]]
    elif tc.optimizer == "adam":
        stacks["exp_avg"] = [torch.zeros_like(p) for p in stacks["params"]]
        stacks["exp_avg_sq"] = [torch.zeros_like(p) for p in stacks["params"]]
        rows = stacks["params"][0].shape[0]
        stacks["adam_step"] = [torch.zeros(rows, dtype=torch.float64, device=stacks["params"][0].device)]


def whole_update(tc, stacks: dict, direction_T: list, lr_R: torch.Tensor) -> dict:
    """``_sgd``'s or ``_adam``'s update as a function of tensors only (each row's rate ``lr_R``
    [R]; Adam's step count in ``stacks``), so one compiled graph serves every step: the new
    params and optimizer state, by their keys in ``stacks``."""
    params_T = stacks["params"]
    lr_T = [_per_client(lr_R, p) for p in params_T]
    if tc.optimizer == "sgd":
        d_T, momentum_T = _sgd_step_direction(params_T, direction_T, stacks.get("momentum"), tc)
        out = {"params": torch._foreach_sub(params_T, torch._foreach_mul(d_T, lr_T))}
        if momentum_T is not None:
            out["momentum"] = momentum_T
        return out
    d_T = list(direction_T)
    if tc.weight_decay:
        d_T = torch._foreach_add(d_T, params_T, alpha=tc.weight_decay)
    beta1, beta2 = ADAM_BETAS
    t_R = stacks["adam_step"][0] + 1
    bias_correction1_R = (1 - beta1 ** t_R).float()
    bias_correction2_sqrt_R = torch.sqrt(1 - beta2 ** t_R).float()
    avg_T = torch._foreach_lerp(stacks["exp_avg"], d_T, 1 - beta1)
    sq_T = torch._foreach_mul(stacks["exp_avg_sq"], beta2)
    torch._foreach_addcmul_(sq_T, d_T, d_T, value=1 - beta2)
    denom_T = [s.sqrt() / _per_client(bias_correction2_sqrt_R, s) + ADAM_EPS for s in sq_T]
    new_T = [p - (lr / _per_client(bias_correction1_R, p)) * (a / d)
             for p, lr, a, d in zip(params_T, lr_T, avg_T, denom_T)]
    return {"params": new_T, "exp_avg": avg_T, "exp_avg_sq": sq_T, "adam_step": [t_R]}
