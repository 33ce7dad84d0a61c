"""FedAdam (Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2): Adam on the server,
with the clients' weighted mean update as its pseudo-gradient.

  delta = sum_k p_k (w_k - w)                       FedAvg's update (p_k as algorithm.weighting),
                                                    summed as written (mean_delta_P)
  m <- beta1 m + (1 - beta1) delta
  v <- beta2 v + (1 - beta2) delta^2
  w <- w + eta m / (sqrt(v) + tau)

As in the paper's algorithm, without Adam's bias correction (Flower's FedAdam divides eta by the
correction terms: its first rounds take larger steps). The rule's own parameters, in
[algorithm.params]: eta (the server's step size, 1e-2), beta1 (0.9), beta2 (0.99), tau (1e-3,
the paper's degree of adaptivity). algorithm.server_lr is not read (eta is the step size).
State: m_P, v_P (zeros at round 1), checkpointed with the run. Diagnostics: update_norm =
||w_new - w||. Legend: K sampled clients that reported, P flat parameters.
"""

from __future__ import annotations

import torch

from .base import Strategy, client_weights_K, register, weighted_mean_P


def init_state(global_P: torch.Tensor, hp) -> dict[str, torch.Tensor]:
    return {"m_P": torch.zeros_like(global_P), "v_P": torch.zeros_like(global_P)}


def mean_delta_P(weights_K, params_KP, global_P):
    """delta = sum_k p_k (w_k - w) as written, not (sum_k p_k w_k) - w: the mean's rounding
    (about eps |w|) is a pseudo-gradient where no client moved w, which Adam's division by
    sqrt(v) + tau scales into a step (0.19 at eta 1, tau 1e-7). Each w_k - w is exact for w_k
    within a factor 2 of w, 0 where a client left w alone. The differences go through the same
    fused mean (C, Triton or torch ops) as FedAvg's, at the cost of a [K, P] temporary."""
    return weighted_mean_P(weights_K, params_KP - global_P)


def adam_v(v_P, delta_P, p):
    """Adam's second moment: v <- beta2 v + (1 - beta2) delta^2."""
    return v_P * p["beta2"] + delta_P.square() * (1 - p["beta2"])


def _step(global_P, params_KP, state_m_P, state_v_P, weights_K, p, second_moment):
    """(step, m, v) over the given columns: Algorithm 2's server step after the moments."""
    delta_P = mean_delta_P(weights_K, params_KP, global_P)
    m_P = state_m_P * p["beta1"] + delta_P * (1 - p["beta1"])
    v_P = second_moment(state_v_P, delta_P, p)
    return m_P / (v_P.sqrt() + p["tau"]) * p["eta"], m_P, v_P


def adaptive(second_moment):
    """(aggregate, aggregate_span) of Reddi et al.'s Algorithm 2 with this second moment,
    ``second_moment(v_P, delta_P, params) -> new v_P``: FedAdam's (adam_v), FedYogi's and
    FedAdagrad's (fedyogi.py) differ in nothing else."""

    def aggregate(global_P, stacks, state, hp):
        step_P, m_P, v_P = _step(global_P, stacks["params_KP"], state["m_P"], state["v_P"],
                                 client_weights_K(stacks, hp), hp.params, second_moment)
        return global_P + step_P, {"m_P": m_P, "v_P": v_P}, {"update_norm": torch.linalg.vector_norm(step_P)}

    def aggregate_span(global_P, stacks, state, hp, span):
        """The same per column, block by block over this rank's range; update_norm from float64
        per-block sums of squares added in block order (Strategy.aggregate_span)."""
        weights_K, params_KP = client_weights_K(stacks, hp), stacks["params_KP"]
        new_P, m_P, v_P = (torch.empty_like(global_P) for _ in range(3))
        sq_rows = []
        for b in span.blocks:
            step_B, m_P[b], v_P[b] = _step(global_P[b], params_KP[:, b], state["m_P"][b], state["v_P"][b],
                                           weights_K, hp.params, second_moment)
            new_P[b] = global_P[b] + step_B
            sq_rows.append(step_B.double().square().sum())
        update_norm = span.total(sq_rows, 1)[0].sqrt().to(global_P.dtype)
        return new_P, {"m_P": m_P, "v_P": v_P}, {"update_norm": update_norm}

    return aggregate, aggregate_span


aggregate, aggregate_span = adaptive(adam_v)


def check_params(params: dict) -> list[str]:
    errors = [f"algorithm.params.{k}: must be in [0, 1), got {params[k]}" for k in ("beta1", "beta2")
              if k in params and not 0.0 <= params[k] < 1.0]
    errors += [f"algorithm.params.{k}: must be > 0, got {params[k]}" for k in ("eta", "tau") if not params[k] > 0]
    return errors


FEDADAM = register(Strategy("fedadam", aggregate, init_state=init_state, doc=__doc__, check_params=check_params,
                            params={"eta": 1e-2, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3},
                            param_docs={"eta": "FedAdam: the server's step size.",
                                        "beta1": "FedAdam: decay of the first moment m.",
                                        "beta2": "FedAdam: decay of the second moment v.",
                                        "tau": "FedAdam: degree of adaptivity (added to sqrt(v))."},
                            aggregate_span=aggregate_span))
