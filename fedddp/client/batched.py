"""Side-by-side local training (``run.parallel_clients = B > 1``): up to B of a rank's clients
trained as one batched computation over parameters stacked on a client dimension.

Legend: B clients of a group, S padded samples of a step (the group's largest batch), P flat
elements, T parameter tensors.

Every step is one ``torch.func`` computation, ``vmap(grad_and_value(loss))`` over the stacked
parameters, no compilation. It keeps ``train_client``'s semantics client by client (that path,
``B = 1``, stays the reference):

- batches: each client draws from its own generator seeded by (seed, round, client id), in the
  same order as ``train_client`` (``randperm`` per epoch, then augmentation), so a client's
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
- local rules: their ``begin`` and ``end`` hooks run per client as in the sequential path (the
  state they read and write is the same), and their per-step direction is written here over
  the stacks (plain, prox, scaffold, moon, sam, gam, gam_cv, smoo);
- reports: the trained parameters (and last-step directions) go from the stacks straight into
  the report rows; full-batch gradients (CGW) and effective ranks (FedER) are computed per
  client by the sequential functions, after loading its trained parameters into the model.
- dropout: vmap refuses random operations, so each client's masks for the step are drawn
  outside it from (its seed, step, layer) exactly as ``models.dropout.SeededDropout`` draws them
  in the sequential path, padded with zeros, and the twin's ``_MaskedDropout`` layers multiply by
  them; any other random operation is a config error naming the module, found before round 1 by
  ``try_step`` (which the run and ``--check`` call).

BatchNorm: each client has its own running statistics (running_mean, running_var,
num_batches_tracked), stacked on the client dimension like the parameters and starting from the
global vector's (``model.flat_buffers = true``; with false the sequential path's statistics are
whatever the rank's previous client left, so B > 1 is refused). In the batched computation every
BatchNorm layer is a ``_MaskedBatchNorm`` (a copy of the model on the meta device holds them):
in training mode it normalises with the mean and biased variance of the client's own samples
only (padding has mask 0 and enters neither), and returns that mean and the unbiased variance as
auxiliary outputs of ``grad_and_value``; the running statistics are then updated outside the
transform, once per step as torch does (momentum, or the cumulative average for momentum None;
num_batches_tracked + 1). The extra pass of SAM, GAM and FedSMOO discards its statistics (the
sequential ``rules._shifted`` restores the buffers); MOON's global and previous models run in
eval mode on their own running statistics. Other buffers (not BatchNorm's) are refused. (torch
2.14's vmap of ``F.batch_norm`` does update batched buffers in place, but it would take the
padding into the statistics; on CPU masking costs 2-14% of a ResNet-18 step against it, and
splitting a step's clients by batch width would be cheaper on steps with a partial batch:
BENCHMARKS.md.) Memory:
a ResNet-18 client side by side takes about 661 MiB on CPU (batch 32, 3x32x32, plain SGD),
mostly its batch's activations; its parameters are 42.6 MiB a copy (BENCHMARKS.md).

The result equals the sequential path to float32 rounding, not always bit for bit (the batched
kernels may sum in another order); tests/test_parallel_clients.py states the tolerance. The
bits can depend on the group a client trains in, so groups are cut without regard to the world
size (``fedddp.sampling.assign_groups``).
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from .. import strategies, tasks
from ..data.vision import augment_batch
from ..errors import ConfigError
from ..flat import FlatLayout
from ..metrics.effective_rank import effective_ranks_L, unfolding
from ..sampling import batch_size_of
from ..models import dropout
from ..registry import resolve
from . import rules
from . import ClientContext, batches_per_epoch, full_batch_gradient, planned_steps, start_gradient
from .batched_optim import OPTIMIZERS, StackedOptimizer, _per_client
from .optim import lr_at

RULES = ("plain", "prox", "scaffold", "moon", "sam", "gam", "gam_cv", "smoo")
BATCH_NORM_MODELS = ("resnet18",)  # the built-ins with BatchNorm (plugin models are checked when built)


def check(cfg) -> list[str]:
    """Configuration errors of run.parallel_clients: each names what is not batched and the fix."""
    size = cfg.run.parallel_clients
    if size == "auto":  # resolved when the run starts (client/parallel.py): 1 where side by side cannot run
        return []
    if size < 1:
        return [f"run.parallel_clients: must be >= 1 (1: one client after another), got {size}"]
    if size == 1:
        return []
    try:
        local = resolve(cfg.algorithm)[0]
    except Exception:  # noqa: BLE001 - an unknown algorithm is reported by its own check
        return []
    fix = "; set run.parallel_clients=1"
    errors = []
    if local not in RULES:
        errors.append(f"run.parallel_clients: the local rule {local} is not batched (batched: "
                      f"{', '.join(RULES)}){fix}")
    if cfg.train.optimizer not in OPTIMIZERS:
        errors.append(f"run.parallel_clients: train.optimizer = {cfg.train.optimizer} is not batched "
                      f"(batched: {', '.join(OPTIMIZERS)}){fix}")
    if cfg.model.name in BATCH_NORM_MODELS and not cfg.model.flat_buffers:
        errors.append(_FLAT_BUFFERS_ERROR.format(cfg.model.name))
    return errors


# Without the buffers in the flat vector, the sequential path starts each client from the running
# statistics the rank's previous client left: a result that depends on the rank, not copied here.
_FLAT_BUFFERS_ERROR = ("run.parallel_clients: model.name = {} has BatchNorm, whose running statistics with "
                       "model.flat_buffers=false depend on the rank's previous client; set "
                       "model.flat_buffers=true or run.parallel_clients=1")


def try_side_by_side(cfg, model, data) -> None:
    """--check's trial of the run's side-by-side step (``BatchedTrainer.try_step``) on the first
    client with samples of ``data`` (a built FederatedData), as the run makes it before round 1."""
    local, server = resolve(cfg.algorithm)
    needs = strategies.ALWAYS | strategies.get(server).needs_for(cfg.algorithm)
    trainer = BatchedTrainer(model, FlatLayout(model, buffers=cfg.model.flat_buffers), cfg, rules.get(local),
                             needs, tasks.get(data.task))
    trainer.try_first_client(data.train, data.num_samples, range(cfg.data.num_clients))


class _Schedule:
    """One client's batches and learning rates, drawn exactly as ``train_client`` draws them."""

    def __init__(self, cid, data, tc, augment: bool, round_idx: int, seed: int, work: int, device):
        self.cid, self.data, self.tc, self.augment = cid, data, tc, augment
        n = len(data)
        self.batch_size, self.per_epoch = batch_size_of(n, tc.batch_size), batches_per_epoch(n, tc.batch_size)
        self.steps = planned_steps(n, tc, work)
        self.round_idx, self.epochs_before = round_idx, (round_idx - 1) * tc.local_epochs
        self.seed, self.gen = seed, torch.Generator().manual_seed(seed)
        self.device, self.order = device, None

    def positions(self, step: int) -> torch.Tensor:
        """This step's sample indices (on the CPU), as ``train_client`` draws them."""
        pos = step % self.per_epoch
        if pos == 0:
            self.order = torch.randperm(len(self.data), generator=self.gen)
        return self.order[pos * self.batch_size:(pos + 1) * self.batch_size]

    def augmented_batch(self, step: int):
        """This step's batch, augmented by draws that follow the step's permutation."""
        idx = self.positions(step).to(self.device)
        return augment_batch(self.data.x[idx], self.gen), self.data.y[idx]

    def lr(self, step: int) -> float:
        return lr_at(self.tc, self.round_idx, self.epochs_before + step // self.per_epoch)


class _Represent(nn.Module):
    """A model as (representation, output), so that functional_call reaches ``represent``."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        z = self.net.represent(x)
        return z, self.net.head(z)


def _ascent(grads_T, rho: float, eps: float):
    """SAM's e = rho g / (||g|| + eps) per client, the norm over every parameter of the client."""
    norms_TB = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads_T])
    scale_B = rho / (torch.linalg.vector_norm(norms_TB, dim=0) + eps)
    return [g * _per_client(scale_B, g) for g in grads_T]


class _Batch:
    """What the masked BatchNorm and dropout layers of one forward read and write: the client's
    sample mask [S] and count and its dropout masks by layer index ([S, ...] each; under vmap
    each client's own), and, in the order the layers ran, the names of the layers that computed
    batch statistics and those statistics."""

    def __init__(self):
        self.mask = self.count = None
        self.drops = {}
        self.names, self.stats = [], []


class _MaskedBatchNorm(nn.Module):
    """A BatchNorm layer (any dimension) over the samples of ``batch.mask`` only, with the same
    parameters and buffers (names, shapes) as the layer it stands for. It never writes its
    buffers: in training mode it appends (mean, unbiased variance) to ``batch.stats`` for the
    caller to update the running statistics outside the torch.func transforms."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, name: str, batch: _Batch):
        super().__init__()
        self.eps, self.momentum, self.name, self.batch = bn.eps, bn.momentum, name, batch
        self.weight, self.bias = bn.weight, bn.bias
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            self.register_buffer(key, getattr(bn, key, None))

    def forward(self, x):
        shape = (1, -1) + (1,) * (x.dim() - 2)  # [C] broadcast over [S, C, ...]
        if self.training or self.running_mean is None:  # torch's bn_training
            dims = [0] + list(range(2, x.dim()))
            mask = self.batch.mask.view((-1,) + (1,) * (x.dim() - 1))
            n = self.batch.count * (x[0, 0].numel())  # the client's values per channel
            mean_C = (x * mask).sum(dims) / n
            centred = x - mean_C.view(shape)
            var_C = (centred * centred * mask).sum(dims) / n
            if self.training and self.running_mean is not None:
                self.batch.names.append(self.name)
                self.batch.stats += [mean_C.detach(), (var_C * (n / (n - 1))).detach()]
            out = centred * torch.rsqrt(var_C + self.eps).view(shape)
        else:
            out = (x - self.running_mean.view(shape)) * torch.rsqrt(self.running_var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out


class _MaskedDropout(nn.Module):
    """A ``dropout.SeededDropout`` whose mask is the client's for this step, ``batch.drops``
    (drawn outside vmap as the sequential path draws it): no random operation under vmap."""

    def __init__(self, layer: dropout.SeededDropout, batch: _Batch):
        super().__init__()
        self.p, self.index, self.batch = layer.p, layer.index, batch

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        return x * self.batch.drops[self.index]


def _masked_twin(model: nn.Module, batch: _Batch) -> nn.Module:
    """The model with each BatchNorm layer a ``_MaskedBatchNorm`` and each dropout layer a
    ``_MaskedDropout``, on the meta device: functional_call supplies every parameter and
    buffer, so it holds no memory of its own."""
    twin = copy.deepcopy(model).to("meta")
    for name, module in list(twin.named_modules()):
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            masked = _MaskedBatchNorm(module, name, batch)
        elif isinstance(module, dropout.SeededDropout):
            masked = _MaskedDropout(module, batch)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(twin.get_submodule(parent) if parent else twin, child, masked)
    return twin


def _check_buffers(model: nn.Module, layout: FlatLayout, cfg) -> None:
    """BatchNorm statistics are batched when they travel in the flat vector; anything else is a
    config error naming the fix."""
    bn_buffers = {f"{name}.{key}" for name, m in model.named_modules()
                  if isinstance(m, nn.modules.batchnorm._BatchNorm) for key, _ in m.named_buffers(recurse=False)}
    others = [name for name, _ in model.named_buffers() if name not in bn_buffers]
    if others:
        raise ConfigError(f"run.parallel_clients: model.name = {cfg.model.name} has buffers that are not "
                          f"BatchNorm statistics ({', '.join(others[:3])}), which are not batched; set "
                          "run.parallel_clients=1")
    if bn_buffers and not any(not e.is_param for e in layout.entries):
        raise ConfigError(_FLAT_BUFFERS_ERROR.format(cfg.model.name))


class BatchedTrainer:
    """Trains groups of clients side by side; one per run (it holds the model's functional form)."""

    def __init__(self, model, layout: FlatLayout, cfg, rule, needs: frozenset, task):
        self.model, self.layout, self.cfg, self.rule, self.needs, self.task = model, layout, cfg, rule, needs, task
        _check_buffers(model, layout, cfg)
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
        self.batch, self.stat_names = _Batch(), []
        self.net = net = _masked_twin(model, self.batch) if self.batch_norms or self.dropouts else model

        def loss(params_T, buffers_T, x, y, mask, count, drops):
            output = self._forward(net, params_T, buffers_T, x, mask, count, drops)
            stats = self._collected()
            return (task.loss(output, y, reduction="none") * mask).sum() / count, stats

        # per client: (gradients of the loss, (the loss, BatchNorm batch statistics)) at its own
        # parameters, batch and dropout masks
        self._plain = vmap(grad_and_value(loss, has_aux=True))
        self._moon = self._moon_grad_and_loss(net, task, cfg.algorithm) if rule.name == "moon" else None

    def _forward(self, net, params_T, buffers_T, x, mask, count, drops, prefix: str = "", training: bool = True):
        """``net`` at the given parameters and buffers, in training or eval mode; BatchNorm over
        the samples of ``mask`` (its statistics collected afresh in ``self.batch``), dropout
        with the masks ``drops``."""
        self.batch.mask, self.batch.count, self.batch.names, self.batch.stats = mask, count, [], []
        self.batch.drops = drops
        net.train(training)
        tensors = dict(zip([prefix + n for n in self.names], list(params_T) + list(buffers_T)))
        return functional_call(net, tensors, (x,))

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
            self._plain(self._stacked(flat_P, self.param_entries, 1), self._stacked(flat_P, self.buffer_entries, 1),
                        x[None], y[None], mask, mask.sum(1), drops)
        except RuntimeError as exc:
            where = f"its module {running[-1]} ({type(self.net.get_submodule(running[-1])).__name__})" \
                if running and running[-1] else "its forward"
            if "random" in str(exc):
                why = ("calls a random operation, which side by side cannot draw per client (nn.Dropout "
                       "layers can: their masks are drawn outside vmap)")
            else:
                why = f"does not run under torch.func.vmap ({str(exc).splitlines()[0]})"
            raise ConfigError(f"run.parallel_clients: model.name = {self.cfg.model.name}: {where} {why}; set "
                              "run.parallel_clients=1") from None
        finally:
            for hook in hooks:
                hook.remove()

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
                    f"run.parallel_clients: model.name = {self.cfg.model.name}: its dropout layer "
                    f"{names[layer]} sees inputs {', '.join(str(list(shape)) for _, shape in calls)} for batches "
                    "of 1 and 2 samples; side by side its masks are drawn per sample along the first "
                    "dimension, which must be the batch's, one shape per layer; set run.parallel_clients=1")
            shapes[layer.index] = calls[0][1][1:]
        return shapes

    def _collected(self) -> tuple:
        """The batch statistics of the training forward just run, their layers' names kept for
        ``_update_running_stats``."""
        self.stat_names = self.batch.names
        return tuple(self.batch.stats)

    def _moon_grad_and_loss(self, net, task, hp):
        """MOON's loss per client (rules.Moon): the data loss plus mu times the contrastive
        cross-entropy of [cos(z, z_glob), cos(z, z_prev)] / tau, the latter only for clients with
        a previous model (``has_prev`` 1); the global and previous models in eval mode on their
        own running statistics; (gradients, (loss, data loss, batch statistics)) per client."""
        represent = _Represent(net)

        def at(params_T, buffers_T, x, mask, count, drops, training=True):
            return self._forward(represent, params_T, buffers_T, x, mask, count, drops, "net.", training)

        def loss(params_T, buffers_T, x, y, mask, count, drops, global_T, global_buffers_T, prev_T, prev_buffers_T,
                 has_prev):
            z, output = at(params_T, buffers_T, x, mask, count, drops)
            stats = self._collected()  # before the frozen models' forwards start afresh
            data_loss = (task.loss(output, y, reduction="none") * mask).sum() / count
            z_glob = at(global_T, global_buffers_T, x, mask, count, drops, training=False)[0].detach()
            z_prev = at(prev_T, prev_buffers_T, x, mask, count, drops, training=False)[0].detach()
            sims = torch.stack([F.cosine_similarity(z, z_glob, dim=1),
                                F.cosine_similarity(z, z_prev, dim=1)], dim=1) / hp.params["moon_tau"]
            labels = torch.zeros(sims.shape[0], dtype=torch.long, device=sims.device)
            contrast = (F.cross_entropy(sims, labels, reduction="none") * mask).sum() / count
            return data_loss + has_prev * (hp.params["moon_mu"] * contrast), (data_loss, stats)

        return vmap(grad_and_value(loss, has_aux=True), in_dims=(0, 0, 0, 0, 0, 0, 0, None, None, 0, 0, 0))

    def _gradients(self, params_T, stacks, shared, x, y, mask, count, drops):
        """Per client: the gradients of its loss at its ``params_T`` (and its running statistics
        ``stacks["buffers"]``) on its batch with its dropout masks ``drops``, its data loss (MOON's
        without the contrastive term, as rules.Moon returns it), and its BatchNorm batch statistics
        (mean, unbiased variance per layer in ``self.stat_names``' order, [L, C] each)."""
        if self._moon is None:
            grads_T, (loss_L, stats) = self._plain(params_T, stacks["buffers"], x, y, mask, count, drops)
            return grads_T, loss_L, stats
        grads_T, (_, (data_loss, stats)) = self._moon(
            params_T, stacks["buffers"], x, y, mask, count, drops, shared["global"], shared["global_buffers"],
            stacks["prev"], stacks["prev_buffers"], stacks["has_prev"][0])
        return grads_T, data_loss, stats

    def _update_running_stats(self, buffers_T: list[torch.Tensor], stats) -> list[torch.Tensor]:
        """The stacked running statistics after one training forward, as torch's BatchNorm updates
        them: num_batches_tracked + 1, then running = (1 - m) running + m batch with m the layer's
        momentum (None: 1 / num_batches_tracked, the cumulative average), the variance unbiased."""
        index = self.buffer_index
        new_T = list(buffers_T)
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

    def _start_stacks(self, group, global_P: torch.Tensor, B: int, device) -> tuple[dict, dict]:
        """The group's per-client tensors as stacks ([B, ...]) and the ones every client shares,
        after the rule's begin hooks: parameters and buffers from global_P, the rule's scratch
        (FedProx's anchor, SCAFFOLD's correction, FedSMOO's duals), MOON's models."""
        # Per-client tensors live in ``stacks`` ([L, ...] over the L clients still stepping, in
        # the order of ``live``); one every client shares (FedProx's anchor: the global model)
        # stays in ``shared`` and broadcasts.
        stacks, shared = {}, {}
        for key in ("anchor", "correction", "mu", "s"):
            if key in group[0][0].scratch:
                views_BT = [ctx.scratch[key] for ctx, *_ in group]
                if all(v.data_ptr() == w.data_ptr() for views_T in views_BT for v, w in zip(views_T, views_BT[0])):
                    shared[key] = views_BT[0]
                else:
                    stacks[key] = [torch.stack(views_B) for views_B in zip(*views_BT)]
        stacks["params"] = self._stacked(global_P, self.param_entries, B)
        # each client's running statistics start from the global vector's, integers rounded as
        # FlatLayout.unflatten_into rounds them for the sequential path
        stacks["buffers"] = self._stacked(global_P, self.buffer_entries, B)
        if self.rule.name == "moon":
            # the global model (shared) and each client's previous one (its own, else the global:
            # has_prev 0 leaves it out of the loss)
            shared["global"] = [global_P[e.offset:e.offset + e.numel].view(e.shape) for e in self.param_entries]
            shared["global_buffers"] = [t[0] for t in stacks["buffers"]]
            prev_BP = torch.stack([ctx.state["prev_P"].to(device) if "prev_P" in ctx.state else global_P
                                   for ctx, *_ in group])
            stacks["prev"] = [prev_BP[:, e.offset:e.offset + e.numel].reshape((B,) + e.shape)
                              for e in self.param_entries]
            stacks["prev_buffers"] = [prev_BP[:, e.offset:e.offset + e.numel].reshape((B,) + e.shape)
                                      for e in self.buffer_entries]
            stacks["has_prev"] = [torch.tensor([float("prev_P" in ctx.state) for ctx, *_ in group], device=device)]
        return stacks, shared

    def train_group(self, group: list[tuple[ClientContext, object, int, int, dict]]) -> None:
        """Train the clients of ``group`` ((ctx, data, seed, work, out) each, ``out`` the
        client's report views as in ``train_client``) side by side and write their reports."""
        t_start = time.perf_counter()
        cfg, tc, rule, layout, needs = self.cfg, self.cfg.train, self.rule, self.layout, self.needs
        ctx0 = group[0][0]
        hp, device, global_P = ctx0.hp, ctx0.global_P.device, ctx0.global_P
        B = len(group)
        schedules = [_Schedule(ctx.client_id, data, tc, cfg.data.augment, ctx.round_idx, seed, work, device)
                     for ctx, data, seed, work, out in group]
        steps_B = [s.steps for s in schedules]
        # the group's samples in one tensor, for one gather a step (augmentation draws per client)
        group_x = group_y = None
        if not cfg.data.augment:
            group_x = torch.cat([data.x for _, data, *_ in group])
            group_y = torch.cat([data.y for _, data, *_ in group])
        offsets_B = [0]
        for _, data, *_ in group[:-1]:
            offsets_B.append(offsets_B[-1] + len(data))

        # rule hooks per client, as train_client calls them (model holds global_P, in training
        # mode: SCAFFOLD option I's start gradient normalises with batch statistics)
        layout.unflatten_into(global_P, self.model)
        self.model.train()
        if self.dropouts and self.drop_shapes is None:
            self.drop_shapes = self._dropout_shapes(group[0][1].x)
        for (ctx, data, seed, work, out) in group:
            if rule.needs_start_gradient(hp):
                ctx.scratch["start_grad_P"] = start_gradient(self.model, data, layout, tc.batch_size, ctx.task, seed)
            if rule.name != "moon":  # MOON's begin makes frozen models; here its stacks below
                rule.begin(self.model, ctx)
        stacks, shared = self._start_stacks(group, global_P, B, device)
        optimizer = StackedOptimizer(tc, stacks, [s.lr(0) for s in schedules])
        loss_sum_B = torch.zeros(B, dtype=torch.float64, device=device)
        lr_sum_B = [0.0] * B

        live = list(range(B))
        for step in range(max(steps_B)):
            for j, b in enumerate(live):  # a client's own epoch boundary (train_client's epoch_end)
                if step % schedules[b].per_epoch == 0 and step > 0:
                    optimizer.epoch_start(b, [p[j] for p in stacks["params"]])
            x, y, mask, count, drops, lr_L = self._batches([schedules[b] for b in live], step, device, group_x,
                                                           group_y, [offsets_B[b] for b in live])
            for b, lr in zip(live, lr_L):
                lr_sum_B[b] += lr
            grads_T, loss_L, stats = self._gradients(stacks["params"], stacks, shared, x, y, mask, count, drops)
            loss_sum_B[live] += loss_L.detach().double()
            direction_T = self._direction(stacks, shared, grads_T, x, y, mask, count, drops, hp)
            if stats:  # the step's one update of the running statistics (extra passes leave them)
                stacks["buffers"] = self._update_running_stats(stacks["buffers"], stats)
            done = [j for j, b in enumerate(live) if steps_B[b] == step + 1]
            if done and "last_grad_KP" in needs:
                for j, last_P in zip(done, self._flat_BP(direction_T, done)):
                    group[live[j]][4]["last_grad_P"].copy_(last_P)
            optimizer.step(stacks, direction_T, lr_L, step + 1, live)
            if done:
                # a client that has taken its steps leaves the stacks with its parameters and
                # state as they are (never stepped again, not even with a zero gradient)
                for j, params_P in zip(done, self._flat_BP(stacks["params"], done, stacks["buffers"])):
                    ctx, *_, out = group[live[j]]
                    out["params_P"].copy_(params_P)
                    if "mu" in stacks:  # FedSMOO's dual, which ctx.scratch["perturb_dual_P"] holds
                        for view, mu in zip(ctx.scratch["mu"], stacks["mu"]):
                            view.copy_(mu[j])
                keep = [j for j in range(len(live)) if j not in done]
                index = torch.tensor(keep, dtype=torch.long, device=device)
                stacks = {key: [t.index_select(0, index) for t in value] for key, value in stacks.items()}
                live = [live[j] for j in keep]

        # -- the rest of each report, as train_client writes it --------------------------------
        seconds = (time.perf_counter() - t_start) / B  # a share of the group's time: ranks' sums stay right
        for b, (ctx, data, seed, work, out) in enumerate(group):
            steps = steps_B[b]
            layout.unflatten_into(out["params_P"], self.model)  # the client's trained model
            rule.end(self.model, ctx, steps, lr_sum_B[b] / max(steps, 1), out)
            out["train_loss"] = loss_sum_B[b] / max(steps, 1)
            out["num_samples"] = torch.tensor(float(len(data)))
            out["num_steps"] = torch.tensor(float(steps))
            if "full_grad_KP" in needs:
                out["full_loss"] = full_batch_gradient(self.model, data, layout, out["full_grad_P"], ctx.task)
            if "eff_rank_KL" in needs:
                        out["eff_rank_L"] = effective_ranks_L(self.model, layout, unfolding(hp))
            out["train_time"] = seconds

    def _batches(self, schedules: list[_Schedule], step: int, device, group_x, group_y, offsets: list[int]):
        """This step's batches of the L clients, padded to the largest: x [L, S, ...], y [L, S],
        mask [L, S] (1 on a client's own samples), count [L] (its batch size), the dropout masks
        (``_dropout_masks``), and the rates.
        Without augmentation one gather from the group's samples (``group_x``, client j's from
        row ``offsets[j]``), so the number of kernels does not grow with L; padding takes the
        group's first sample, which the mask leaves out."""
        if group_x is None:
            batches = [s.augmented_batch(step) for s in schedules]
            width = max(len(y) for _, y in batches)
            x0, y0 = batches[0]
            x = torch.zeros((len(batches), width) + tuple(x0.shape[1:]), dtype=x0.dtype, device=device)
            y = torch.zeros((len(batches), width), dtype=y0.dtype, device=device)
            mask = torch.zeros(len(batches), width, device=device)
            for j, (xj, yj) in enumerate(batches):
                x[j, :len(yj)], y[j, :len(yj)], mask[j, :len(yj)] = xj, yj, 1.0
            sizes = [len(yj) for _, yj in batches]
        else:
            positions = [s.positions(step) + offset for s, offset in zip(schedules, offsets)]
            width = max(len(p) for p in positions)
            index = torch.zeros(len(positions), width, dtype=torch.long)
            mask = torch.zeros(len(positions), width)
            for j, p in enumerate(positions):
                index[j, :len(p)], mask[j, :len(p)] = p, 1.0
            index, mask = index.to(device), mask.to(device)
            x, y = group_x[index], group_y[index]
            sizes = [len(p) for p in positions]
        drops = self._dropout_masks([(s.seed, step) for s in schedules], sizes, width, device)
        return x, y, mask, mask.sum(1), drops, [s.lr(step) for s in schedules]

    def _dropout_masks(self, keys: list[tuple[int, int]], sizes: list[int], width: int, device) -> dict:
        """The step's dropout masks by layer index, [L, S, ...] each: client j's first
        ``sizes[j]`` rows are the mask train_client draws at its key (client seed, step), the
        padding rows zero."""
        drops = {}
        for layer in self.dropouts:
            shape = self.drop_shapes.get(layer.index)
            if shape is None:  # not reached by the forward
                continue
            drops[layer.index] = masks = torch.zeros((len(keys), width) + shape, device=device)
            for j, (key, size) in enumerate(zip(keys, sizes)):
                masks[j, :size] = dropout.mask(key, layer.index, (size,) + shape, layer.p, device)
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

    def _direction(self, stacks, shared, grads_T, x, y, mask, count, drops, hp):
        """The step direction of the local rule per client (rules.py has the sequential forms);
        FedSMOO's dual mu is updated in ``stacks`` on the way."""
        name, scratch = self.rule.name, shared | stacks
        params_T = stacks["params"]
        if name in ("sam", "gam", "gam_cv"):
            rho = hp.params["sam_rho"] if name == "sam" else hp.params["gam_rho"]
            shift_T = _ascent(grads_T, rho, 1e-12)
            adv_T = self._grads_at(stacks, shared, shift_T, x, y, mask, count, drops)
            direction_T = adv_T if name == "sam" else [torch.add(g, a, alpha=hp.params["gam_alpha"] * rho)
                                                       for g, a in zip(grads_T, adv_T)]
        elif name == "smoo":
            mu_T, s_T = scratch["mu"], scratch["s"]
            shift_T = _ascent([g - m - s for g, m, s in zip(grads_T, mu_T, s_T)], hp.params["sam_rho"], 1e-7)
            stacks["mu"] = [m + (e - s) for m, e, s in zip(mu_T, shift_T, s_T)]
            adv_T = self._grads_at(stacks, shared, shift_T, x, y, mask, count, drops)
            direction_T = [a + hp.params["smoo_lambda"] * (p - anc) for a, p, anc in zip(adv_T, params_T, scratch["anchor"])]
        elif name == "prox":
            direction_T = [g + hp.params["prox_mu"] * (p - a) for g, p, a in zip(grads_T, params_T, scratch["anchor"])]
        else:
            direction_T = list(grads_T)
        if "correction" in scratch:  # SCAFFOLD, FedGAM-CV: c - c_k
            direction_T = [d + c for d, c in zip(direction_T, scratch["correction"])]
        return direction_T

    def _grads_at(self, stacks, shared, shift_T, x, y, mask, count, drops):
        """Gradients at w + shift (SAM's extra pass, with the step's dropout masks)."""
        shifted_T = [p + e for p, e in zip(stacks["params"], shift_T)]
        return self._gradients(shifted_T, stacks, shared, x, y, mask, count, drops)[0]  # statistics discarded
