"""Server rules: pure functions over the stacked client reports, in a registry by name.

Legend: K sampled clients (rows ordered by client id), P flat parameters, L conv layers,
R runs of columns.

A rule is ``aggregate(global_P, stacks, state, hp) -> (new_global_P, new_state, diagnostics)``:
no torch.distributed, no logging, no ``.item()``, no Python loop over clients or parameters.
``stacks`` holds only the report fields the rule declares in ``needs`` (plus the ones every rule
gets), each a tensor whose name ends in its shape:

  params_KP        float32 [K, P]  each client's trained flat model (always)
  num_samples_K    float32 [K]     training samples of each client (always)
  train_loss_K     float32 [K]     mean local training loss (always)
  last_grad_KP     float32 [K, P]  minibatch gradient at the last local step     (FedGMA)
  full_grad_KP     float32 [K, P]  full-batch gradient of the mean loss at w_k   (CGW)
  full_loss_K      float32 [K]     full-batch mean loss at w_k, eval mode         (CGW)
  eff_rank_KL      float32 [K, L]  effective rank of each conv layer of w_k       (FedER)
  num_steps_K      float32 [K]     local optimizer steps taken                   (FedNova)
  control_delta_KP float32 [K, P]  c_k+ - c_k                          (SCAFFOLD, FedGAM-CV)
  perturb_dual_KP  float32 [K, P]  the client's new perturbation dual               (FedSMOO)

Static entries, fixed for the run and not client reports, added when a rule names them in needs:

  conv_runs_R3     int64   [R, 3]  runs of columns following one conv layer: start, stop, layer
                                   (-1 before the first conv layer)                   (FedER)
  param_mask_P     bool    [P]     True for parameters, False for buffers          (FedSMOO)
  num_clients      float32 []      N, all clients                       (SCAFFOLD, FedSMOO)
  client_momentum  float32 []      the clients' SGD momentum rho                    (FedNova)
  num_sampled      float32 []      K as configured, whatever the number of reports (DP-FedAvg)
  noise_seed       int64   []      run.seed, for the server's noise                 (DP-FedAvg)

``state`` is a dict of tensors owned by rank 0 and checkpointed; ``init_state(global_P, hp)``
makes the round-1 state. ``hp`` is the run's ``AlgorithmConfig``; a rule's own hyperparameters
are ``hp.params`` (``[algorithm.params]``), declared with their defaults in ``params`` and
checked by ``check_params``. ``diagnostics`` is a dict of
tensors: scalars, which go to metrics.jsonl, and per-client rows named by their shape (``_K``,
``_KL``; rows in the stacks' client-id order), which go to clients.jsonl (fedddp.logs).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

from . import kernels

Stacks = dict[str, torch.Tensor]
State = dict[str, torch.Tensor]
AggregateFn = Callable[[torch.Tensor, Stacks, State, object], tuple[torch.Tensor, State, dict]]

ALWAYS = frozenset({"params_KP", "num_samples_K", "train_loss_K"})


def _no_state(global_P: torch.Tensor, hp) -> State:
    return {}


@dataclass(frozen=True)
class Strategy:
    name: str
    aggregate: AggregateFn
    needs: frozenset[str] = frozenset()
    init_state: Callable[[torch.Tensor, object], State] = _no_state
    # state entries every rank needs before local training (e.g. SCAFFOLD's server control c):
    # broadcast from rank 0 with the global model each round.
    client_visible: tuple[str, ...] = ()
    # report fields needed under given hyper-parameters, when that depends on them (``needs``
    # is then the widest set, for documentation)
    needs_fn: Callable[[object], frozenset[str]] | None = None
    doc: str = ""
    # ledger(state, static_stacks, hp) -> diagnostics describing the state itself, written every
    # round, also one without reports that leaves the state as it was (DP-FedAvg's epsilon)
    ledger: Callable[[State, Stacks, object], dict] | None = None
    # the rule's own hyperparameters in [algorithm.params], name -> default (its type is the
    # type a given value must have; an int is taken for a float)
    params: dict = dataclasses.field(default_factory=dict)
    # check_params(params) -> one error line per bad value (params with defaults filled in)
    check_params: Callable[[dict], list[str]] | None = None
    # the rule reads hp.server_lr (it has a server step for it to scale); otherwise a value
    # other than 1 is a configuration error rather than silently ignored
    takes_server_lr: bool = False

    def needs_for(self, hp) -> frozenset[str]:
        return self.needs_fn(hp) if self.needs_fn is not None else self.needs


REGISTRY: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    assert strategy.name not in REGISTRY, f"server rule {strategy.name} registered twice"
    REGISTRY[strategy.name] = strategy
    return strategy


def plugin_form(strategy: Strategy, name: str) -> Strategy:
    """A plugin server rule, registered under its import path ``name``: its aggregate runs with
    every helper it calls (weighted_mean_P) in the torch-op form on every device, since only the
    built-in rules have fused kernels."""
    def aggregate(global_P, stacks, state, hp):
        with kernels.forced("torch"):
            return strategy.aggregate(global_P, stacks, state, hp)

    return dataclasses.replace(strategy, name=name, aggregate=aggregate)


def get(name: str) -> Strategy:
    return REGISTRY[name]


def client_weights_K(stacks: Stacks, hp) -> torch.Tensor:
    """p_k summing to 1: n_k / n (samples) or 1/K (uniform), as hp.weighting says; auto (a config
    not resolved by config.load) is the algorithm's own, fedddp.algorithms.weighting_of."""
    from ..algorithms import weighting_of  # late: fedddp.algorithms imports this package
    n_K = stacks["num_samples_K"].to(stacks["params_KP"].dtype)
    if weighting_of(hp) == "uniform":
        n_K = torch.ones_like(n_K)
    return n_K / n_K.sum()


def weighted_mean_P(weights_K: torch.Tensor, rows_KP: torch.Tensor) -> torch.Tensor:
    """sum_k w_k rows_k in one pass over [K, P]: the fused kernel, C on CPU or Triton on CUDA
    (whose client-order sums every other kernel of its form repeats, so a rule's neutral
    setting gives these bits), else one matrix-vector product."""
    lib = kernels.lib(rows_KP, rule="fedavg")
    if lib is None:
        return weights_K.to(rows_KP.dtype) @ rows_KP
    return kernels.mean(lib, rows_KP, weights_K)


def server_step(global_P: torch.Tensor, target_P: torch.Tensor, server_lr: float) -> torch.Tensor:
    """w + eta (target - w): the server's step of size eta = hp.server_lr along the rule's update
    target - w (FedOpt's server SGD, Reddi et al. 2021). eta = 1 returns target itself, so the
    default keeps every rule's bits; otherwise torch.lerp, as SCAFFOLD's eta_g always was."""
    server_lr = float(server_lr)
    return target_P if server_lr == 1.0 else torch.lerp(global_P, target_P, server_lr)


def column_block(num_rows: int, device: torch.device) -> int:
    """Columns per block for rules that need [K, block] temporaries: about 1 MiB of float32 per
    temporary on CPU (fits in L2), 256 MiB on an accelerator (few kernel launches)."""
    budget = 1 << 18 if device.type == "cpu" else 1 << 26
    return max(256, budget // max(num_rows, 1))


def min_agreeing(fraction: float, num_clients: int) -> int:
    """Smallest integer count >= fraction * K, with a 1e-9 slack: 0.28 * 25 is 7.000000000000001."""
    return max(0, math.ceil(fraction * num_clients - 1e-9))


# Registration of the built-in rules: each module registers itself on import.
from . import fedavg  # noqa: E402,F401
from . import fedmom, fedcong, fedgma, cgw, feder  # noqa: E402,F401
from . import scaffold, fednova, fedsmoo  # noqa: E402,F401
from . import dpfedavg  # noqa: E402,F401
