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
  num_sampled      float32 []      K as configured (fixed-size sampling) or the expected cohort
                                   q N (Poisson), whatever the number of reports    (DP-FedAvg)
  sampling_rate    float64 []      q: K / N, or run.participation                   (DP-FedAvg)
  poisson          bool    []      run.sampling is poisson                          (DP-FedAvg)
  noise_seed       int64   []      run.seed, for the server's noise                 (DP-FedAvg)
  aggregation_block int64  []      run.aggregation_block: columns per block; sums over the whole
                                   vector run per block, then over blocks in block order
                                   (Span.total; absent: one block)            (CGW, DP-FedAvg)

``state`` is a dict of tensors, checkpointed; ``init_state(global_P, hp)`` makes the round-1
state. With run.aggregation = gather (the default) rank 0 holds it and runs the rule, and the
client-visible entries (``client_visible``, e.g. SCAFFOLD's c) are broadcast to every rank; with
run.aggregation = sharded (fedddp/sharded.py) every rank holds the state: a [P] entry clients do
not see as its own range only (checkpointed one file per rank), a client-visible one whole, and
the scalars, the same on every rank. ``hp`` is the run's ``AlgorithmConfig``; a rule's own hyperparameters
are ``hp.params`` (``[algorithm.params]``), declared with their defaults in ``params`` and
checked by ``check_params``. ``diagnostics`` is a dict of
tensors: scalars, which go to metrics.jsonl, and per-client rows named by their shape (``_K``,
``_KL``; rows in the stacks' client-id order), which go to clients.jsonl (fedddp.logs).

With run.aggregation = sharded a rule runs on every rank over that rank's range of whole blocks
of the flat vector: ``aggregate_span(global_P, stacks, state, hp, span)``, the same function of
each column's inputs, walked block by block, its sums over the whole vector per block and then
over every rank's blocks in block order (``Span``; docs/architecture.md, "The sharded server").
A rule without it runs gathered on rank 0.
"""

import importlib
import pkgutil

from .base import (ALWAYS, AggregateFn, SERVER_RULES, Span, Stacks, State, Strategy, block_width,  # noqa: F401
                   client_weights_K, column_block, gathered, get, min_agreeing, plugin_form, register, server_step,
                   weighted_mean_P)
from . import kernels  # noqa: F401

# the package's modules that hold no rule
_NOT_RULES = ("base", "kernels", "triton_kernels", "accounting")

# Registration of the built-in rules: each module registers itself on import.
from . import fedavg  # noqa: F401
from . import fedmom, fedcong, fedgma, cgw, feder  # noqa: F401
from . import scaffold, fednova, fedsmoo  # noqa: F401
from . import dpfedavg  # noqa: F401
from . import fedadam, fedyogi  # noqa: F401
from . import coordinatewise, krum  # noqa: F401

# Any other rule module of the package registers itself the same way: a new rule is its file.
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _NOT_RULES:
        importlib.import_module(f"{__name__}.{_module.name}")
