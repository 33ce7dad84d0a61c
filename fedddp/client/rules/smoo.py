"""FedSMOO's local rule (Sun et al. 2023): SAM with dual variables and a drift correction."""

from __future__ import annotations

import torch

from ...params import at_least_zero
from ...registry import add_local
from .base import LocalRule, ascent, param_views
from .sam import Sam


class Smoo(LocalRule):
    """FedSMOO (Sun et al. 2023), after the authors' FL-Simulator: per minibatch, with g = g(w),
    g' = g - mu_k - s; e = rho g' / (||g'|| + 1e-7); mu_k <- mu_k + e - s; step along
    g(w + e) + lambda (w - w_global + h_k). After training h_k <- h_k + (w_k - w_global). mu_k and
    h_k are the client's state (zero at first), s the server's broadcast perturbation correction.
    The reference code's gradient clipping (norm 10) is left out, as for every other rule but clip."""

    name = "smoo"
    client_state = ("drift_P", "perturb_dual_P")
    reads_server = ("perturb_P",)
    reports = ("perturb_dual_KP",)
    per_step = ("mu", "s", "anchor")
    doc = __doc__
    eps = 1e-7
    params = {"sam_rho": 0.1, "smoo_lambda": 0.1}
    param_docs = {"sam_rho": Sam.param_docs["sam_rho"], "smoo_lambda": "FedSMOO dual penalty lambda."}

    @classmethod
    def check_params(cls, params: dict) -> list[str]:
        return at_least_zero(params, *cls.params)

    def begin(self, model, ctx) -> None:
        s_P = ctx.server_view["perturb_P"]
        state = {}
        for name in self.client_state:
            value = ctx.state.get(name)
            state[name] = torch.zeros_like(s_P) if value is None else value.to(s_P.device).clone()
        ctx.scratch.update(state)
        ctx.scratch["s"] = param_views(ctx.layout, s_P)
        ctx.scratch["mu"] = param_views(ctx.layout, state["perturb_dual_P"])
        ctx.scratch["anchor"] = param_views(ctx.layout, ctx.global_P - state["drift_P"])

    def direction(self, step):
        mu, s = step.scratch["mu"], step.scratch["s"]
        shift = ascent(step, [g - m - s_ for g, m, s_ in zip(step.grads, mu, s)], step.hp.params["sam_rho"], self.eps)
        step.scratch["mu"] = [m + (e - s_) for m, e, s_ in zip(mu, shift, s)]
        adv = step.grads_at(shift)
        lam = step.hp.params["smoo_lambda"]
        # lambda (w - w_global + h_k) = lambda (w - anchor), anchor = w_global - h_k
        return [a + lam * (w - anc) for a, w, anc in zip(adv, step.params, step.scratch["anchor"])]

    def end(self, model, ctx, num_steps: int, lr: float, out: dict) -> None:
        w_k_P = out["params_P"]  # the trained model, flattened by train_client
        mask_P = ctx.layout.param_mask_P(w_k_P.device)
        ctx.state["drift_P"] = ctx.scratch["drift_P"] + (w_k_P - ctx.global_P) * mask_P
        dual_P = ctx.scratch["perturb_dual_P"]  # its parameter part: the steps' last mu
        for view, mu in zip(param_views(ctx.layout, dual_P), ctx.scratch["mu"]):
            view.copy_(mu)
        ctx.state["perturb_dual_P"] = dual_P
        if "perturb_dual_P" in out:
            out["perturb_dual_P"].copy_(dual_P)


# the built-in local rules of this file, registered by name; RULES is the registry's dict (the
# rules in their own files, fedddp/client/clip.py, and plugins join it too)


add_local(Smoo)
