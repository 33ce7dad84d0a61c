"""FedProx's local rule: the gradient of the task's loss plus mu (w - w_global)."""

from __future__ import annotations

import torch

from ...params import at_least_zero
from ...registry import add_local
from .base import LocalRule, param_views


class Prox(LocalRule):
    """FedProx: the gradient of CE + mu/2 ||w - w_global||^2. The returned loss is the CE alone."""

    name = "prox"
    per_step = ("anchor",)
    doc = __doc__
    params = {"prox_mu": 0.1}
    param_docs = {"prox_mu": "FedProx proximal weight mu."}

    @classmethod
    def check_params(cls, params: dict) -> list[str]:
        return at_least_zero(params, "prox_mu")

    def begin(self, model, ctx) -> None:
        ctx.scratch["anchor"] = param_views(ctx.layout, ctx.global_P)

    def direction(self, step):
        mu = step.hp.params["prox_mu"]
        # one torch._foreach_* op a line over the tensors (one launch a list on a GPU), the same
        # arithmetic as a loop of torch.add(g, w - a, alpha=mu)
        return torch._foreach_add(list(step.grads), torch._foreach_sub(list(step.params), list(step.scratch["anchor"])),
                                  alpha=mu)


add_local(Prox)
