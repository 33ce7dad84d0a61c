"""Local training of one client, from the global flat vector to its report.

Legend: P flat elements, L conv layers.

``train_client`` is the same function whichever rank runs it: it starts from ``global_P``, seeds
every random choice from (seed, round, client id), and returns the report fields the server rule
asked for (see fedddp.strategies for their names and shapes).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from ..data import ClientData
from ..data.vision import augment_batch
from ..errors import ConfigError
from ..flat import FlatLayout
from ..metrics.effective_rank import effective_ranks_L, unfolding
from ..sampling import batch_size_of
from ..tasks import CLASSIFICATION, Task
from ..models import dropout
from .optim import build_optimizer, epoch_end, lr_at
from .rules import LocalRule, param_views
from . import clip  # noqa: F401 - registers the built-in local rule clip (its own file)
from . import precision


@dataclass
class ClientContext:
    """What a local rule may read while a client trains."""

    client_id: int
    round_idx: int
    global_P: torch.Tensor
    layout: FlatLayout
    hp: object  # AlgorithmConfig
    server_view: dict[str, torch.Tensor] = field(default_factory=dict)  # broadcast server state
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # this client's persistent state
    scratch: dict = field(default_factory=dict)  # a rule's working tensors between its hooks (not kept)
    task: Task = CLASSIFICATION  # the data's loss (cross-entropy or MSE), fedddp.tasks


@dataclass(frozen=True)
class LocalTraining:
    """What a rank's trainer reads of the config, taken once when the trainer is built, so that
    training reads its fields rather than the whole config: the train section, data.augment,
    the model's name (refusals name it), the algorithm section (the rule's hyperparameters where
    no client's context gives them: the warm-up), B (run.parallel_clients as the run resolved
    it: run.compile pads every step to B clients) and run.compile."""

    train: object  # config.TrainConfig
    augment: bool = False
    model_name: str = ""
    hp: object = None  # config.AlgorithmConfig
    clients: int = 1
    compile: bool = False

    @classmethod
    def of(cls, cfg, clients: int = 1) -> LocalTraining:
        """The fields of ``cfg`` (a fedddp.config.Config); ``clients``: the resolved B."""
        return cls(cfg.train, cfg.data.augment, cfg.model.name, cfg.algorithm, clients, bool(cfg.run.compile))


def batches_per_epoch(n: int, batch_size: int) -> int:
    """Minibatches in an epoch of n samples, the last one partial when they do not divide."""
    b = batch_size_of(n, batch_size)
    return 1 if b <= 0 else -(-n // b)


def planned_steps(n: int, tc, work: int = 0) -> int:
    """Local optimizer steps of a client with n samples: ``work`` local epochs (local steps when
    train.local_steps > 0; 0: the configured ones, fedddp.participation draws uneven ones)."""
    if tc.local_steps > 0:
        return work or tc.local_steps
    return (work or tc.local_epochs) * batches_per_epoch(n, tc.batch_size)


def _last_batch(n: int, batch_size: int) -> int:
    """Samples in the last batch of an epoch of n samples (a full one when the epoch divides)."""
    b = batch_size_of(n, batch_size)
    return n % b or b


def check_one_sample_batches(model, input_shape, num_samples_K: list[int], size: int, model_name: str) -> None:
    """Refuse, before the first round, a batch size that leaves some client a last batch of one
    sample when the model has a BatchNorm layer that would then see one value per channel in
    training: torch raises there, mid-run, after rounds of work. The layers are probed with one
    sample through a copy of the model (a BatchNorm2d with more than one position per channel
    normalises a single sample, so it is not refused). ``size``: train.batch_size."""
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return
    ones = [c for c, n in enumerate(num_samples_K) if _last_batch(n, size) == 1]
    if not ones:
        return
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            copy.deepcopy(model).train()(torch.zeros((1,) + tuple(input_shape), device=device))
        return
    except ValueError as exc:
        if "more than 1 value per channel" not in str(exc):
            raise
    fits = lambda b: all(_last_batch(n, b) != 1 for n in num_samples_K)  # noqa: E731
    nearest = min((b for b in range(2, max(num_samples_K) + 2) if fits(b)), key=lambda b: (abs(b - size), b),
                  default=None)
    fix = f"set train.batch_size = {nearest}, which leaves no client a batch of one" if nearest else \
        "drop clients of one sample from the data"
    shown = ", ".join(f"{c} ({num_samples_K[c]} samples)" for c in ones[:3]) + (" ..." if len(ones) > 3 else "")
    raise ConfigError(f"train.batch_size: {size} leaves client(s) {shown} a last batch of one sample, and "
                      f"model.name = {model_name} has BatchNorm, which cannot normalise one value per "
                      f"channel in training; {fix}")


class Schedule:
    """One client's batches and learning rates for a round, the same one after another and side by
    side: a permutation of its samples per local epoch from its own generator (seeded by (seed,
    round, client id)), then the step's augmentation draws from the same generator; the rate of
    ``lr_at`` on the client's epoch clock."""

    def __init__(self, data: ClientData, tc, augment: bool, round_idx: int, seed: int, work: int, device):
        self.data, self.tc, self.augment, self.seed, self.device = data, tc, augment, seed, device
        n = len(data)
        self.batch_size, self.per_epoch = batch_size_of(n, tc.batch_size), batches_per_epoch(n, tc.batch_size)
        self.steps = planned_steps(n, tc, work)
        self.round_idx, self.epochs_before = round_idx, (round_idx - 1) * tc.local_epochs
        self.gen = torch.Generator().manual_seed(seed)
        self.order = self.order_on_device = None

    def positions(self, step: int) -> torch.Tensor:
        """This step's sample indices, on the CPU (a new permutation at each epoch's first step)."""
        pos = step % self.per_epoch
        if pos == 0:
            self.order = torch.randperm(len(self.data), generator=self.gen)
            self.order_on_device = None
        return self.order[pos * self.batch_size:(pos + 1) * self.batch_size]

    def batch(self, step: int):
        """This step's (x, y) on the data's device, x augmented (data.augment) by draws that follow
        the step's permutation."""
        self.positions(step)
        if self.order_on_device is None:  # once an epoch
            self.order_on_device = self.order.to(self.device)
        pos = step % self.per_epoch
        idx = self.order_on_device[pos * self.batch_size:(pos + 1) * self.batch_size]
        x, y = self.data.x[idx], self.data.y[idx]
        return (augment_batch(x, self.gen) if self.augment else x), y

    def lr(self, step: int) -> float:
        return lr_at(self.tc, self.round_idx, self.epochs_before + step // self.per_epoch)


def train_client(model, ctx: ClientContext, data: ClientData, training: LocalTraining, rule: LocalRule,
                 needs: frozenset, seed: int, out: dict[str, torch.Tensor], work: int = 0) -> None:
    """Train ``model`` (already holding global_P) on ``data`` and write the report into ``out``:
    views into the gather buffer (``params_P`` and any of ``last_grad_P``, ``full_grad_P``), plus
    scalars ``train_loss``, ``num_samples``, ``num_steps``, ``full_loss`` and ``eff_rank_L``.
    ``work``: this round's local epochs (steps) of the client, see ``planned_steps``."""
    tc = training.train
    model.train()
    drops = dropout.layers(model)  # their masks: drawn from (seed, step, layer), models.dropout
    if rule.needs_start_gradient(ctx.hp):
        # before seeding: the extra pass leaves the training's random stream as it was
        ctx.scratch["start_grad_P"] = start_gradient(model, data, ctx.layout, tc.batch_size, ctx.task, seed)
    schedule = Schedule(data, tc, training.augment, ctx.round_idx, seed, work, ctx.global_P.device)
    torch.manual_seed(seed)  # any random op of the model other than nn.Dropout uses the global generator
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(tc, params, schedule.lr(0))
    rule.begin(model, ctx)
    # each step's loss is kept (a running device sum would be a cast and an add per step) and
    # summed on the host in step order, in float64 as the device did
    losses = []
    lr_sum = 0.0  # the rule's end hook gets the mean learning rate of the steps taken (SCAFFOLD)
    local = precision.local(tc.precision, ctx.global_P.device)
    for step in range(schedule.steps):
        if step % schedule.per_epoch == 0 and step > 0:
            epoch_end(optimizer, tc, ctx.round_idx, schedule.epochs_before + step // schedule.per_epoch)
        x, y = schedule.batch(step)
        # unset, not zeroed: the rule's step sets each .grad to its direction (+ 0.0: the bits of
        # adding it to zeroed gradients, fedddp/client/rules.py), one kernel per parameter fewer
        # than zeroing (a small model's GPU step is bound by launches)
        optimizer.zero_grad(set_to_none=True)
        dropout.set_key(drops, (seed, step))
        with local:  # train.precision: autocast (bf16) or TF32 (CUDA) around the step's passes
            loss = rule.gradient(model, x, y, ctx)
        losses.append(loss.detach())
        if step == schedule.steps - 1 and "last_grad_KP" in needs:
            ctx.layout.flatten_grads(model, out=out["last_grad_P"])
        lr_sum += optimizer.param_groups[0]["lr"]
        optimizer.step()
    dropout.set_key(drops, None)
    ctx.layout.flatten(model, out=out["params_P"])
    loss_sum = 0.0
    for loss_value in torch.stack(losses).double().tolist() if losses else ():
        loss_sum += loss_value
    finish_report(model, ctx, data, rule, needs, schedule.steps, lr_sum / max(schedule.steps, 1), loss_sum, out)


def finish_report(model, ctx: ClientContext, data: ClientData, rule: LocalRule, needs: frozenset, steps: int,
                  lr: float, loss_sum: float, out: dict) -> None:
    """The report after a client's last step, one after another and side by side: ``model`` holds
    its trained parameters, out["params_P"] has them; the rule's end hook (``lr`` the steps' mean
    rate), the mean training loss (``loss_sum`` over the steps, float64), the counts, and the
    full-batch gradient (CGW) and effective ranks (FedER) when the server rule needs them."""
    rule.end(model, ctx, steps, lr, out)
    out["train_loss"] = torch.tensor(loss_sum / max(steps, 1), dtype=torch.float64)
    out["num_samples"] = torch.tensor(float(len(data)))
    out["num_steps"] = torch.tensor(float(steps))
    if "full_grad_KP" in needs:
        out["full_loss"] = full_batch_gradient(model, data, ctx.layout, out["full_grad_P"], ctx.task)
    if "eff_rank_KL" in needs:
        out["eff_rank_L"] = effective_ranks_L(model, ctx.layout, unfolding(ctx.hp))


def start_gradient(model, data: ClientData, layout: FlatLayout, batch_size: int,
                   task: Task = CLASSIFICATION, seed: int | None = None) -> torch.Tensor:
    """SCAFFOLD option I's c_k+: the gradient of the client's mean data loss over all its samples
    at the model as given (the global one), [P], zero on buffers. In train mode, as the local
    steps compute theirs, over consecutive chunks of the local batch size, so BatchNorm normalises
    with batch statistics of the size the steps see (c_k estimates the mean step direction); the
    running statistics are restored afterwards, so the pass changes nothing the training sees.
    Dropout masks of chunk i are drawn from (``seed``, -1 - i), apart from the steps' (0, 1, ...)."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved_buffers = [b.detach().clone() for b in model.buffers()]
    n = len(data)
    chunk = n if batch_size <= 0 else batch_size
    grads = [torch.zeros_like(p) for p in params]
    drops = dropout.layers(model)
    for start in range(0, n, chunk):
        x, y = data.x[start:start + chunk], data.y[start:start + chunk]
        dropout.set_key(drops, None if seed is None else (seed, -1 - start // chunk))
        for g, part in zip(grads, torch.autograd.grad(task.loss(model(x), y, reduction="sum") / n, params)):
            g.add_(part)
    dropout.set_key(drops, None)
    with torch.no_grad():
        for b, saved in zip(model.buffers(), saved_buffers):
            b.copy_(saved)
    grad_P = torch.zeros(layout.numel, device=params[0].device)
    for view, g in zip(param_views(layout, grad_P), grads):
        view.copy_(g)
    return grad_P


def full_batch_gradient(model, data: ClientData, layout: FlatLayout, out_P: torch.Tensor,
                        task: Task = CLASSIFICATION, chunk: int = 1024) -> torch.Tensor:
    """D_k and L_k of the corrective gradient weights: the gradient of the client's mean loss over
    all its samples at its trained model, in eval mode (BatchNorm uses running statistics, so the
    gradient is that of a fixed function). Chunked so memory does not grow with n."""
    model.eval()
    model.zero_grad(set_to_none=False)
    n = len(data)
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, n, chunk):
        x, y = data.x[start:start + chunk], data.y[start:start + chunk]
        loss = task.loss(model(x), y, reduction="sum") / n
        loss.backward()
        total += loss.detach().double().cpu()
    layout.flatten_grads(model, out=out_P)
    model.train()
    return total.float()
