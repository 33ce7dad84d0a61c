"""Local rules: how a client turns a minibatch into its step direction. The base class and its
helpers are in ``base.py``, each family of rules in its own module, which registers it
(registry.add_local).

Legend: P flat elements (the model's FlatLayout: parameters, then buffers); L clients stepping
side by side.

A rule is written once for both ways fedddp trains clients: one after another (``train_client``,
one client's tensors, shaped like the parameters) and side by side (``batched.BatchedTrainer``,
the tensors of L clients stacked on a first dimension). Its parts, each called by both:
  begin(model, ctx)                  once per client, before its first step: take what the steps
                                     need from ctx.global_P, ctx.server_view and ctx.state into
                                     ctx.scratch (the entries the steps read are named in
                                     ``per_step``)
  loss(net, x, y, hp) -> (objective, data loss)
                                     the minibatch objective whose gradient g is, and the data
                                     loss reported (default: the task's loss, both); ``net`` is
                                     the client's model (side by side, under vmap: one client's)
  direction(step) -> tensors         each step: the direction the optimizer steps along, from g
                                     (step.grads), w (step.params), the rule's scratch entries
                                     (step.scratch) and the hyperparameters (step.hp); plain
                                     broadcasting works for one client's tensors and for stacks,
                                     with per-client scalars through step.norm and step.per_client,
                                     and extra passes through step.grads_at (default: g)
  end(model, ctx, num_steps, lr, out) once per client, after its last step, ``model`` holding the
                                     trained parameters: update ctx.state and write the report
                                     fields the rule produces into ``out`` (views into the gather
                                     buffer, keys as in fedddp.report.VECTOR_FIELDS;
                                     out["params_P"] already holds the trained model); ``lr`` is the
                                     mean learning rate of the steps taken
Rules hold no state across clients: everything persistent lives in ctx.state, which the round
loop keeps on the client's owner rank (fedddp.client.state), lends for the round to the rank that
trains the client, and checkpoints. A direction may replace a scratch entry (FedSMOO's dual):
``step.scratch[name] = new``, and the client's ctx.scratch has it at ``end``.

A rule written before ``direction`` existed overrides ``gradient(model, x, y, ctx)`` (fill each
parameter's .grad for one client): it trains one after another only (``one_client_only``), and
side by side is refused with a line naming what to write instead.

The rules of seed 002's FedGAM paper and its baselines (formulas: docs/algorithms.md):
  plain     g
  prox      g + mu (w - w_global)                                         FedProx
  scaffold  g + c - c_k; c_k+ = c_k - c + (w_global - w_k) / (tau lr)     SCAFFOLD option II
            (option I: c_k+ = full local gradient at w_global)
  moon      CE + mu CE([cos(z, z_glob), cos(z, z_prev)] / tau, 0)         MOON
  sam       g(w + rho g / ||g||)                                          FedSAM
  gam       g(w) + alpha rho g(w + rho g / ||g||)                         FedGAM, seed 002 eq. 19
  gam_cv    gam direction + c - c_k, c_k as SCAFFOLD                      FedGAM-CV, eqs. 20-21
  smoo      SAM with duals (mu_k, s) + FedDyn-style drift correction      FedSMOO
and, in its own file, ``clip`` (fedddp/client/clip.py), FL-Simulator's clipped local step.
Extra forward-backward passes (SAM, GAM, SMOO) run at a perturbed point and restore the
parameters bit for bit afterwards; they do not update BatchNorm running statistics (only the
first pass at w does, as in the public SAM/GAM code).

The data loss is the task's (net.task.loss: cross-entropy for classification, MSE for
regression; fedddp.tasks), so the rules are written once for both; "CE" in the formulas stands
for it. MOON alone is classification-only (its projection head feeds a classifier; a regression
run with it is a configuration error), and its contrastive term is its own cross-entropy.
"""

import importlib
import pkgutil

from ...registry import LOCAL_RULES
from .base import (LocalRule, OneClient, OneNet, _represent, _shifted, ascent, backward,  # noqa: F401 (tests)
                   one_client_only, param_views, reads_trained_model, step_keys)
# Registration of the built-in rules: each module registers its own on import.
from .prox import Prox  # noqa: F401
from .sam import Gam, Sam  # noqa: F401
from .control import ControlVariates, GamCV, Scaffold  # noqa: F401
from .moon import Moon  # noqa: F401
from .smoo import Smoo  # noqa: F401

# Any other module of the package registers its rules the same way: a new rule is its file.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

# every local rule by name: the registry's dict (the rules in their own files, fedddp/client/clip.py,
# and plugins join it too)
RULES = LOCAL_RULES

__all__ = ["LocalRule", "OneClient", "OneNet", "ascent", "backward", "one_client_only", "param_views",
           "reads_trained_model", "step_keys", "Prox", "Gam", "Sam", "ControlVariates", "GamCV", "Scaffold",
           "Moon", "Smoo", "RULES", "get", "_represent", "_shifted"]


def get(name: str) -> LocalRule:
    return RULES[name]()
