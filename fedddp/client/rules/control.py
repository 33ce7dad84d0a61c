"""Control variates on the client (SCAFFOLD, FedGAM-CV): c - c_k added to the step direction,
c_k updated after training and reported as control_delta_KP."""

from __future__ import annotations

import torch

from ...params import one_of
from ...registry import add_local
from .base import LocalRule, param_views
from .sam import Gam


def _not_plain_sgd(train) -> tuple[str, str] | None:
    """(the key, its words) of what makes ``train`` other than plain SGD; None for plain SGD."""
    if train.optimizer != "sgd":
        return "train.optimizer", f"train.optimizer = {train.optimizer}"
    if train.momentum != 0:
        return "train.momentum", f"train.momentum = {train.momentum}"
    return None


class ControlVariates:
    """SCAFFOLD's client side, shared by SCAFFOLD and FedGAM-CV: the step direction gets c - c_k;
    after tau steps at mean learning rate lr, option II (scaffold_control = II, FedGAM-CV's
    eq. 21) sets c_k+ = c_k - c + (w_global - w_k) / (tau lr), which holds for plain SGD only;
    option I (SCAFFOLD's scaffold_control = I) sets c_k+ = the client's
    full local gradient at w_global (fedddp.client.start_gradient), for any optimizer. Zero on
    buffers; the report carries c_k+ - c_k."""

    client_state = ("control_P",)
    reads_server = ("control_P",)
    reports = ("control_delta_KP",)
    per_step = ("correction",)

    def begin(self, model, ctx) -> None:
        super().begin(model, ctx)
        c_P = ctx.server_view["control_P"]
        c_k_P = ctx.state.get("control_P")
        c_k_P = torch.zeros_like(c_P) if c_k_P is None else c_k_P.to(c_P.device)
        ctx.scratch["c_P"], ctx.scratch["c_k_P"] = c_P, c_k_P
        ctx.scratch["correction"] = param_views(ctx.layout, c_P - c_k_P)

    def direction(self, step):
        # the rule this mixes into (next in the MRO) gives the direction; c - c_k is added to it
        return torch._foreach_add(list(super().direction(step)), list(step.scratch["correction"]))

    def end(self, model, ctx, num_steps: int, lr: float, out: dict) -> None:
        c_P, c_k_P = ctx.scratch["c_P"], ctx.scratch["c_k_P"]
        if "start_grad_P" in ctx.scratch:  # option I
            new_c_k_P = ctx.scratch["start_grad_P"]
        else:  # option II
            w_k_P = out["params_P"]  # the trained model, flattened by train_client
            drift_P = (ctx.global_P - w_k_P) * ctx.layout.param_mask_P(w_k_P.device)
            new_c_k_P = c_k_P - c_P + drift_P / (max(num_steps, 1) * lr)
        if "control_delta_P" in out:
            out["control_delta_P"].copy_(new_c_k_P - c_k_P)
        ctx.state["control_P"] = new_c_k_P


class Scaffold(ControlVariates, LocalRule):
    """SCAFFOLD (Karimireddy et al. 2020), option II (default) or option I control variates.
    Round 1 (c = c_k = 0) is plain local training."""

    name = "scaffold"
    doc = __doc__
    params = {"scaffold_control": "II"}
    param_docs = {"scaffold_control": "SCAFFOLD's client control update. II: c_k+ = c_k - c + (w - w_k) / "
                                      "(tau lr), exact only for plain SGD; I: c_k+ = the gradient of the "
                                      "client's mean loss at the global model w (one extra pass over its "
                                      "data), valid for any optimizer."}

    @classmethod
    def check_params(cls, params: dict) -> list[str]:
        return one_of(params, "scaffold_control", ("II", "I"))

    def needs_start_gradient(self, hp) -> bool:
        return hp.params["scaffold_control"] == "I"

    @classmethod
    def check_config(cls, cfg, server: str, params: dict) -> list[str]:
        """Option II reads the client's mean step direction off (w - w_k) / (tau lr): true for
        plain SGD only (momentum or Adam move w by something else)."""
        what = _not_plain_sgd(cfg.train)
        if what is None or params.get("scaffold_control", "II") != "II":
            return []
        return [f"algorithm.params.scaffold_control: option II's c_k+ = c_k - c + (w - w_k) / (tau lr) holds for "
                f"plain SGD only, not with {what[1]}; set algorithm.params.scaffold_control = I (c_k+ = the "
                "client's gradient at the global model, valid for any optimizer) or use plain SGD"]


class GamCV(ControlVariates, Gam):
    """FedGAM-CV, seed 002 eqs. 20-21: the GAM direction of eq. 19 plus c - c_k; c_k updated as
    SCAFFOLD's option II (eq. 21, 1/(eta E) with E local steps). Round 1 equals FedGAM."""

    name = "gam_cv"
    doc = __doc__

    @classmethod
    def check_config(cls, cfg, server: str, params: dict) -> list[str]:
        """Eq. 21 (FedGAM-CV's only option) reads the mean step direction off (w - w_k) / (tau lr):
        plain SGD only."""
        what = _not_plain_sgd(cfg.train)
        if what is None:
            return []
        return [f"{what[0]}: FedGAM-CV's c_k update (seed 002 eq. 21) holds for plain SGD only, not with "
                f"{what[1]}; use train.optimizer = sgd with train.momentum = 0, or algorithm.name = scaffold "
                "with algorithm.params.scaffold_control = I"]


add_local(Scaffold)
add_local(GamCV)
