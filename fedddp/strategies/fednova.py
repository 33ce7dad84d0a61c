"""FedNova (Wang et al. 2020): normalised averaging by each client's number of local steps.

  a_k = [tau_k - rho (1 - rho^tau_k) / (1 - rho)] / (1 - rho)      (= tau_k when rho = 0)
  d_k = (w - w_k) / a_k
  w  <- w - eta (sum_k p_k a_k) sum_k p_k d_k        (eta = hp.server_lr, 1 in the paper)

eta scales FedNova's server step (tau_eff = sum_k p_k a_k times the normalised mean update) as a
server learning rate scales FedAvg's; it multiplies tau_eff in float64, exactly so at 1.

tau_k is the client's reported step count (``num_steps_K``); rho is the client SGD momentum
(train.momentum), passed by the round loop in ``stacks`` as the static scalar
``client_momentum`` (float32 0-d tensor). a_k is the momentum-SGD one of the FedNova paper:
config validation refuses optimizers and local rules it does not describe (Adam, FedProx's
proximal solver). With equal tau_k and rho = 0 this is FedAvg (up to float rounding).
Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import torch

from .base import Strategy, client_weights_K, gathered, register


def normalisers_K(num_steps_K: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """a_k for momentum-SGD local solvers."""
    tau_K = num_steps_K.to(torch.float64)
    rho = rho.to(torch.float64)
    return (tau_K - rho * (1 - rho ** tau_K) / (1 - rho)) / (1 - rho)


def _coefficients_K(global_P, stacks, hp):
    """(eta tau_eff p_k / a_k in the model's dtype, tau_eff)."""
    weights_K = client_weights_K(stacks, hp).to(torch.float64)
    a_K = normalisers_K(stacks["num_steps_K"], stacks["client_momentum"])
    tau_eff = (weights_K * a_K).sum()
    return (float(hp.server_lr) * tau_eff * weights_K / a_K).to(global_P.dtype), tau_eff


def aggregate_span(global_P, stacks, state, hp, span):
    """w - coef_k (w - w_k) summed over k per column, block by block over this rank's range."""
    coef_K, tau_eff = _coefficients_K(global_P, stacks, hp)
    params_KP, new_P = stacks["params_KP"], torch.empty_like(global_P)
    for b in span.blocks:
        new_P[b] = global_P[b] - coef_K @ (global_P[b] - params_KP[:, b])
    return new_P, state, {"tau_eff": tau_eff.float()}


aggregate = gathered(aggregate_span)  # one block: the whole vector in one product


def check_config(cfg, local: str, params: dict) -> list[str]:
    """a_k is the (momentum) SGD one: another optimizer or FedProx's proximal solver has its own."""
    errors = []
    if cfg.train.optimizer != "sgd":
        errors.append(f"train.optimizer: fednova normalises by the (momentum) SGD step count; "
                      f"{cfg.train.optimizer} has no such a_k here (use sgd)")
    if local == "prox":
        errors.append(f"algorithm.local: algorithm.local = {local} with the fednova server rule (algorithm.name = "
                      f"{cfg.algorithm.name}): FedNova's a_k for FedProx's proximal solver differs from the SGD "
                      "one implemented here; use another local rule")
    if not cfg.train.momentum < 1:
        errors.append(f"train.momentum: fednova needs momentum < 1, got {cfg.train.momentum}")
    return errors


FEDNOVA = register(Strategy("fednova", aggregate, needs=frozenset({"num_steps_K", "client_momentum"}),
                            doc=__doc__, takes_server_lr=True, aggregate_span=aggregate_span,
                            check_config=check_config))
