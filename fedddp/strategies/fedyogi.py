"""FedYogi and FedAdagrad (Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2):
FedAdam's server step (fedadam.py: the same pseudo-gradient, first moment, step and range form)
with another second moment v.

  delta = sum_k p_k (w_k - w)                       summed as written (fedadam.mean_delta_P)
  m <- beta1 m + (1 - beta1) delta
  FedYogi:    v <- v - (1 - beta2) delta^2 sign(v - delta^2)
  FedAdagrad: v <- v + delta^2
  w <- w + eta m / (sqrt(v) + tau)

No bias correction, as in the paper and in Flower's FedYogi and FedAdagrad. v starts at 0, as in
Flower (the paper's v_{-1} >= tau^2 would make the first steps smaller, by at most a
factor 2). Defaults are FedAdam's, eta 1e-2, beta1 0.9, beta2 0.99, tau 1e-3: Flower's
FedYogi defaults too; Flower's FedAdagrad has no momentum (beta_1 = 0) and takes eta 0.1,
tau 1e-9 (algorithm.params.beta1=0 etc. give it). algorithm.server_lr is not read (eta is the
step size). State: m_P, v_P (zeros at round 1), checkpointed with the run. Diagnostics:
update_norm = ||w_new - w||. Legend: K sampled clients that reported, P flat parameters.
"""

from __future__ import annotations

import torch

from .base import Strategy, register
from .fedadam import adaptive, check_params, init_state


def yogi_v(v_P, delta_P, p):
    """Yogi's additive second moment: v moves toward delta^2 by (1 - beta2) delta^2 at most."""
    sq_P = delta_P.square()
    return v_P - sq_P * torch.sign(v_P - sq_P) * (1 - p["beta2"])


def adagrad_v(v_P, delta_P, p):
    """Adagrad's second moment: the sum of every round's delta^2."""
    return v_P + delta_P.square()


def _docs(rule: str, names) -> dict[str, str]:
    docs = {"eta": "the server's step size.", "beta1": "decay of the first moment m.",
            "beta2": "decay of the second moment v (Yogi's additive form).",
            "tau": "degree of adaptivity (added to sqrt(v))."}
    return {k: f"{rule}: {docs[k]}" for k in names}


def _rule(name: str, title: str, second_moment, params: dict) -> Strategy:
    aggregate, aggregate_span = adaptive(second_moment)
    return register(Strategy(name, aggregate, init_state=init_state, doc=__doc__, check_params=check_params,
                             params=params, param_docs=_docs(title, params), aggregate_span=aggregate_span))


FEDYOGI = _rule("fedyogi", "FedYogi", yogi_v, {"eta": 1e-2, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3})
FEDADAGRAD = _rule("fedadagrad", "FedAdagrad", adagrad_v, {"eta": 1e-2, "beta1": 0.9, "tau": 1e-3})
