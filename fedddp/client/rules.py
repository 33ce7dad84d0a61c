"""Local rules: how a client turns a minibatch into parameter gradients.

Legend: P flat elements (the model's FlatLayout: parameters, then buffers).

A rule has three hooks, called by ``train_client``:
  begin(model, ctx)                  once, before the first step (take what the rule needs from
                                     ctx.global_P, ctx.server_view, ctx.state; keep per-client
                                     working tensors in ctx.scratch)
  gradient(model, x, y, ctx) -> loss fill each parameter's .grad for this minibatch (the direction
                                     the optimizer steps along; .grad is None at the call, and a
                                     backward pass goes through ``backward``); return the
                                     minibatch's data loss (the task's loss at w, detached use only)
  end(model, ctx, num_steps, lr, out) once, after the last step: update ctx.state and write the
                                     report fields the rule produces into ``out`` (views into the
                                     gather buffer, keys as in fedddp.round.VECTOR_FIELDS;
                                     out["params_P"] already holds the trained model);
                                     ``lr`` is the mean learning rate of the steps taken
Rules hold no state across clients: everything persistent lives in ctx.state, which the round
loop keeps on the client's owner rank (fedddp.client.state), lends for the round to the rank that
trains the client, and checkpoints.

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
Extra forward-backward passes (SAM, GAM, SMOO) run at a perturbed point and restore the
parameters bit for bit afterwards; they do not update BatchNorm running statistics (only the
first pass at w does, as in the public SAM/GAM code).

The data loss is the task's (ctx.task.loss: cross-entropy for classification, MSE for
regression; fedddp.tasks), so the rules are written once for both; "CE" in the formulas stands
for it. MOON alone is classification-only (its projection head feeds a classifier; a regression
run with it is a configuration error), and its contrastive term is its own cross-entropy.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..params import at_least_zero, one_of, positive
from ..registry import LOCAL_RULES

# -- flat-vector helpers ------------------------------------------------------------------


def param_views(layout, vec_P: torch.Tensor) -> list[torch.Tensor]:
    """Views of a flat [P] vector shaped like the model's parameters, in ``parameters()`` order
    (the layout lists parameters first, in that order)."""
    return [vec_P[e.offset:e.offset + e.numel].view(e.shape) for e in layout.entries if e.is_param]


def _params(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def backward(loss: torch.Tensor, params) -> None:
    """loss.backward() into gradients that train_client unset (None) at the step's start, with
    the bits the gradients had when each step added its gradient to zeroed ones: autograd hands
    g over, and g + 0.0 is 0.0 + g (-0.0 becomes +0.0), in one foreach kernel instead of a zeroing
    and an addition per parameter."""
    loss.backward()
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_add_(grads, 0.0)


def _set_grads(params, grads) -> None:
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g.detach().clone()
        else:
            p.grad.copy_(g)


def _global_norm(tensors) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))


@contextmanager
def _shifted(model, params, shift):
    """The model at w + shift; w and every buffer restored bit for bit on exit."""
    saved = [p.detach().clone() for p in params]
    buffers = [b.detach().clone() for b in model.buffers()]
    with torch.no_grad():
        for p, s in zip(params, shift):
            p.add_(s)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
            for b, s in zip(model.buffers(), buffers):
                b.copy_(s)


def _grads_at(model, x, y, params, shift, loss_fn) -> tuple[torch.Tensor, ...]:
    """Minibatch gradient at w + shift (an extra pass: BatchNorm statistics untouched)."""
    with _shifted(model, params, shift):
        return torch.autograd.grad(loss_fn(model(x), y), params)


def _ascent(grads, rho: float, eps: float) -> list[torch.Tensor]:
    """SAM's e = rho g / ||g|| (global L2 norm over every parameter)."""
    scale = rho / (_global_norm(grads) + eps)
    return [g * scale for g in grads]


# -- rules ----------------------------------------------------------------------------------


class LocalRule:
    """How a client turns its minibatches into gradients: the plain rule (the task's loss,
    backward), and the base class of every other. Hooks: ``begin(model, ctx)`` once before the
    first step, ``gradient(model, x, y, ctx) -> loss`` each step (fill every parameter's .grad; the
    configured optimizer then steps), ``end(model, ctx, num_steps, lr, out)`` once after the last
    (update ``ctx.state``, write the report fields it produces into ``out``). A rule holds nothing
    across clients: what lasts lives in ``ctx.state`` (named in ``client_state``). docs/extending.md."""

    name = "plain"
    # persistent per-client state this rule keeps (names of tensors in ctx.state)
    client_state: tuple[str, ...] = ()
    # server state entries the rule reads from ctx.server_view (the server rule must keep and
    # broadcast them: Strategy.client_visible)
    reads_server: tuple[str, ...] = ()
    # report stacks the rule fills in its end hook (a server rule that needs one of these needs
    # a local rule that writes it)
    reports: tuple[str, ...] = ()
    doc = "Plain local SGD (or the configured optimizer) on the task's loss (cross-entropy or MSE)."
    # the rule's own hyperparameters in [algorithm.params] (read as ctx.hp.params[name]), name ->
    # default; a given value must have the default's type (an int is taken for a float)
    params: dict = {}
    # name -> one line for --help and the docs (fedddp.params)
    param_docs: dict = {}

    @classmethod
    def check_params(cls, params: dict) -> list[str]:
        """One error line per bad value in ``params`` (defaults filled in)."""
        return []

    def begin(self, model, ctx) -> None:
        pass

    def needs_start_gradient(self, hp) -> bool:
        """Whether train_client must put the client's full local gradient at the global model in
        ctx.scratch["start_grad_P"] before training (SCAFFOLD option I)."""
        return False

    def gradient(self, model, x, y, ctx):
        loss = ctx.task.loss(model(x), y)
        backward(loss, _params(model))
        return loss

    def end(self, model, ctx, num_steps: int, lr: float, out: dict) -> None:
        pass


class Prox(LocalRule):
    """FedProx: the gradient of CE + mu/2 ||w - w_global||^2. The returned loss is the CE alone."""

    name = "prox"
    doc = __doc__
    params = {"prox_mu": 0.1}
    param_docs = {"prox_mu": "FedProx proximal weight mu."}

    @classmethod
    def check_params(cls, params: dict) -> list[str]:
        return at_least_zero(params, "prox_mu")

    def begin(self, model, ctx) -> None:
        ctx.scratch["anchor"] = param_views(ctx.layout, ctx.global_P)

    def gradient(self, model, x, y, ctx):
        loss = super().gradient(model, x, y, ctx)
        mu = ctx.hp.params["prox_mu"]
        with torch.no_grad():
            for p, a in zip(_params(model), ctx.scratch["anchor"]):
                p.grad.add_(p - a, alpha=mu)
        return loss


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

    def begin(self, model, ctx) -> None:
        super().begin(model, ctx)
        self._begin_control(ctx)

    def gradient(self, model, x, y, ctx):
        # the rule this mixes into (next in the MRO) gives the direction; c - c_k is added to it
        loss = super().gradient(model, x, y, ctx)
        self._add_correction(_params(model), ctx)
        return loss

    def _begin_control(self, ctx) -> None:
        c_P = ctx.server_view["control_P"]
        c_k_P = ctx.state.get("control_P")
        c_k_P = torch.zeros_like(c_P) if c_k_P is None else c_k_P.to(c_P.device)
        ctx.scratch["c_P"], ctx.scratch["c_k_P"] = c_P, c_k_P
        ctx.scratch["correction"] = param_views(ctx.layout, c_P - c_k_P)

    def _add_correction(self, params, ctx) -> None:
        with torch.no_grad():
            for p, corr in zip(params, ctx.scratch["correction"]):
                p.grad.add_(corr)

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


class Moon(LocalRule):
    """MOON (Li et al. 2021): CE + mu * CE([cos(z, z_glob), cos(z, z_prev)] / tau, label 0),
    z the representation (projection head output if the model has one, else the features). The
    global and previous models are frozen copies in eval mode, as in MOON's code: BatchNorm
    normalises with their running statistics, which their forward passes leave untouched, and
    dropout is off. A client without a previous model (its first round) has no contrastive term."""

    name = "moon"
    client_state = ("prev_P",)
    doc = __doc__
    params = {"moon_mu": 1.0, "moon_tau": 0.5, "moon_proj_dim": 256}
    param_docs = {"moon_mu": "MOON contrastive weight mu.", "moon_tau": "MOON temperature tau.",
                  "moon_proj_dim": "MOON projection head output size: a 2-layer MLP (d -> d -> this) between "
                                   "the features and the classifier, as in MOON's code; 0: no head, the "
                                   "contrastive term reads the features."}

    @classmethod
    def check_params(cls, params: dict) -> list[str]:
        return at_least_zero(params, "moon_mu", "moon_proj_dim") + positive(params, "moon_tau")

    def begin(self, model, ctx) -> None:
        frozen = []
        sources = [ctx.global_P] + ([ctx.state["prev_P"]] if "prev_P" in ctx.state else [])
        for flat_P in sources:
            twin = copy.deepcopy(model)
            ctx.layout.unflatten_into(flat_P.to(ctx.global_P.device), twin)
            twin.requires_grad_(False)
            twin.eval()
            frozen.append(twin)
        ctx.scratch["frozen"] = frozen

    def gradient(self, model, x, y, ctx):
        z = _represent(model, x)
        loss = ctx.task.loss(model.head(z), y)
        total = loss
        if len(ctx.scratch["frozen"]) == 2:
            glob, prev = ctx.scratch["frozen"]
            with torch.no_grad():
                z_glob, z_prev = _represent(glob, x), _represent(prev, x)
            sims = torch.stack([F.cosine_similarity(z, z_glob, dim=1),
                                F.cosine_similarity(z, z_prev, dim=1)], dim=1) / ctx.hp.params["moon_tau"]
            labels = torch.zeros(len(y), dtype=torch.long, device=y.device)
            total = loss + ctx.hp.params["moon_mu"] * F.cross_entropy(sims, labels)
        backward(total, _params(model))
        return loss

    def end(self, model, ctx, num_steps: int, lr: float, out: dict) -> None:
        ctx.state["prev_P"] = ctx.layout.flatten(model)
        ctx.scratch.pop("frozen", None)


def _represent(model, x):
    represent = getattr(model, "represent", None)
    return represent(x) if represent is not None else model.features(x)


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

    def rho(self, ctx) -> float:
        return ctx.hp.params["sam_rho"]

    def gradient(self, model, x, y, ctx):
        params = _params(model)
        loss = ctx.task.loss(model(x), y)
        grads = torch.autograd.grad(loss, params)
        _set_grads(params, self.direction(model, x, y, ctx, params, grads))
        return loss.detach()

    def direction(self, model, x, y, ctx, params, grads):
        return _grads_at(model, x, y, params, _ascent(grads, self.rho(ctx), self.eps), ctx.task.loss)


class Gam(Sam):
    """FedGAM, seed 002 eq. 19 as printed (the 2-pass form):
    grad = g(w) + alpha rho g(w + rho g / ||g||). rho = 0 is plain SGD exactly. (The official GAM
    step of Zhang et al. 2023 uses 4 passes; it is not implemented here.)"""

    name = "gam"
    doc = __doc__
    params = {"gam_rho": 0.02, "gam_alpha": 0.2}
    param_docs = {"gam_rho": "FedGAM perturbation radius rho.", "gam_alpha": "FedGAM weight alpha of the "
                                                                             "gradient-norm term."}

    def rho(self, ctx) -> float:
        return ctx.hp.params["gam_rho"]

    def direction(self, model, x, y, ctx, params, grads):
        rho, alpha = ctx.hp.params["gam_rho"], ctx.hp.params["gam_alpha"]
        adv = _grads_at(model, x, y, params, _ascent(grads, rho, self.eps), ctx.task.loss)
        return [torch.add(g, a, alpha=alpha * rho) for g, a in zip(grads, adv)]


class GamCV(ControlVariates, Gam):
    """FedGAM-CV, seed 002 eqs. 20-21: the GAM direction of eq. 19 plus c - c_k; c_k updated as
    SCAFFOLD's option II (eq. 21, 1/(eta E) with E local steps). Round 1 equals FedGAM."""

    name = "gam_cv"
    doc = __doc__


class Smoo(LocalRule):
    """FedSMOO (Sun et al. 2023), after the authors' FL-Simulator: per minibatch, with g = g(w),
    g' = g - mu_k - s; e = rho g' / (||g'|| + 1e-7); mu_k <- mu_k + e - s; step along
    g(w + e) + lambda (w - w_global + h_k). After training h_k <- h_k + (w_k - w_global). mu_k and
    h_k are the client's state (zero at first), s the server's broadcast perturbation correction.
    The reference code's gradient clipping (norm 10) is left out, as for every other rule."""

    name = "smoo"
    client_state = ("drift_P", "perturb_dual_P")
    reads_server = ("perturb_P",)
    reports = ("perturb_dual_KP",)
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
        ctx.scratch["mu"] = param_views(ctx.layout, state["perturb_dual_P"])  # updated in place
        ctx.scratch["anchor"] = param_views(ctx.layout, ctx.global_P - state["drift_P"])

    def gradient(self, model, x, y, ctx):
        params = _params(model)
        loss = ctx.task.loss(model(x), y)
        grads = torch.autograd.grad(loss, params)
        mu, s = ctx.scratch["mu"], ctx.scratch["s"]
        corrected = [g - m - s_ for g, m, s_ in zip(grads, mu, s)]
        shift = _ascent(corrected, ctx.hp.params["sam_rho"], self.eps)
        with torch.no_grad():
            for m, e, s_ in zip(mu, shift, s):
                m.add_(e - s_)
        adv = _grads_at(model, x, y, params, shift, ctx.task.loss)
        lam = ctx.hp.params["smoo_lambda"]
        with torch.no_grad():
            # lambda (w - w_global + h_k) = lambda (w - anchor), anchor = w_global - h_k
            direction = [a + lam * (p - anc) for a, p, anc in zip(adv, params, ctx.scratch["anchor"])]
        _set_grads(params, direction)
        return loss.detach()

    def end(self, model, ctx, num_steps: int, lr: float, out: dict) -> None:
        w_k_P = out["params_P"]  # the trained model, flattened by train_client
        mask_P = ctx.layout.param_mask_P(w_k_P.device)
        ctx.state["drift_P"] = ctx.scratch["drift_P"] + (w_k_P - ctx.global_P) * mask_P
        ctx.state["perturb_dual_P"] = ctx.scratch["perturb_dual_P"]
        if "perturb_dual_P" in out:
            out["perturb_dual_P"].copy_(ctx.scratch["perturb_dual_P"])


# the built-in local rules, registered by name; RULES is the registry's dict (plugins join it too)
LOCAL_RULES.update({r.name: r for r in (LocalRule, Prox, Scaffold, Moon, Sam, Gam, GamCV, Smoo)})
RULES = LOCAL_RULES


def get(name: str) -> LocalRule:
    return RULES[name]()
