"""MOON's local rule (Li et al. 2021): the task's loss plus a contrastive term between the
representations of the client's model, the global one and the client's previous one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import models, tasks
from ...params import at_least_zero, positive
from ...registry import add_local
from .base import LocalRule


def _outside(net, parts) -> list[str]:
    """Names of the parameters and buffers of ``net`` that none of ``parts`` holds."""
    inside = {id(t) for part in parts for t in [*part.parameters(), *part.buffers()]}
    return [n for n, t in [*net.named_parameters(), *net.named_buffers()] if id(t) not in inside]


class Moon(LocalRule):
    """MOON (Li et al. 2021): CE + mu * CE([cos(z, z_glob), cos(z, z_prev)] / tau, label 0),
    z the representation (projection head output if the model has one, else the features). The
    global and previous models are frozen, in eval mode, as in MOON's code: BatchNorm
    normalises with their running statistics, which their forward passes leave untouched, and
    dropout is off. A client without a previous model (its first round) has no contrastive term."""

    name = "moon"
    client_state = ("prev_P",)
    per_step = ("has_prev",)
    doc = __doc__
    params = {"moon_mu": 1.0, "moon_tau": 0.5, "moon_proj_dim": 256}
    param_docs = {"moon_mu": "MOON contrastive weight mu.", "moon_tau": "MOON temperature tau.",
                  "moon_proj_dim": "MOON projection head output size: a 2-layer MLP (d -> d -> this) between "
                                   "the features and the classifier, as in MOON's code; 0: no head, the "
                                   "contrastive term reads the features."}

    @classmethod
    def check_params(cls, params: dict) -> list[str]:
        return at_least_zero(params, "moon_mu", "moon_proj_dim") + positive(params, "moon_tau")

    @classmethod
    def check_config(cls, cfg, server: str, params: dict) -> list[str]:
        if tasks.of_data(cfg.data.name) == "regression":  # known by name: said before any data is read
            return [f"algorithm.local: algorithm.local = moon with the {server} server rule (algorithm.name = "
                    f"{cfg.algorithm.name}): MOON is defined for classification; data.name = {cfg.data.name} "
                    "is a regression task (choose another algorithm.name or algorithm.local)"]
        return []

    @classmethod
    def check_model(cls, net, task: str, params: dict, model_name: str) -> list[str]:
        """A classifier run as head(features(x)), and a Linear head where the projection head goes."""
        errors, what = [], f"model.name = {model_name}"
        if task != "classification":
            # MOON's projection head sits between the features and a classifier, and its
            # contrastive term is part of a cross-entropy objective: neither exists for a regressor.
            errors.append(f"algorithm.local: MOON is defined for classification; the data are a {task} task "
                          "(choose another algorithm.name or algorithm.local)")
        missing = [a for a in ("features", "head") if not isinstance(getattr(net, a, None), nn.Module)]
        if missing:
            errors.append(f"model.name: MOON compares representations, so the model must be head(features(x)) "
                          f"with submodules .features and .head; {what} has no {' and no '.join(missing)} "
                          "(docs/extending.md, \"MOON\")")
        elif outside := _outside(net, (net.features, net.head)):
            errors.append(f"model.name: MOON runs the model as head(features(x)); {what} has tensors outside "
                          f".features and .head ({', '.join(outside[:3])}); move them into one of the two")
        elif params["moon_proj_dim"] > 0 and not isinstance(net.head, nn.Linear):
            errors.append(f"model.name: MOON's projection head (algorithm.params.moon_proj_dim = "
                          f"{params['moon_proj_dim']}) replaces the classifier .head, "
                          f"which must be a torch.nn.Linear; {what} has a {type(net.head).__name__} (or set "
                          "algorithm.params.moon_proj_dim = 0)")
        return errors

    @classmethod
    def adapt_model(cls, net, params: dict, num_classes: int):
        """head(features(x)) as models.Net (the contrastive term reads features, the loss
        head(...)), with the projection head of MOON's code when moon_proj_dim > 0."""
        if not isinstance(net, models.Net):
            net = models.Net(net.features, net.head)
        if params["moon_proj_dim"] > 0:
            net = models.add_projection_head(net, params["moon_proj_dim"], num_classes)
        return net

    def begin(self, model, ctx) -> None:
        prev_P = ctx.state.get("prev_P")
        # the models net.frozen runs (side by side, a client without a previous model has the
        # global one twice when others of its group have theirs, and has_prev 0 gates its term)
        ctx.scratch["frozen_P"] = [ctx.global_P] + ([prev_P.to(ctx.global_P.device)] if prev_P is not None else [])
        ctx.scratch["has_prev"] = 1.0 if prev_P is not None else 0.0

    def loss(self, net, x, y, hp):
        z, output = net.represent(x)
        loss = net.mean(lambda reduction: net.task.loss(output, y, reduction=reduction))
        if net.frozen_count < 2:  # no previous model (side by side: none in the group)
            return loss, loss
        z_glob, z_prev = net.frozen(x)
        sims = torch.stack([F.cosine_similarity(z, z_glob, dim=1),
                            F.cosine_similarity(z, z_prev, dim=1)], dim=1) / hp.params["moon_tau"]
        labels = torch.zeros(sims.shape[0], dtype=torch.long, device=sims.device)
        term = hp.params["moon_mu"] * net.mean(lambda reduction: F.cross_entropy(sims, labels, reduction=reduction))
        # has_prev: 1.0 (a number: every client here has its previous model), or side by side each
        # client's 1 or 0 (a client without one has the global model twice, its term gated off)
        has_prev = net.scratch["has_prev"]
        return loss + (term if isinstance(has_prev, float) else has_prev * term), loss

    def end(self, model, ctx, num_steps: int, lr: float, out: dict) -> None:
        ctx.state["prev_P"] = ctx.layout.flatten(model)
        ctx.scratch.pop("frozen", None)


add_local(Moon)
