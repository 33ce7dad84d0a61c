"""Side-by-side local training (``run.parallel_clients = B > 1``): up to B of a rank's clients
trained as one batched computation over parameters stacked on a client dimension.

Legend: B clients of a group, S padded samples of a step (the group's largest batch), P flat
elements, T parameter tensors.

Every step is one ``torch.func`` computation, ``vmap(grad_and_value(loss))`` over the stacked
parameters, then the rule's direction and the optimizer as ``torch._foreach_*`` ops over the
stacks (``_eager_steps``). Under run.compile with SGD or Adam the whole step is one compiled
function over B rows, a finished client's row masked (``_whole``, ``_whole_steps``;
``WholeStep``, client/compiled.py); with AdamP and RMSGD the gradients alone are compiled
(``Compiled``). It keeps
``train_client``'s semantics client by client (that path, ``B = 1``, stays the reference):

- batches: each client's ``Schedule``, the one ``train_client`` draws from (its own generator
  seeded by (seed, round, client id), ``randperm`` per epoch, then augmentation), so a client's
  batches hold the same samples; they are padded to S under a per-sample mask, and each
  client's loss is its own mean over its own (possibly partial) batch;
- steps: a client that has done its ``planned_steps`` leaves the stacks (its report row gets
  its parameters), so it is never stepped again, not even with a zero gradient (which momentum
  or weight decay would turn into a move), and the rest of its group stops paying for it;
- learning rate per client and step (``lr_at`` on its own epoch clock);
- optimizers as functional updates of the stacked state (``batched_optim``), written from the
  sequential path's (torch's SGD and Adam; the ``adamp`` package's AdamP, its projection chosen
  per client; the ``rmsgd`` package's RMSGD, its per-tensor rates computed by the package per
  client at that client's own epoch boundaries);
- local rules: written once (fedddp/client/rules.py). Their ``begin`` and ``end`` hooks run per
  client as in the sequential path (the state they read and write is the same); their ``loss``
  runs under vmap, one client's tensors (``_NetAt``); their ``direction`` runs over the stacks
  (``_Step``), the entries of ctx.scratch it reads stacked over the clients, or one for all when
  every client's is the same (FedProx's anchor: the global model). A rule that overrides the
  one-client ``gradient`` instead (a plugin written for one client at a time) is refused;
- reports: the trained parameters (and last-step directions) go from the stacks straight into
  the report rows; the rest is ``finish_report``, the sequential path's, per client after
  loading its trained parameters into the model (the rule's end hook, full-batch gradients for
  CGW, effective ranks for FedER).
- dropout: vmap refuses random operations, so each client's masks are drawn outside it from
  (its seed, step, layer) as ``models.dropout.SeededDropout`` draws them in the sequential path
  (a counter-based hash: every client's and step's masks of a group in one draw a layer, padded
  with zeros), and the masked twin's ``MaskedDropout`` layers (client/masked.py) multiply by
  them; any other random operation is a config error naming the module, found before round 1
  by ``try_step`` (the side-by-side trainer's ``check_first``, which the run and ``--check``
  call).

BatchNorm: each client has its own running statistics (running_mean, running_var,
num_batches_tracked), stacked on the client dimension like the parameters and starting from the
global vector's (``model.flat_buffers = true``; with false the sequential path's statistics are
whatever the rank's previous client left, so B > 1 is refused). In the batched computation every
BatchNorm layer is a ``MaskedBatchNorm`` (client/masked.py; a copy of the model on the meta device holds them):
in training mode it normalises with the mean and biased variance of the client's own samples
only (padding has mask 0 and enters neither), and returns that mean and the unbiased variance as
auxiliary outputs of ``grad_and_value``; the running statistics are then updated outside the
transform, once per step as torch does (momentum, or the cumulative average for momentum None;
num_batches_tracked + 1). The extra pass of SAM, GAM and FedSMOO discards its statistics (the
sequential ``rules._shifted`` restores the buffers); MOON's global and previous models run in
eval mode on their own running statistics. Other buffers (not BatchNorm's) are refused. (torch
2.14's vmap of ``F.batch_norm`` does update batched buffers in place, but it would take the
padding into the statistics; on CPU masking costs 2-14% of a ResNet-18 step against it:
BENCHMARKS.md.) A call without padding (every client's batch of one width) normalises with
torch's own fused kernel and takes the statistics beside it (``Batch.full``). On CPU a step
whose clients' batches differ in width (a partial batch beside full ones) runs one such call per
width on unpadded rows (``_by_width``), so no padding is computed; on a GPU it stays one padded,
masked call (``SPLIT_DEVICES``). Memory:
a ResNet-18 client side by side takes about 661 MiB on CPU (batch 32, 3x32x32, plain SGD),
mostly its batch's activations; its parameters are 42.6 MiB a copy (BENCHMARKS.md).

The result equals the sequential path to float32 rounding, not always bit for bit (the batched
kernels may sum in another order); tests/test_parallel_clients.py states the tolerance. The
bits can depend on the group a client trains in, so groups are cut without regard to the world
size (``fedddp.sampling.assign_groups``).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.utils._pytree import tree_map

from ..errors import ConfigError
from ..flat import FlatLayout
from ..models import WITH_BATCH_NORM, dropout
from ..registry import LOCAL_RULES, resolve
from . import precision, rules
from . import ClientContext, LocalTraining, Schedule, finish_report, start_gradient
from .batched_optim import OPTIMIZERS, WHOLE_STEP_OPTIMIZERS, StackedOptimizer, _per_client, whole_state, whole_update
from .compiled import Compiled, WholeStep, pad, replay_outputs_freed
from .masked import Batch, masked_twin

# Devices where a BatchNorm model's step whose batches differ in width runs one call per width
# instead of one padded call: on CPU the cost follows the samples computed, padding included
# (1.5x on ResNet-18 steps with a partial batch, BENCHMARKS.md); on a GPU one large call is
# what side by side pays off through, so it stays padded until measured otherwise.
SPLIT_DEVICES = ("cpu",)


def check(size, hp, tc, mc) -> list[str]:
    """Configuration errors of run.parallel_clients (``size``) with the algorithm, train and model
    sections: each names what is not batched and the fix."""
    if size == "auto":  # resolved when the run starts (client/parallel.py): 1 where side by side cannot run
        return []
    if size < 1:
        return [f"run.parallel_clients: must be >= 1 (1: one client after another), got {size}"]
    if size == 1:
        return []
    try:
        local = resolve(hp)[0]
    except Exception:  # noqa: BLE001 - an unknown algorithm is reported by its own check
        return []
    fix = "; set run.parallel_clients=1"
    errors = []
    if local in LOCAL_RULES and rules.one_client_only(LOCAL_RULES[local]):
        errors.append(f"run.parallel_clients: the local rule {local} overrides gradient(), which trains one "
                      "client at a time; to run side by side, write its step as direction(step) (and loss(net, "
                      f"x, y, hp) if it changes the objective) instead (docs/extending.md, \"Local rules\"){fix}")
    if tc.optimizer not in OPTIMIZERS:
        errors.append(f"run.parallel_clients: train.optimizer = {tc.optimizer} is not batched "
                      f"(batched: {', '.join(OPTIMIZERS)}){fix}")
    if mc.name in WITH_BATCH_NORM and not mc.flat_buffers:
        errors.append(_FLAT_BUFFERS_ERROR.format(mc.name))
    return errors


# Without the buffers in the flat vector, the sequential path starts each client from the running
# statistics the rank's previous client left: a result that depends on the rank, not copied here.
_FLAT_BUFFERS_ERROR = ("run.parallel_clients: model.name = {} has BatchNorm, whose running statistics with "
                       "model.flat_buffers=false depend on the rank's previous client; set "
                       "model.flat_buffers=true or run.parallel_clients=1")


class _Represent(nn.Module):
    """A model as (representation, output), so that functional_call reaches ``represent``."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        z = self.net.represent(x)
        return z, self.net.head(z)


class _NetAt:
    """One client's model as ``LocalRule.loss`` reads it side by side, under vmap: that client's
    parameters, running statistics, batch mask, dropout masks, scratch entries and frozen models
    (``rules.OneNet`` is the one-after-another form)."""

    def __init__(self, trainer, params_T, buffers_T, mask, count, drops, scratch: dict, frozen: list):
        self._trainer, self._params_T, self._buffers_T, self._frozen = trainer, params_T, buffers_T, frozen
        self._mask, self._count, self._drops = mask, count, drops
        self.task, self.scratch, self.stats, self.frozen_count = trainer.task, scratch, (), len(frozen)

    def _train(self, net, prefix: str, x):
        out = self._trainer._forward(net, self._params_T, self._buffers_T, x, self._mask, self._count, self._drops,
                                     prefix)
        self.stats = self._trainer._collected()  # before another forward starts afresh
        return out

    def __call__(self, x):
        return self._train(self._trainer.net, "", x)

    def represent(self, x):
        return self._train(self._trainer.represent, "net.", x)

    def frozen(self, x) -> list[torch.Tensor]:
        """The frozen models' representations, in eval mode on their own running statistics."""
        t = self._trainer
        return [t._forward(t.represent, p_T, b_T, x, self._mask, self._count, self._drops, "net.", training=False)[0]
                .detach() for p_T, b_T in self._frozen]

    def mean(self, loss_of):
        """The client's mean over its own samples (padding has mask 0). A call without padding
        (every mask all ones) leaves the multiply out, the same bits (x * 1 = x), two ops fewer."""
        losses = loss_of("none")
        return (losses if self._trainer.batch.full else losses * self._mask).sum() / self._count


@dataclass
class _Group:
    """What every step of a group reads besides its stacks: the form of each of the rule's
    scratch entries ("list" of tensors, or "one" tensor or number), the entries and frozen models
    every client shares (one for all, without the client dimension: FedProx's anchor, MOON's
    global model), the number of frozen models a client has (MOON: the global and the previous
    one), and the rule's hyperparameters (the clients' ctx.hp)."""

    forms: dict
    shared: dict
    frozen_count: int
    hp: object


@dataclass(frozen=True)
class _Shape:
    """How a step's gradient call is cut: ``parts``, its clients (rows) by batch width when the
    step is split by width (``BatchedTrainer._width_parts``; None: one call, padded), and
    ``full``, whether every client's batch has one width (no padding: BatchNorm then runs
    torch's own kernel)."""

    parts: list | None
    full: bool


def _entry(name: str, stacks: dict, group: _Group):
    """The rule's scratch entry ``name`` for the direction: stacked [L, ...], or one for all."""
    key = ("scratch", name)
    leaves = stacks[key] if key in stacks else group.shared[key]
    return list(leaves) if group.forms[name] == "list" else leaves[0]


class _Step:
    """One step of the clients still stepping as ``LocalRule.direction`` reads it: w, g and the
    rule's scratch entries stacked [L, ...] (one for all: without the client dimension), hp
    (``rules.OneClient`` is the one-after-another form)."""

    def __init__(self, trainer, stacks: dict, group: _Group, grads_T, batch: tuple, shape: _Shape):
        self.params, self.grads, self.hp = stacks["params"], grads_T, group.hp
        self.scratch = {name: _entry(name, stacks, group) for name in trainer.step_keys}
        self._given = dict(self.scratch)
        self._trainer, self._stacks, self._batch, self._shape = trainer, stacks, batch, shape

    def grads_at(self, shift_T) -> list[torch.Tensor]:
        """Each client's gradient of the task's loss at w + shift (the step's batch and dropout
        masks; its BatchNorm statistics discarded)."""
        shifted_T = [p + e for p, e in zip(self.params, shift_T)]
        t = self._trainer
        return t._by_width(t._data, (shifted_T, self._stacks["buffers"]) + self._batch, self._shape)[0]

    @staticmethod
    def norm(tensors) -> torch.Tensor:
        """Each client's L2 norm over all of its rows of ``tensors`` ([L])."""
        norms_TL = torch.stack([torch.linalg.vector_norm(t.flatten(1), dim=1) for t in tensors])
        return torch.linalg.vector_norm(norms_TL, dim=0)

    @staticmethod
    def per_client(value, like):
        """One value per client ([L]) shaped to broadcast over the stacked ``like``; a number or a
        0-dim tensor as it is."""
        return _per_client(value, like) if isinstance(value, torch.Tensor) and value.dim() == 1 else value

    def keep(self, stacks: dict, shared: dict) -> set[str]:
        """The scratch entries the direction replaced (FedSMOO's dual), into ``stacks``: each
        client's from now on, back into its ctx.scratch when it leaves. Returns their names."""
        replaced = set()
        for name, value in self.scratch.items():
            if value is self._given[name]:
                continue
            leaves = _as_leaves(value)
            before = shared.pop(("scratch", name), None)
            if before is not None:  # one for all until now: given the client dimension if it has none
                L = self.params[0].shape[0]
                leaves = [t.expand((L,) + t.shape).clone() if t.dim() == torch.as_tensor(b).dim() else t
                          for t, b in zip(leaves, before)]
            stacks[("scratch", name)] = leaves
            replaced.add(name)
        return replaced


def _as_leaves(value) -> list:
    """A scratch entry (a tensor, a list of tensors, or a number) as a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _one_for_all(values: list) -> bool:
    """Whether every client's scratch entry is the same (equal numbers, or the same tensors)."""
    if isinstance(values[0], (int, float)):
        return all(v == values[0] for v in values)
    where = lambda v: [(t.data_ptr(), t.shape, t.stride()) for t in _as_leaves(v)]  # noqa: E731
    first = where(values[0])
    return all(where(v) == first for v in values[1:])

def _check_buffers(model: nn.Module, layout: FlatLayout, model_name: str) -> None:
    """BatchNorm statistics are batched when they travel in the flat vector; anything else is a
    config error naming the fix."""
    bn_buffers = {f"{name}.{key}" for name, m in model.named_modules()
                  if isinstance(m, nn.modules.batchnorm._BatchNorm) for key, _ in m.named_buffers(recurse=False)}
    others = [name for name, _ in model.named_buffers() if name not in bn_buffers]
    if others:
        raise ConfigError(f"run.parallel_clients: model.name = {model_name} has buffers that are not "
                          f"BatchNorm statistics ({', '.join(others[:3])}), which are not batched; set "
                          "run.parallel_clients=1")
    if bn_buffers and not any(not e.is_param for e in layout.entries):
        raise ConfigError(_FLAT_BUFFERS_ERROR.format(model_name))



# torch's words for an operation given two floating dtypes (float32 beside bfloat16)
_MIXED_DTYPES = re.compile(r"dtype|scalar type|BFloat16|same type", re.IGNORECASE)

# A group's dropout masks for all its steps are drawn at once up to this size (float32), each
# step's own beyond it: at 100 clients of batch 10 and 25 steps, 64 MB is 640 values a sample.
GROUP_DROPOUT_BYTES = 64 << 20


class _GroupBatches:
    """Every step's batches of a group without augmentation, as one gather a step from the
    group's samples in one tensor. The index and mask of all its steps are built once, with a
    fixed number of tensor operations whatever the clients and steps, and moved to the device
    once; a step takes views of them (a per-step build cost milliseconds of host time and a
    dozen ops a step at 100 clients). Row j of a step is the j-th client still stepping (the
    order of the stacks); each client's positions are drawn in its own step order from its own
    ``Schedule``, so its batches hold the samples ``train_client`` draws. Padding takes the
    group's first sample, which the mask leaves out.

    Legend: M (step, client) pairs in step order, W the widest batch of the group."""

    def __init__(self, group, schedules: list[Schedule], device):
        self.x = torch.cat([data.x for _, data, *_ in group])
        self.y = torch.cat([data.y for _, data, *_ in group])
        offsets_B, positions, clients_M, self.first_S, self.sizes_S = [0], [], [], [], []
        self.pairs_M: list[tuple[int, int]] = []  # (client, step) of each row, in step order
        for _, data, *_ in group[:-1]:
            offsets_B.append(offsets_B[-1] + len(data))
        for step in range(max(s.steps for s in schedules)):
            self.first_S.append(len(clients_M))
            # the clients train_group still steps: a client leaves after its last step
            live = [b for b, s in enumerate(schedules) if s.steps > step or s.steps == 0]
            positions += [schedules[b].positions(step) for b in live]
            clients_M += live
            self.sizes_S.append([len(p) for p in positions[-len(live):]])
            self.pairs_M += [(b, step) for b in live]
        self.first_S.append(len(clients_M))
        sizes = [len(p) for p in positions]
        sizes_M, width = torch.tensor(sizes), max(sizes)
        pairs_N = torch.repeat_interleave(torch.arange(len(sizes_M)), sizes_M)  # each sample's pair
        cols_N = torch.arange(len(pairs_N)) - (torch.cumsum(sizes_M, 0) - sizes_M)[pairs_N]
        index_MW = torch.zeros(len(sizes_M), width, dtype=torch.long)
        index_MW[pairs_N, cols_N] = torch.cat(positions) + torch.tensor(offsets_B)[torch.tensor(clients_M)][pairs_N]
        mask_MW = (torch.arange(width) < sizes_M[:, None]).float()
        self.index_MW, self.mask_MW = index_MW.to(device), mask_MW.to(device)
        self.count_M = sizes_M.float().to(device)  # mask_MW's row sums, exact integers

    def step(self, step: int):
        """The step's x [L, S, ...], y [L, S], mask [L, S], count [L] and the batch sizes, for the
        L clients still stepping, S their widest batch."""
        rows, sizes = slice(self.first_S[step], self.first_S[step + 1]), self.sizes_S[step]
        index = self.index_MW[rows, :max(sizes)]
        return self.x[index], self.y[index], self.mask_MW[rows, :max(sizes)], self.count_M[rows], sizes

    def rows(self, step: int) -> slice:
        return slice(self.first_S[step], self.first_S[step + 1])


class BatchedTrainer:
    """Trains groups of clients side by side; one per run (it holds the model's functional form)."""

    def __init__(self, model, layout: FlatLayout, training: LocalTraining, rule, needs: frozenset, task):
        self.model, self.layout, self.training, self.rule, self.needs, self.task = \
            model, layout, training, rule, needs, task
        _check_buffers(model, layout, training.model_name)
        self.param_entries = [e for e in layout.entries if e.is_param]
        self.buffer_entries = [e for e in layout.entries if not e.is_param]
        self.names = [e.name for e in self.param_entries] + [e.name for e in self.buffer_entries]
        # the BatchNorm layers by name, for their momentum; a model without them runs as it is
        self.batch_norms = {name: m for name, m in model.named_modules()
                            if isinstance(m, nn.modules.batchnorm._BatchNorm)}
        self.integer_buffers = {n for n, b in model.named_buffers() if not b.dtype.is_floating_point}
        self.buffer_index = {e.name: i for i, e in enumerate(self.buffer_entries)}  # position in stacks["buffers"]
        # dropout layers, and each one's input shape per sample (``_dropout_shapes``)
        self.dropouts, self.drop_shapes = dropout.layers(model), None
        self.batch, self.stat_names = Batch(), []
        self.net = masked_twin(model, self.batch) if self.batch_norms or self.dropouts else model
        self.represent = _Represent(self.net)  # (representation, output), for rules that read z (MOON)
        # the rule's scratch entries; the group being trained (``_Group``), which the functions
        # below read: they are transformed once (vmap, torch.compile), so the group cannot be
        # their argument. Set once a group, before its first step; outside a group (the
        # warm-up, try_step) none of the rule's entries and the configured hp.
        self.step_keys = rules.step_keys(rule)
        self.whole_replaced = set()  # the scratch entries the whole step's direction replaced in a group
        # train.batch_size = 0 (full batches) with run.compile: the width every compiled step is
        # padded to, the most samples of a client this rank may train (the side-by-side trainer's
        # check_first): one graph for the run, where each group's widest client would make one a width
        self.widest = 0
        self.group = _Group({}, {}, 0, training.hp)
        # train.precision = bf16: the dtype a step's parameters and batch are cast to before the
        # gradient call (client/precision.py); BatchNorm's weight and bias stay float32, as its statistics
        self.compute_dtype = precision.compute_dtype(training.train.precision)
        norm_params = {f"{name}.{key}" for name, m in self.batch_norms.items()
                       for key, _ in m.named_parameters(recurse=False)}
        self.lowered = [e.name not in norm_params for e in self.param_entries]
        conv_weights = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Conv2d)}
        self.conv_weights = [e.name in conv_weights for e in self.param_entries]  # laid out channels-last on CUDA

        def data_loss(params_T, buffers_T, x, y, mask, count, drops):
            net = _NetAt(self, params_T, buffers_T, mask, count, drops, {}, [])
            return rules.LocalRule.loss(rule, net, x, y, None)[0], net.stats

        def rule_loss(params_T, buffers_T, x, y, mask, count, drops, inputs):
            net = _NetAt(self, params_T, buffers_T, mask, count, drops, self._scratch(inputs), self._frozen(inputs))
            objective, loss = rule.loss(net, x, y, self.group.hp)
            return objective, (loss, net.stats)

        # per client: (gradients of the loss, (the loss, aux)) at its own parameters, batch, dropout
        # masks and rule inputs (``inputs``: the group's per-client stacks of the rule's entries);
        # the task's loss alone for extra passes (SAM) and try_step
        # (bf16: the parameters and batch cast for all clients before the call, precision.in_dtype)
        casts = (self.compute_dtype, self.lowered, self.conv_weights)
        self._data = precision.in_dtype(vmap(grad_and_value(data_loss, has_aux=True)), *casts)
        self._rule_grads = precision.in_dtype(vmap(grad_and_value(rule_loss, has_aux=True)), *casts)
        # run.compile: the whole step compiled (``_whole``) with SGD and Adam; with the other
        # optimizers the rule's gradients alone (``_gradients``); either once, on first use
        whole = training.compile and training.train.optimizer in WHOLE_STEP_OPTIMIZERS
        self.whole_step = WholeStep(self._whole) if whole else None
        self.compiled = Compiled(self._rule_grads, training.clients, training.train.batch_size) \
            if training.compile and not whole else None

    def _forward(self, net, params_T, buffers_T, x, mask, count, drops, prefix: str = "", training: bool = True):
        """``net`` at the given parameters and buffers, in training or eval mode; BatchNorm over
        the samples of ``mask`` (its statistics collected afresh in ``self.batch``), dropout
        with the masks ``drops``."""
        self.batch.mask, self.batch.count, self.batch.names, self.batch.stats = mask, count, [], []
        self.batch.drops = drops
        net.train(training)
        dtype = self.compute_dtype
        if dtype is not None:  # bf16: a step's parameters come cast (precision.in_dtype), a frozen model's here
            params_T = [precision.lowered(p, dtype) if low else p for p, low in zip(params_T, self.lowered)]
            x = precision.lowered(x, dtype)
        tensors = dict(zip([prefix + n for n in self.names], list(params_T) + list(buffers_T)))
        try:
            out = functional_call(net, tensors, (x,))
            return out if dtype is None else precision.raised(out)  # the loss in float32
        finally:  # no tensor of the transforms stays on the trainer (torch.compile refuses that)
            self.batch.mask = self.batch.count = None
            self.batch.drops = {}

    def _collected(self) -> tuple:
        """The batch statistics of the training forward just run, their layers' names kept for
        ``_update_running_stats``; ``self.batch`` is left without them."""
        self.stat_names = list(self.batch.names)
        stats, self.batch.stats = tuple(self.batch.stats), []
        return stats

    def try_first_client(self, train, num_samples: list[int], ids) -> None:
        """``try_step`` on the first client of ``ids`` with samples (``train``: client id ->
        ClientData), as the run and --check do before round 1."""
        first = next((c for c in ids if num_samples[c]), None)
        if first is not None:
            self.try_step(train[first])

    def try_step(self, data) -> None:
        """The side-by-side gradients on two samples of ``data`` (a client's), at the model's
        parameters, the result discarded: what vmap cannot run (a random operation other than
        nn.Dropout's, an operation without a batching rule) becomes one config error naming the
        module, before round 1 (the run and --check call it)."""
        x, y = data.x[:2], data.y[:2]
        if self.dropouts:
            self.drop_shapes = self._dropout_shapes(x)
        flat_P = self.layout.flatten(self.model)
        mask = torch.ones(1, len(y), device=x.device)
        drops = self._dropout_masks([(0, 0)], [len(y)], len(y), x.device)
        running = []  # the modules whose forward has begun and not returned: the innermost last

        def enter(name):
            return lambda module, args: running.append(name)  # None: the input stays

        def leave(module, args, out):
            running.pop()  # returns None: the output stays

        hooks = []
        for name, module in self.net.named_modules():
            hooks += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]
        try:
            self._data(self._stacked(flat_P, self.param_entries, 1), self._stacked(flat_P, self.buffer_entries, 1),
                       x[None], y[None], mask, mask.sum(1), drops)
        except RuntimeError as exc:
            where = f"its module {running[-1]} ({type(self.net.get_submodule(running[-1])).__name__})" \
                if running and running[-1] else "its forward"
            first, fix = str(exc).splitlines()[0], "set run.parallel_clients=1"
            if "random" in str(exc):
                why = ("calls a random operation, which side by side cannot draw per client (nn.Dropout "
                       "layers can: their masks are drawn outside vmap)")
            elif self.compute_dtype is not None and _MIXED_DTYPES.search(first):
                # bf16 side by side casts the parameters and batch, not tensors the forward makes
                why = f"mixes float32 tensors of its own with bfloat16 ones under train.precision = bf16 ({first})"
                fix = "set train.precision=fp32, or run.parallel_clients=1 (autocast casts per operation there)"
            else:
                why = f"does not run under torch.func.vmap ({first})"
            raise ConfigError(f"run.parallel_clients: model.name = {self.training.model_name}: {where} {why}; "
                              f"{fix}") from None
        finally:
            for hook in hooks:
                hook.remove()

    def warm_up(self, data, server_view: dict | None = None) -> None:
        """One gradient call of a full group's shape, B copies of a full batch of ``data``
        (a client's) at the model's parameters, the result discarded: run.compile's graph
        compiles, and the device's libraries set up, before round 1 instead of in it. A rule
        whose step reads its own entries (FedProx's anchor, SCAFFOLD's correction) makes them
        with its begin hook for B new clients (``server_view``: the server's state the clients
        read, as round 1 gives it), so the whole step compiles on the structure round 1 has; the
        gradient-only compile and the eager step warm with the task's loss alone."""
        tc, device, rows = self.training.train, data.x.device, self.training.clients
        width = tc.batch_size if tc.batch_size > 0 else max(self.widest, len(data))
        index = torch.arange(width, device=device) % len(data)
        # contiguous, as a step's batches are: the compiled graph is specialised on strides too
        x = data.x[index].expand((rows, width) + tuple(data.x.shape[1:])).contiguous()
        y = data.y[index].expand(rows, width).contiguous()
        if self.dropouts and self.drop_shapes is None:
            self.drop_shapes = self._dropout_shapes(x[0])
        flat_P = self.layout.flatten(self.model)
        mask = torch.ones(rows, width, device=device)
        drops = self._dropout_masks([(0, 0)] * rows, [width] * rows, width, device)
        batch = (x, y, mask, mask.sum(1), drops)
        if self.whole_step is not None and self.step_keys:  # the rule's entries as round 1 makes them
            group = [(ClientContext(i, 1, flat_P, self.layout, self.training.hp, dict(server_view or {}),
                                    {}, task=self.task), data, i, 0, {}) for i in range(rows)]
            stacks, self.group = self._begin(group, flat_P, rows, device)
        else:
            stacks = {"params": self._stacked(flat_P, self.param_entries, rows),
                      "buffers": self._stacked(flat_P, self.buffer_entries, rows)}
            self.group = _Group({}, {}, 0, self.training.hp)
        try:
            if self.whole_step is not None:
                self._warm_whole(stacks, batch, device)
                return
            with precision.side_by_side(tc.precision, device):
                if self.step_keys:
                    self._by_width(self._data, (stacks["params"], stacks["buffers"]) + batch, _Shape(None, True))
                else:
                    self._gradients(stacks, batch, _Shape(None, True))
        finally:  # no client's entries stay on the trainer
            self.group = _Group({}, {}, 0, self.training.hp)

    def _warm_whole(self, stacks: dict, batch: tuple, device) -> None:
        """run.compile's whole step compiled on a full group's stacks and batch, the stacks built
        as ``train_group`` builds them (the same structure: the same graph), then timed against
        its eager form (``WholeStep.measure``: the start line's words)."""
        tc, rows = self.training.train, stacks["params"][0].shape[0]
        StackedOptimizer(tc, stacks, [tc.lr] * rows)
        stacks["loss_sum"] = [torch.zeros(rows, dtype=torch.float64, device=device)]
        whole_state(tc, stacks)
        args = (stacks, batch, torch.full((rows,), float(tc.lr), device=device),
                torch.ones(rows, dtype=torch.bool, device=device))
        with precision.side_by_side(tc.precision, device):
            self.whole_step.measure(args, device)

    def _dropout_shapes(self, x) -> dict[int, tuple]:
        """Each dropout layer's input shape per sample, by index, from eval forwards of one and
        of two copies of the sample ``x[0]`` (nothing of the model changes). A layer's masks are
        padded along its input's first dimension, so that must be the batch, and a layer called
        more than once must see one shape: otherwise a config error."""
        seen, batch = {}, [0]
        hooks = [layer.register_forward_pre_hook(lambda m, args: seen.setdefault(m.index, set()).add(
            (batch[0], tuple(args[0].shape)))) for layer in self.dropouts]
        training = self.model.training
        try:
            with torch.no_grad():
                self.model.eval()
                for n in (1, 2):
                    batch[0] = n
                    self.model(x[:1].repeat((n,) + (1,) * (x.dim() - 1)))
        finally:
            self.model.train(training)
            for hook in hooks:
                hook.remove()
        names = {m: name for name, m in self.model.named_modules()}
        shapes = {}
        for layer in self.dropouts:
            calls = sorted(seen.get(layer.index, ()))
            if not calls:
                continue
            if len(calls) != 2 or calls[0][1][:1] != (1,) or calls[1][1] != (2,) + calls[0][1][1:]:
                raise ConfigError(
                    f"run.parallel_clients: model.name = {self.training.model_name}: its dropout layer "
                    f"{names[layer]} sees inputs {', '.join(str(list(shape)) for _, shape in calls)} for batches "
                    "of 1 and 2 samples; side by side its masks are drawn per sample along the first "
                    "dimension, which must be the batch's, one shape per layer; set run.parallel_clients=1")
            shapes[layer.index] = calls[0][1][1:]
        return shapes



    def _scratch(self, inputs: dict) -> dict:
        """The rule's scratch entries under vmap: one client's rows of ``inputs``, or one for all."""
        out = {}
        for name in self.step_keys:
            key = ("scratch", name)
            leaves = inputs[key] if key in inputs else self.group.shared[key]
            out[name] = list(leaves) if self.group.forms[name] == "list" else leaves[0]
        return out

    def _frozen(self, inputs: dict) -> list[tuple[list, list]]:
        """The frozen models (parameters, buffers) under vmap: one client's, or one for all."""
        n, models = len(self.param_entries), []
        for i in range(self.group.frozen_count):
            key = ("frozen", i)
            tensors = inputs[key] if key in inputs else self.group.shared[key]
            models.append((tensors[:n], tensors[n:]))
        return models

    def _gradients(self, stacks: dict, batch: tuple, shape: _Shape):
        """Per client: the gradients of the rule's objective at its parameters (and its running
        statistics ``stacks["buffers"]``) on its batch with its dropout masks (``batch``: x, y,
        mask, count, drops), its data loss (MOON's without the contrastive term), and its
        BatchNorm batch statistics (mean, unbiased variance per layer in ``self.stat_names``'
        order, [L, C] each)."""
        inputs = {key: value for key, value in stacks.items() if isinstance(key, tuple)}
        args = (stacks["params"], stacks["buffers"]) + batch + (inputs,)
        out = None
        if self.compiled is not None:
            self.batch.full = False  # every call padded to the same shapes
            out = self.compiled(*args, widest=self.widest)
        grads_T, (_, (loss_L, stats)) = out if out is not None else self._by_width(self._rule_grads, args, shape)
        return grads_T, loss_L, stats

    def _width_parts(self, sizes: list[int], device) -> list[tuple[list[int], int]] | None:
        """The step's clients (rows) by batch width, [(rows, width)] in order of first appearance,
        when the step is split by width: on a device of SPLIT_DEVICES, for a model with BatchNorm
        (uncompiled), at a step whose batches differ in width. Else None: one call, padded."""
        if device.type not in SPLIT_DEVICES or not self.batch_norms or self.compiled is not None \
                or len(set(sizes)) == 1:
            return None
        parts: dict[int, list[int]] = {}
        for row, size in enumerate(sizes):
            parts.setdefault(size, []).append(row)
        return [(rows, width) for width, rows in parts.items()]

    def _by_width(self, fn, args: tuple, shape: _Shape):
        """``fn(params_T, buffers_T, x, y, mask, count, drops, *rest)`` over the step's clients
        (every argument [L, ...], per client): one call, or with the step split by width
        (``shape.parts``) one call per width on its clients' rows cut to that width, no padding
        computed, the results put back in row order. Each client's result is the same computation
        on the same samples either way (to float32 rounding: the kernels see other shapes)."""
        self.batch.full = shape.full or shape.parts is not None
        if shape.parts is None:
            return fn(*args)
        outs, order = [], []
        for rows, width in shape.parts:
            index = torch.tensor(rows, dtype=torch.long, device=args[2].device)
            take = lambda t: t.index_select(0, index)  # noqa: E731
            params_T, buffers_T, x, y, mask, count, drops, *rest = tree_map(take, args)
            outs.append(fn(params_T, buffers_T, x[:, :width], y[:, :width], mask[:, :width], count,
                           {k: v[:, :width] for k, v in drops.items()}, *rest))
            order += rows
        back = torch.argsort(torch.tensor(order, device=args[2].device))
        return tree_map(lambda *leaves: torch.cat(leaves).index_select(0, back), *outs)

    def _update_running_stats(self, buffers_T: list[torch.Tensor], stats) -> list[torch.Tensor]:
        """The stacked running statistics after one training forward, as torch's BatchNorm updates
        them: num_batches_tracked + 1, then running = (1 - m) running + m batch with m the layer's
        momentum (None: 1 / num_batches_tracked, the cumulative average), the variance unbiased."""
        index = self.buffer_index
        new_T = list(buffers_T)
        momenta = {self.batch_norms[name].momentum for name in self.stat_names}
        if len(momenta) == 1 and None not in momenta and len(set(self.stat_names)) == len(self.stat_names):
            # every layer's momentum the same number (torch's default 0.1), each layer run once:
            # the update of all the layers as three torch._foreach_* ops, the loop's arithmetic
            factor = momenta.pop()
            counts = [index[n + ".num_batches_tracked"] for n in self.stat_names
                      if n + ".num_batches_tracked" in index]
            for i, t in zip(counts, torch._foreach_add([new_T[i] for i in counts], 1)):
                new_T[i] = t
            slots = [index[n + key] for n in self.stat_names for key in (".running_mean", ".running_var")]
            # batch * m and running * (1 - m) in one op, then their sums
            scaled = torch._foreach_mul(list(stats) + [new_T[i] for i in slots],
                                        [factor] * len(slots) + [1 - factor] * len(slots))
            updated = torch._foreach_add(scaled[:len(slots)], scaled[len(slots):])
            for i, t in zip(slots, updated):
                new_T[i] = t
            return new_T
        for name, mean_LC, var_LC in zip(self.stat_names, stats[0::2], stats[1::2]):
            momentum = self.batch_norms[name].momentum
            i_mean, i_var = index[name + ".running_mean"], index[name + ".running_var"]
            i_count = index.get(name + ".num_batches_tracked")
            if i_count is not None:
                new_T[i_count] = new_T[i_count] + 1
            factor = momentum if momentum is not None else _per_client(1.0 / new_T[i_count], mean_LC)
            new_T[i_mean] = mean_LC * factor + new_T[i_mean] * (1 - factor)
            new_T[i_var] = var_LC * factor + new_T[i_var] * (1 - factor)
        return new_T


    def _start_stacks(self, group, global_P: torch.Tensor, B: int, device) -> tuple[dict, _Group]:
        """The group's per-client tensors as stacks ([B, ...]) and its ``_Group`` (with the
        tensors every client shares), after the rule's begin hooks: parameters and buffers from
        global_P, the rule's scratch entries (FedProx's anchor, SCAFFOLD's correction, FedSMOO's
        duals, MOON's has_prev) and the models of ctx.scratch["frozen_P"] (MOON's global and
        previous models)."""
        # Per-client tensors live in ``stacks`` ([L, ...] over the L clients still stepping, in
        # the order of ``live``); one every client shares (FedProx's anchor: the global model)
        # stays in ``shared`` and broadcasts. The rule's entries are keyed ("scratch", name).
        stacks, shared, forms = {}, {}, {}
        for name in self.step_keys:
            values = [ctx.scratch[name] for ctx, *_ in group]
            forms[name] = "list" if isinstance(values[0], (list, tuple)) else "one"
            if _one_for_all(values):
                shared[("scratch", name)] = _as_leaves(values[0])
            elif isinstance(values[0], (int, float)):
                stacks[("scratch", name)] = [torch.tensor([float(v) for v in values], device=device)]
            else:
                stacks[("scratch", name)] = [torch.stack(leaves_B) for leaves_B in zip(*map(_as_leaves, values))]
        stacks["params"] = self._stacked(global_P, self.param_entries, B)
        # each client's running statistics start from the global vector's, integers rounded as
        # FlatLayout.unflatten_into rounds them for the sequential path
        stacks["buffers"] = self._stacked(global_P, self.buffer_entries, B)
        # frozen models, one list per client (MOON: the global model, then the previous one if
        # the client has it); a shorter list is padded with its first model
        frozen_B = [ctx.scratch.get("frozen_P", []) for ctx, *_ in group]
        frozen_count = max(len(f) for f in frozen_B)
        entries = self.param_entries + self.buffer_entries
        for i in range(frozen_count):
            flats_B = [f[i] if i < len(f) else f[0] for f in frozen_B]
            if all(f is flats_B[0] for f in flats_B):
                shared[("frozen", i)] = [flats_B[0][e.offset:e.offset + e.numel].view(e.shape) for e in entries]
            else:
                flat_BP = torch.stack([f.to(device) for f in flats_B])
                stacks[("frozen", i)] = [flat_BP[:, e.offset:e.offset + e.numel].reshape((B,) + e.shape)
                                         for e in entries]
        return stacks, _Group(forms, shared, frozen_count, group[0][0].hp)

    def _begin(self, group, global_P: torch.Tensor, B: int, device) -> tuple[dict, _Group]:
        """The rule's hooks per client, as train_client calls them (the model holds global_P, in
        training mode: SCAFFOLD option I's start gradient normalises with batch statistics), then
        the group's stacks (``_start_stacks``)."""
        rule, layout, tc = self.rule, self.layout, self.training.train
        layout.unflatten_into(global_P, self.model)
        self.model.train()
        if self.dropouts and self.drop_shapes is None:
            self.drop_shapes = self._dropout_shapes(group[0][1].x)
        for ctx, data, seed, work, out in group:
            if rule.needs_start_gradient(ctx.hp):
                ctx.scratch["start_grad_P"] = start_gradient(self.model, data, layout, tc.batch_size, ctx.task, seed)
            rule.begin(self.model, ctx)
        return self._start_stacks(group, global_P, B, device)

    def train_group(self, group: list[tuple[ClientContext, object, int, int, dict]]) -> None:
        """Train the clients of ``group`` ((ctx, data, seed, work, out) each, ``out`` the
        client's report views as in ``train_client``) side by side and write their reports."""
        t_start = time.perf_counter()
        training, tc, rule, needs = self.training, self.training.train, self.rule, self.needs
        ctx0 = group[0][0]
        device, global_P, B = ctx0.global_P.device, ctx0.global_P, len(group)
        schedules = [Schedule(data, tc, training.augment, ctx.round_idx, seed, work, device)
                     for ctx, data, seed, work, out in group]
        steps_B = [s.steps for s in schedules]
        stacks, self.group = self._begin(group, global_P, B, device)
        # without augmentation every step's batches are one gather from the group's samples, by
        # an index built once for the group, and its dropout masks one draw a layer (augmentation
        # draws per client and step) (named for the profiler: bench/step_ops.py counts its
        # host-side work apart from the steps')
        with torch.profiler.record_function("fedddp::group_batches"):
            indexed = None if training.augment else _GroupBatches(group, schedules, device)
            group_drops = self._group_dropout_masks(indexed, schedules, device) \
                if indexed is not None and self.dropouts else None
        optimizer = StackedOptimizer(tc, stacks, [s.lr(0) for s in schedules])
        # each client's loss summed over its steps in float64 (train_client's sum), a row of the
        # stacks so it leaves with the client: one add a step
        stacks["loss_sum"] = [torch.zeros(B, dtype=torch.float64, device=device)]
        sums = None
        if self.whole_step is not None and not self.whole_step.failed:
            sums = self._whole_steps(group, schedules, stacks, (indexed, group_drops), device)
        if sums is None:
            sums = self._eager_steps(group, schedules, stacks, (indexed, group_drops), optimizer, device)
        loss_sum_B, lr_sum_B = sums

        # -- the rest of each report, as train_client writes it --------------------------------
        loss_sums = loss_sum_B.tolist()  # read from the device once a group, not once a client
        # the client's trained model into self.model only for what reads it (the rule's end hook,
        # CGW's full-batch gradient, FedER's ranks): else a copy a tensor and client for nothing
        reads_model = rules.reads_trained_model(rule) or bool(needs & {"full_grad_KP", "eff_rank_KL"})
        for b, (ctx, data, seed, work, out) in enumerate(group):
            steps = steps_B[b]
            if reads_model:
                self.layout.unflatten_into(out["params_P"], self.model)
            finish_report(self.model, ctx, data, rule, needs, steps, lr_sum_B[b] / max(steps, 1), loss_sums[b], out)
        if device.type == "cuda":  # the group's kernels, not their queueing: else they would fall
            torch.cuda.synchronize(device)  # into the round's next wait, outside train_s
        seconds = (time.perf_counter() - t_start) / B  # a share of the group's time: ranks' sums stay right
        for ctx, data, seed, work, out in group:
            out["train_time"] = seconds

    def _whole(self, stacks: dict, batch: tuple, lr_R: torch.Tensor, live_R: torch.Tensor):
        """One whole step of R rows (run.compile's ``WholeStep`` compiles this function): the
        rule's gradients and direction, the running statistics' update, the optimizer's update
        (``whole_update``, its step count a row of the stacks), each row's loss added to its
        sum; a row whose ``live_R`` is False keeps every tensor as it was (``torch.where``: its
        bits unchanged), so a client that has taken its steps is never stepped again. Returns
        the new stacks' entries, the direction, and the scratch entries the direction replaced
        (FedSMOO's dual)."""
        shape = _Shape(None, False)  # one padded call: the shapes stay the same every step
        grads_T, loss_L, stats = self._gradients(stacks, batch, shape)
        step_view = _Step(self, stacks, self.group, grads_T, batch, shape)
        direction_T = list(self.rule.direction(step_view))
        new = whole_update(self.training.train, stacks, direction_T, lr_R)
        if stats:
            new["buffers"] = self._update_running_stats(stacks["buffers"], stats)
        new["loss_sum"] = [stacks["loss_sum"][0] + torch.where(live_R, loss_L.detach().double(), 0.0)]
        replaced = {}
        for name, value in step_view.scratch.items():
            if value is not step_view._given[name]:
                before = _as_leaves(step_view._given[name])
                replaced[name] = [torch.where(_per_client(live_R, n), n, b) for n, b in zip(_as_leaves(value), before)]
        kept = {key: [torch.where(_per_client(live_R, n), n, old) for n, old in zip(tensors, stacks[key])]
                for key, tensors in new.items()}
        return kept, direction_T, replaced

    def _whole_steps(self, group, schedules, stacks: dict, batches: tuple, device):
        """The group's steps as run.compile's whole step, every group padded to R rows (B, copies
        of its first client, never live) and train.batch_size samples; a client that has taken
        its steps keeps its row, masked. Returns what ``_eager_steps`` returns, or None where
        the compiler failed on the first step (nothing changed: the eager steps run)."""
        tc, (indexed, group_drops) = self.training.train, batches
        B, steps_B = len(group), [s.steps for s in schedules]
        R = max(self.training.clients, B)
        width = tc.batch_size if tc.batch_size > 0 else max([self.widest] + [len(data) for _, data, *_ in group])
        stacks = dict(stacks)  # the caller's stay as they are for the eager steps, should compiling fail
        whole_state(tc, stacks)
        stacks = {key: [pad(t, R, fill_first=True) for t in value] for key, value in stacks.items()}
        live, live_R, live_count, batch_R, lr_sum_B = list(range(B)), None, 0, None, [0.0] * B
        lr_R, lr_before = None, None
        local = precision.side_by_side(tc.precision, device)
        for step in range(max(steps_B)):
            live_schedules = [schedules[b] for b in live]
            if indexed is not None:
                x, y, mask, count, sizes = indexed.step(step)
            else:
                x, y, mask, count, sizes = self._augmented_batches(live_schedules, step, device)
            if group_drops is not None:
                drops = {i: m[indexed.rows(step), :x.shape[1]] for i, m in group_drops.items()}
            else:
                drops = self._dropout_masks([(s.seed, step) for s in live_schedules], sizes, x.shape[1], device)
            batch_R = self._rows_batch((x, y, mask, count, drops), batch_R, live, R, width)
            if live_R is None or len(live) != live_count:  # built again only when a client leaves
                live_R, live_count = torch.tensor([b in live for b in range(R)], device=device), len(live)
            lr_by_row = [0.0] * R
            for b, s in zip(live, live_schedules):
                lr_by_row[b] = s.lr(step)
                lr_sum_B[b] += lr_by_row[b]
            if lr_by_row != lr_before:  # built again only when a rate changes (a schedule, a client leaving)
                lr_R, lr_before = torch.tensor(lr_by_row, device=device), lr_by_row
            args = (stacks, batch_R, lr_R, live_R)
            with local:  # train.precision, as train_client's steps
                out = self.whole_step(*args, device=device)
                if out is None and step == 0:
                    return None
                kept, direction_T, replaced = out if out is not None else self._whole(*args)
            if out is not None and replay_outputs_freed(device):  # the next replay would overwrite them
                kept, replaced = self.whole_step.persist(kept, replaced)
            stacks = {**stacks, **kept}
            for name, leaves in replaced.items():  # one for all until now: each client's from now on
                self.group.shared.pop(("scratch", name), None)
                stacks[("scratch", name)] = leaves
                self.whole_replaced.add(name)
            done = [b for b in live if steps_B[b] == step + 1]
            if done and "last_grad_KP" in self.needs:
                for b, last_P in zip(done, self._flat_BP(direction_T, done)):
                    group[b][4]["last_grad_P"].copy_(last_P)
            live = [b for b in live if b not in done]
        self._whole_reports(group, stacks)
        return stacks["loss_sum"][0][:B].clone(), lr_sum_B

    def _whole_reports(self, group, stacks: dict) -> None:
        """Each client's trained parameters (and the scratch entries the direction replaced)
        from its row of the whole step's stacks, as ``_leave`` writes them."""
        rows = list(range(len(group)))
        for b, params_P in zip(rows, self._flat_BP(stacks["params"], rows, stacks["buffers"])):
            ctx, *_, out = group[b]
            out["params_P"].copy_(params_P)
            for name in self.whole_replaced:
                leaves = [t[b].clone() for t in stacks[("scratch", name)]]
                ctx.scratch[name] = leaves if self.group.forms[name] == "list" else leaves[0]
        self.whole_replaced = set()

    @staticmethod
    def _rows_batch(batch: tuple, before, live: list[int], R: int, width: int):
        """A step's batch of the L clients still stepping (x, y, mask, count, drops, [L, S, ...])
        as R rows of ``width`` samples: padded (rows copies of the first client's, samples zeros
        under mask 0) while no client has left, else written into the rows of the clients still
        stepping of the previous step's (``before``), the others' rows left as they were."""
        x, y, mask, count, drops = batch
        if len(live) == R or before is None or live == list(range(len(live))):
            rows = lambda t, w=width: pad(t, R, w, fill_first=True) if t.dim() > 1 else pad(t, R, fill_first=True)  # noqa: E731
            return (rows(x), rows(y), pad(mask, R, width), pad(count, R, fill_first=True),
                    {k: rows(v) for k, v in drops.items()})
        index = torch.tensor(live, device=x.device)
        into = lambda old, t: old.index_copy(0, index, pad(t, len(live), width) if t.dim() > 1 else t)  # noqa: E731
        x_R, y_R, mask_R, count_R, drops_R = before
        return (into(x_R, x), into(y_R, y), into(mask_R, mask), into(count_R, count),
                {k: into(drops_R[k], v) for k, v in drops.items()})

    def _eager_steps(self, group, schedules, stacks: dict, batches: tuple, optimizer, device):
        """The group's steps, one eager step at a time, the clients that have taken their steps
        leaving the stacks (``_leave``). Returns each client's loss sum [B] (float64) and its
        learning rates' sum."""
        tc, rule, needs = self.training.train, self.rule, self.needs
        indexed, group_drops = batches
        B, steps_B = len(group), [s.steps for s in schedules]
        loss_sum_B = torch.zeros(B, dtype=torch.float64, device=device)
        lr_sum_B = [0.0] * B
        live, replaced = list(range(B)), set()
        local = precision.side_by_side(tc.precision, device)
        for step in range(max(steps_B)):
            for j, b in enumerate(live):  # a client's own epoch boundary (train_client's epoch_end)
                if step % schedules[b].per_epoch == 0 and step > 0:
                    optimizer.epoch_start(b, [p[j] for p in stacks["params"]])
            live_schedules = [schedules[b] for b in live]
            if indexed is not None:
                x, y, mask, count, sizes = indexed.step(step)
            else:
                x, y, mask, count, sizes = self._augmented_batches(live_schedules, step, device)
            if group_drops is not None:  # views of the group's masks
                drops = {i: m[indexed.rows(step), :x.shape[1]] for i, m in group_drops.items()}
            else:
                drops = self._dropout_masks([(s.seed, step) for s in live_schedules], sizes, x.shape[1], device)
            lr_L = [s.lr(step) for s in live_schedules]
            shape = _Shape(self._width_parts(sizes, device), len(set(sizes)) == 1)
            for b, lr in zip(live, lr_L):
                lr_sum_B[b] += lr
            with local:  # train.precision: TF32 on CUDA (bf16 casts around the gradient call, precision.in_dtype)
                grads_T, loss_L, stats = self._gradients(stacks, (x, y, mask, count, drops), shape)
                step_view = _Step(self, stacks, self.group, grads_T, (x, y, mask, count, drops), shape)
                direction_T = list(rule.direction(step_view))
            stacks["loss_sum"][0].add_(loss_L.detach())  # in float64, as .double() then add
            replaced |= step_view.keep(stacks, self.group.shared)
            if stats:  # the step's one update of the running statistics (extra passes leave them)
                stacks["buffers"] = self._update_running_stats(stacks["buffers"], stats)
            done = [j for j, b in enumerate(live) if steps_B[b] == step + 1]
            if done and "last_grad_KP" in needs:
                for j, last_P in zip(done, self._flat_BP(direction_T, done)):
                    group[live[j]][4]["last_grad_P"].copy_(last_P)
            optimizer.step(stacks, direction_T, lr_L, step + 1, live)
            if done:
                rows = torch.tensor(done, device=device)
                loss_sum_B.index_copy_(0, torch.tensor([live[j] for j in done], device=device),
                                       stacks["loss_sum"][0].index_select(0, rows))
                stacks, live = self._leave(group, stacks, live, done, replaced, self.group.forms)
        return loss_sum_B, lr_sum_B

    def _leave(self, group, stacks: dict, live: list[int], done: list[int], replaced: set[str], forms: dict):
        """The clients ``done`` (rows of the stacks) that have taken their steps leave the stacks
        with their parameters and state as they are (never stepped again, not even with a zero
        gradient): parameters into their report rows, the scratch entries the direction replaced
        back into their ctx.scratch (in their ``forms``). Returns the remaining stacks and live
        clients."""
        for j, params_P in zip(done, self._flat_BP(stacks["params"], done, stacks["buffers"])):
            ctx, *_, out = group[live[j]]
            out["params_P"].copy_(params_P)
            for name in replaced:  # FedSMOO's dual, which its end hook reads
                leaves = [t[j].clone() for t in stacks[("scratch", name)]]
                ctx.scratch[name] = leaves if forms[name] == "list" else leaves[0]
        keep = [j for j in range(len(live)) if j not in done]
        index = torch.tensor(keep, dtype=torch.long, device=stacks["params"][0].device)
        stacks = {key: [t.index_select(0, index) for t in value] for key, value in stacks.items()}
        return stacks, [live[j] for j in keep]

    def _augmented_batches(self, schedules: list[Schedule], step: int, device):
        """This step's augmented batches of the L clients (each ``Schedule.batch``: augmentation
        draws per client), padded to the largest: x [L, S, ...], y [L, S], mask [L, S] (1 on a
        client's own samples), count [L] (its batch size), and the batch sizes."""
        batches = [s.batch(step) for s in schedules]
        width = max(len(y) for _, y in batches)
        x0, y0 = batches[0]
        x = torch.zeros((len(batches), width) + tuple(x0.shape[1:]), dtype=x0.dtype, device=device)
        y = torch.zeros((len(batches), width), dtype=y0.dtype, device=device)
        mask = torch.zeros(len(batches), width, device=device)
        for j, (xj, yj) in enumerate(batches):
            x[j, :len(yj)], y[j, :len(yj)], mask[j, :len(yj)] = xj, yj, 1.0
        return x, y, mask, mask.sum(1), [len(yj) for _, yj in batches]

    def _group_dropout_masks(self, indexed: _GroupBatches, schedules: list[Schedule], device) -> dict | None:
        """Every step's dropout masks of a group at once, [M, W, ...] by layer index for the M
        (step, client) rows of ``indexed``: one draw a layer for the whole group rather than one a
        step; the same masks as ``_dropout_masks`` draws a step. None where they would take more
        than GROUP_DROPOUT_BYTES (each step then draws its own)."""
        shapes = {layer.index: self.drop_shapes[layer.index] for layer in self.dropouts
                  if self.drop_shapes.get(layer.index) is not None}
        M, W = indexed.mask_MW.shape
        if M * W * sum(math.prod(shape) for shape in shapes.values()) * 4 > GROUP_DROPOUT_BYTES:
            return None
        keys = [(schedules[b].seed, step) for b, step in indexed.pairs_M]
        drops = {}
        for layer in self.dropouts:
            shape = shapes.get(layer.index)
            if shape is None:  # not reached by the forward
                continue
            masks = dropout.masks(dropout.keys_C2(keys, layer.index, device), W * math.prod(shape), layer.p)
            # padding rows zero, as no sample of the client sits there
            drops[layer.index] = masks.view((M, W) + shape) * indexed.mask_MW.view((M, W) + (1,) * len(shape))
        return drops

    def _dropout_masks(self, keys: list[tuple[int, int]], sizes: list[int], width: int, device) -> dict:
        """The step's dropout masks by layer index, [L, S, ...] each: client j's first
        ``sizes[j]`` rows are the mask train_client draws at its key (client seed, step), the
        padding rows zero. Every client's mask of a layer comes from one counter-based draw
        (models.dropout.masks): row r of client j's mask is its elements r F .. (r + 1) F - 1."""
        drops = {}
        rows_L1 = None
        for layer in self.dropouts:
            shape = self.drop_shapes.get(layer.index)
            if shape is None:  # not reached by the forward
                continue
            masks = dropout.masks(dropout.keys_C2(keys, layer.index, device), width * math.prod(shape), layer.p)
            masks = masks.view((len(keys), width) + shape)
            if min(sizes) < width:  # padding rows: zero, as no sample of the client sits there
                if rows_L1 is None:
                    rows_L1 = torch.arange(width, device=device)[None] < torch.tensor(sizes, device=device)[:, None]
                masks = masks * rows_L1.view(rows_L1.shape + (1,) * len(shape))
            drops[layer.index] = masks
        return drops

    def _flat_BP(self, stacks_T, rows: list[int], buffers_T=()) -> torch.Tensor:
        """[len(rows), P] flat vectors of the given rows of per-tensor stacks: parameters in layout
        order, then the stacked ``buffers_T`` (BatchNorm statistics), zeros for buffers without."""
        index = torch.tensor(rows, dtype=torch.long, device=stacks_T[0].device)
        flat_BP = torch.zeros(len(rows), self.layout.numel, device=stacks_T[0].device)
        for e, t in zip(self.param_entries + self.buffer_entries, list(stacks_T) + list(buffers_T)):
            flat_BP[:, e.offset:e.offset + e.numel] = t.index_select(0, index).reshape(len(rows), -1)
        return flat_BP

    def _stacked(self, flat_P: torch.Tensor, entries, B: int) -> list[torch.Tensor]:
        """The tensors of ``entries`` in ``flat_P``, each repeated for B clients ([B, ...]);
        integer buffers (num_batches_tracked) rounded, as FlatLayout.unflatten_into does."""
        stacked = []
        for e in entries:
            t = flat_P[e.offset:e.offset + e.numel].view(e.shape)
            if e.name in self.integer_buffers:
                t = t.round()
            stacked.append(t.expand((B,) + e.shape).clone())
        return stacked
