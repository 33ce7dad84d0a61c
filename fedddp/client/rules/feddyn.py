"""FedDyn's local rule (Acar et al. 2021, Alg. 1), the client side: client k minimises

  L_k(w) - <grad_k, w> + (alpha/2) ||w - w_server||^2

so its step direction is g - grad_k + alpha (w - w_server), and after training

  grad_k <- grad_k - alpha (w_k - w_server)

(the gradient of L_k at w_k when the local problem is solved exactly). grad_k (``dyn_grad_P``,
zero at first, zero on buffers) is the client's state. alpha = 0 is the plain rule. The server
side is the ``feddyn`` server rule (fedddp/strategies/feddyn.py).
"""

from __future__ import annotations

import torch

from ...params import at_least_zero
from ...registry import add_local
from .base import LocalRule, param_views


class FedDyn(LocalRule):
    """FedDyn's dynamic regulariser: the direction g - grad_k + alpha (w - w_server)."""

    name = "feddyn"
    client_state = ("dyn_grad_P",)
    per_step = ("anchor", "linear")
    doc = __doc__
    params = {"feddyn_alpha": 0.01}
    param_docs = {"feddyn_alpha": "FedDyn regularisation alpha (the server rule's, shared)."}

    @classmethod
    def check_params(cls, params: dict) -> list[str]:
        return at_least_zero(params, "feddyn_alpha")

    def begin(self, model, ctx) -> None:
        grad_k_P = ctx.state.get("dyn_grad_P")
        grad_k_P = torch.zeros_like(ctx.global_P) if grad_k_P is None else grad_k_P.to(ctx.global_P.device)
        ctx.scratch["dyn_grad_P"] = grad_k_P
        ctx.scratch["anchor"] = param_views(ctx.layout, ctx.global_P)
        ctx.scratch["linear"] = param_views(ctx.layout, grad_k_P)

    def direction(self, step):
        alpha = step.hp.params["feddyn_alpha"]
        pulled = torch._foreach_add(list(step.grads), torch._foreach_sub(list(step.params), list(step.scratch["anchor"])),
                                    alpha=alpha)
        return torch._foreach_sub(pulled, list(step.scratch["linear"]))

    def end(self, model, ctx, num_steps: int, lr: float, out: dict) -> None:
        w_k_P = out["params_P"]  # the trained model, flattened by train_client
        drift_P = (w_k_P - ctx.global_P) * ctx.layout.param_mask_P(w_k_P.device)
        ctx.state["dyn_grad_P"] = ctx.scratch["dyn_grad_P"] - ctx.hp.params["feddyn_alpha"] * drift_P


add_local(FedDyn)
