"""Sharpness-aware local rules: FedSAM's step at the ascended point, FedGAM's gradient-norm term
(seed 002 eq. 19)."""

from __future__ import annotations

import torch

from ...params import at_least_zero
from ...registry import add_local
from .base import LocalRule, ascent


class Sam(LocalRule):
    """FedSAM: step along the gradient at w + rho g / (||g|| + 1e-12). rho = 0 is plain SGD."""

    name = "sam"
    doc = __doc__
    eps = 1e-12
    params = {"sam_rho": 0.1}
    param_docs = {"sam_rho": "FedSAM / FedSMOO perturbation radius rho."}

    @classmethod
    def check_params(cls, params: dict) -> list[str]:
        return at_least_zero(params, *cls.params)

    def rho(self, hp) -> float:
        return hp.params["sam_rho"]

    def direction(self, step):
        return step.grads_at(ascent(step, step.grads, self.rho(step.hp), self.eps))


class Gam(Sam):
    """FedGAM, seed 002 eq. 19 as printed (the 2-pass form):
    grad = g(w) + alpha rho g(w + rho g / ||g||). rho = 0 is plain SGD exactly. (The official GAM
    step of Zhang et al. 2023 uses 4 passes; it is not implemented here.)"""

    name = "gam"
    doc = __doc__
    params = {"gam_rho": 0.02, "gam_alpha": 0.2}
    param_docs = {"gam_rho": "FedGAM perturbation radius rho.", "gam_alpha": "FedGAM weight alpha of the "
                                                                             "gradient-norm term."}

    def rho(self, hp) -> float:
        return hp.params["gam_rho"]

    def direction(self, step):
        rho, alpha = step.hp.params["gam_rho"], step.hp.params["gam_alpha"]
        adv = step.grads_at(ascent(step, step.grads, rho, self.eps))
        return torch._foreach_add(list(step.grads), list(adv), alpha=alpha * rho)


add_local(Sam)
add_local(Gam)
