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

Models with BatchNorm (or any buffer) are refused: padded samples would enter the batch
statistics.

The result equals the sequential path to float32 rounding, not always bit for bit (the batched
kernels may sum in another order); tests/test_parallel_clients.py states the tolerance. The
bits can depend on the group a client trains in, so groups are cut without regard to the world
size (``fedddp.sampling.assign_groups``).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from ..errors import ConfigError
from ..flat import FlatLayout
from . import ClientContext, full_batch_gradient, planned_steps, start_gradient
from .batched_optim import OPTIMIZERS, StackedOptimizer, _per_client
from .optim import lr_at

RULES = ("plain", "prox", "scaffold", "moon", "sam", "gam", "gam_cv", "smoo")
BATCH_NORM_MODELS = ("resnet18",)


def check(cfg) -> list[str]:
    """Configuration errors of run.parallel_clients: each names what is not batched and the fix."""
    size = cfg.run.parallel_clients
    if size < 1:
        return [f"run.parallel_clients: must be >= 1 (1: one client after another), got {size}"]
    if size == 1:
        return []
    from ..algorithms import resolve  # late: algorithms imports the strategy registry
    try:
        local = resolve(cfg)[0]
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
    if cfg.model.name in BATCH_NORM_MODELS:
        errors.append(f"run.parallel_clients: model.name = {cfg.model.name} has BatchNorm, whose batch "
                      f"statistics padded samples would enter{fix}")
    return errors


class _Schedule:
    """One client's batches and learning rates, drawn exactly as ``train_client`` draws them."""

    def __init__(self, cid, data, tc, augment: bool, round_idx: int, seed: int, work: int, device):
        self.cid, self.data, self.tc, self.augment = cid, data, tc, augment
        n = len(data)
        self.batch_size = n if tc.batch_size <= 0 else min(tc.batch_size, n)
        self.per_epoch = -(-n // self.batch_size)
        self.steps = planned_steps(n, tc, work)
        self.round_idx, self.epochs_before = round_idx, (round_idx - 1) * tc.local_epochs
        self.gen = torch.Generator().manual_seed(seed)
        self.device, self.order = device, None

    def positions(self, step: int) -> torch.Tensor:
        """This step's sample indices (on the CPU), as ``train_client`` draws them."""
        pos = step % self.per_epoch
        if pos == 0:
            self.order = torch.randperm(len(self.data), generator=self.gen)
        return self.order[pos * self.batch_size:(pos + 1) * self.batch_size]

    def augmented_batch(self, step: int):
        """This step's batch, augmented by draws that follow the step's permutation."""
        from ..data.vision import augment_batch
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


class BatchedTrainer:
    """Trains groups of clients side by side; one per run (it holds the model's functional form)."""

    def __init__(self, model, layout: FlatLayout, cfg, rule, needs: frozenset, task):
        self.model, self.layout, self.cfg, self.rule, self.needs, self.task = model, layout, cfg, rule, needs, task
        if any(not e.is_param for e in layout.entries) or any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                                                              for m in model.modules()):
            # the name check of ``check`` cannot see a model's modules (BatchNorm in any model)
            raise ConfigError(f"run.parallel_clients: model.name = {cfg.model.name} has buffers (BatchNorm "
                              "statistics), which are not batched; set run.parallel_clients=1")
        self.param_entries = [e for e in layout.entries if e.is_param]
        self.names = [e.name for e in self.param_entries]

        def loss(params_T, x, y, mask, count):
            output = functional_call(model, dict(zip(self.names, params_T)), (x,))
            return (task.loss(output, y, reduction="none") * mask).sum() / count

        # per client: (gradients of the loss, the loss) at its own parameters and batch
        self._plain = vmap(grad_and_value(loss))
        self._moon = self._moon_grad_and_loss(model, task, cfg.algorithm) if rule.name == "moon" else None

    def _moon_grad_and_loss(self, model, task, hp):
        """MOON's loss per client (rules.Moon): the data loss plus mu times the contrastive
        cross-entropy of [cos(z, z_glob), cos(z, z_prev)] / tau, the latter only for clients with
        a previous model (``has_prev`` 1); (gradients, (loss, data loss)) per client."""
        represent = _Represent(model)

        def at(params_T, x):
            return functional_call(represent, {"net." + n: p for n, p in zip(self.names, params_T)}, (x,))

        def loss(params_T, x, y, mask, count, global_T, prev_T, has_prev):
            z, output = at(params_T, x)
            data_loss = (task.loss(output, y, reduction="none") * mask).sum() / count
            z_glob, z_prev = at(global_T, x)[0].detach(), at(prev_T, x)[0].detach()
            sims = torch.stack([F.cosine_similarity(z, z_glob, dim=1),
                                F.cosine_similarity(z, z_prev, dim=1)], dim=1) / hp.moon_tau
            labels = torch.zeros(sims.shape[0], dtype=torch.long, device=sims.device)
            contrast = (F.cross_entropy(sims, labels, reduction="none") * mask).sum() / count
            return data_loss + has_prev * (hp.moon_mu * contrast), data_loss

        return vmap(grad_and_value(loss, has_aux=True), in_dims=(0, 0, 0, 0, 0, None, 0, 0))

    def _gradients(self, params_T, stacks, shared, x, y, mask, count):
        """Per client: the gradients of its loss at its ``params_T`` on its batch, and its data
        loss (MOON's without the contrastive term, as rules.Moon returns it)."""
        if self._moon is None:
            return self._plain(params_T, x, y, mask, count)
        grads_T, (_, data_loss) = self._moon(params_T, x, y, mask, count, shared["global"], stacks["prev"],
                                             stacks["has_prev"][0])
        return grads_T, data_loss

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

        # rule hooks per client, as train_client calls them (model holds global_P)
        layout.unflatten_into(global_P, self.model)
        for (ctx, data, seed, work, out) in group:
            if rule.needs_start_gradient(hp):
                ctx.scratch["start_grad_P"] = start_gradient(self.model, data, layout, tc.batch_size, ctx.task)
            if rule.name != "moon":  # MOON's begin makes frozen models; here its stacks below
                rule.begin(self.model, ctx)
        # Per-client tensors live in ``stacks`` ([L, ...] over the L clients still stepping, in
        # the order of ``live``); one every client shares (FedProx's anchor: the global model)
        # stays in ``shared`` and broadcasts.
        stacks, shared = {}, {}
        for key in ("anchor", "correction", "mu", "s"):
            if key in ctx0.scratch:
                views_BT = [ctx.scratch[key] for ctx, *_ in group]
                if all(v.data_ptr() == w.data_ptr() for views_T in views_BT for v, w in zip(views_T, views_BT[0])):
                    shared[key] = views_BT[0]
                else:
                    stacks[key] = [torch.stack(views_B) for views_B in zip(*views_BT)]
        stacks["params"] = [global_P[e.offset:e.offset + e.numel].view(e.shape).expand((B,) + e.shape).clone()
                            for e in self.param_entries]
        if rule.name == "moon":
            # the global model (shared) and each client's previous one (its own, else the global:
            # has_prev 0 leaves it out of the loss)
            shared["global"] = [global_P[e.offset:e.offset + e.numel].view(e.shape) for e in self.param_entries]
            prev_BP = torch.stack([ctx.state["prev_P"].to(device) if "prev_P" in ctx.state else global_P
                                   for ctx, *_ in group])
            stacks["prev"] = [prev_BP[:, e.offset:e.offset + e.numel].reshape((B,) + e.shape)
                              for e in self.param_entries]
            stacks["has_prev"] = [torch.tensor([float("prev_P" in ctx.state) for ctx, *_ in group], device=device)]
        optimizer = StackedOptimizer(tc, stacks, [s.lr(0) for s in schedules])
        loss_sum_B = torch.zeros(B, dtype=torch.float64, device=device)
        lr_sum_B = [0.0] * B

        live = list(range(B))
        for step in range(max(steps_B)):
            for j, b in enumerate(live):  # a client's own epoch boundary (train_client's epoch_end)
                if step % schedules[b].per_epoch == 0 and step > 0:
                    optimizer.epoch_start(b, [p[j] for p in stacks["params"]])
            x, y, mask, count, lr_L = self._batches([schedules[b] for b in live], step, device, group_x, group_y,
                                                    [offsets_B[b] for b in live])
            for b, lr in zip(live, lr_L):
                lr_sum_B[b] += lr
            grads_T, loss_L = self._gradients(stacks["params"], stacks, shared, x, y, mask, count)
            loss_sum_B[live] += loss_L.detach().double()
            direction_T = self._direction(stacks, shared, grads_T, x, y, mask, count, hp)
            done = [j for j, b in enumerate(live) if steps_B[b] == step + 1]
            if done and "last_grad_KP" in needs:
                for j, last_P in zip(done, self._flat_BP(direction_T, done)):
                    group[live[j]][4]["last_grad_P"].copy_(last_P)
            optimizer.step(stacks, direction_T, lr_L, step + 1, live)
            if done:
                # a client that has taken its steps leaves the stacks with its parameters and
                # state as they are (never stepped again, not even with a zero gradient)
                for j, params_P in zip(done, self._flat_BP(stacks["params"], done)):
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
                from ..metrics.effective_rank import effective_ranks_L
                out["eff_rank_L"] = effective_ranks_L(self.model, layout, hp.feder_unfold)
            out["train_time"] = seconds

    @staticmethod
    def _batches(schedules: list[_Schedule], step: int, device, group_x, group_y, offsets: list[int]):
        """This step's batches of the L clients, padded to the largest: x [L, S, ...], y [L, S],
        mask [L, S] (1 on a client's own samples), count [L] (its batch size), and the rates.
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
        else:
            positions = [s.positions(step) + offset for s, offset in zip(schedules, offsets)]
            width = max(len(p) for p in positions)
            index = torch.zeros(len(positions), width, dtype=torch.long)
            mask = torch.zeros(len(positions), width)
            for j, p in enumerate(positions):
                index[j, :len(p)], mask[j, :len(p)] = p, 1.0
            index, mask = index.to(device), mask.to(device)
            x, y = group_x[index], group_y[index]
        return x, y, mask, mask.sum(1), [s.lr(step) for s in schedules]

    def _flat_BP(self, stacks_T, rows: list[int]) -> torch.Tensor:
        """[len(rows), P] flat vectors of the given rows of per-tensor stacks: parameters in layout
        order, zeros for buffers (the models batched here have none)."""
        index = torch.tensor(rows, dtype=torch.long, device=stacks_T[0].device)
        flat_BP = torch.zeros(len(rows), self.layout.numel, device=stacks_T[0].device)
        for e, t in zip(self.param_entries, stacks_T):
            flat_BP[:, e.offset:e.offset + e.numel] = t.index_select(0, index).reshape(len(rows), -1)
        return flat_BP

    def _direction(self, stacks, shared, grads_T, x, y, mask, count, hp):
        """The step direction of the local rule per client (rules.py has the sequential forms);
        FedSMOO's dual mu is updated in ``stacks`` on the way."""
        name, scratch = self.rule.name, shared | stacks
        params_T = stacks["params"]
        if name in ("sam", "gam", "gam_cv"):
            rho = hp.sam_rho if name == "sam" else hp.gam_rho
            shift_T = _ascent(grads_T, rho, 1e-12)
            adv_T = self._grads_at(stacks, shared, shift_T, x, y, mask, count)
            direction_T = adv_T if name == "sam" else [torch.add(g, a, alpha=hp.gam_alpha * rho)
                                                       for g, a in zip(grads_T, adv_T)]
        elif name == "smoo":
            mu_T, s_T = scratch["mu"], scratch["s"]
            shift_T = _ascent([g - m - s for g, m, s in zip(grads_T, mu_T, s_T)], hp.sam_rho, 1e-7)
            stacks["mu"] = [m + (e - s) for m, e, s in zip(mu_T, shift_T, s_T)]
            adv_T = self._grads_at(stacks, shared, shift_T, x, y, mask, count)
            direction_T = [a + hp.smoo_lambda * (p - anc) for a, p, anc in zip(adv_T, params_T, scratch["anchor"])]
        elif name == "prox":
            direction_T = [g + hp.prox_mu * (p - a) for g, p, a in zip(grads_T, params_T, scratch["anchor"])]
        else:
            direction_T = list(grads_T)
        if "correction" in scratch:  # SCAFFOLD, FedGAM-CV: c - c_k
            direction_T = [d + c for d, c in zip(direction_T, scratch["correction"])]
        return direction_T

    def _grads_at(self, stacks, shared, shift_T, x, y, mask, count):
        """Gradients at w + shift (SAM's extra pass)."""
        shifted_T = [p + e for p, e in zip(stacks["params"], shift_T)]
        return self._gradients(shifted_T, stacks, shared, x, y, mask, count)[0]
