"""Local rules: how a client turns a minibatch into its step direction.

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

from __future__ import annotations

import copy
import functools
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
    and an addition per parameter. For a rule that overrides ``gradient``; the others' directions
    get the same + 0.0 (``LocalRule.gradient``)."""
    loss.backward()
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_add_(grads, 0.0)


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


def _grads_at(model, x, y, params, shift, loss_fn) -> list[torch.Tensor]:
    """Minibatch gradient at w + shift (an extra pass: BatchNorm statistics untouched); zeros for
    a parameter the loss does not reach."""
    with _shifted(model, params, shift):
        grads = torch.autograd.grad(loss_fn(model(x), y), params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


def ascent(step, grads, rho: float, eps: float) -> list[torch.Tensor]:
    """SAM's e = rho g / (||g|| + eps), the L2 norm over every parameter of the client: one
    client's, or each client's of a stack (``step.norm``)."""
    scale = rho / (step.norm(grads) + eps)
    return [g * step.per_client(scale, g) for g in grads]


# -- one client's step: what loss and direction read, one after another ----------------------


class OneNet:
    """The client's model as ``LocalRule.loss`` reads it, one after another: the model itself at w
    in training mode. Side by side the same calls run under vmap (``batched._NetAt``)."""

    def __init__(self, model, ctx, scratch: dict):
        self.model, self.task, self.scratch, self._ctx = model, ctx.task, scratch, ctx
        self.frozen_count = len(ctx.scratch.get("frozen_P", ()))  # the models ``frozen`` runs

    def __call__(self, x):
        """The model's output at w."""
        return self.model(x)

    def represent(self, x):
        """(z, output): the representation at w (``represent``, else ``features``) and the head's
        output on it."""
        z = _represent(self.model, x)
        return z, self.model.head(z)

    def frozen(self, x) -> list[torch.Tensor]:
        """The representations of the models in ctx.scratch["frozen_P"] (the rule's begin puts
        them there), in eval mode and without gradient."""
        with torch.no_grad():
            return [_represent(twin, x) for twin in self._ctx.scratch.get("frozen", ())]

    @staticmethod
    def mean(loss_of):
        """The minibatch mean of a loss: ``loss_of(reduction)`` takes torch's ``reduction``."""
        return loss_of("mean")


class OneClient:
    """One client's step as ``LocalRule.direction`` reads it, one after another: w (``params``),
    g (``grads``), the rule's scratch entries and hp, shaped like the parameters. Side by side:
    ``batched._Step``, the same names over stacks."""

    def __init__(self, model, params, grads, x, y, ctx, scratch: dict):
        self.params, self.grads, self.scratch, self.hp = params, grads, scratch, ctx.hp
        self._at = (model, x, y, ctx.task.loss)

    def grads_at(self, shift) -> list[torch.Tensor]:
        """The minibatch gradient of the task's loss at w + shift (an extra pass)."""
        model, x, y, loss_fn = self._at
        with torch.enable_grad():
            return _grads_at(model, x, y, self.params, shift, loss_fn)

    @staticmethod
    def norm(tensors) -> torch.Tensor:
        """The client's L2 norm over all of ``tensors`` (0-dim)."""
        return _global_norm(tensors)

    @staticmethod
    def per_client(value, like):
        """A per-client value (a number or 0-dim tensor here; one per client side by side) shaped
        to broadcast over ``like``."""
        return value


def step_keys(rule) -> tuple[str, ...]:
    """The ctx.scratch entries a rule (or its class) reads in loss and direction: ``per_step`` of
    its class and of every class it mixes in (SCAFFOLD's correction beside another rule's)."""
    return _step_keys(rule if isinstance(rule, type) else type(rule))


@functools.cache
def _step_keys(cls: type) -> tuple[str, ...]:
    keys = []
    for klass in reversed(cls.__mro__):
        keys += [k for k in vars(klass).get("per_step", ()) if k not in keys]
    return tuple(keys)


def _frozen_twins(model, ctx) -> None:
    """ctx.scratch["frozen"]: eval-mode copies of the models in ctx.scratch["frozen_P"], made
    before the client's first forward pass (one after another; side by side they are stacks)."""
    if "frozen_P" not in ctx.scratch or "frozen" in ctx.scratch:
        return
    twins = []
    for flat_P in ctx.scratch["frozen_P"]:
        twin = copy.deepcopy(model)
        ctx.layout.unflatten_into(flat_P.to(ctx.global_P.device), twin)
        twin.requires_grad_(False)
        twin.eval()
        twins.append(twin)
    ctx.scratch["frozen"] = twins


def _represent(model, x):
    represent = getattr(model, "represent", None)
    return represent(x) if represent is not None else model.features(x)


# -- rules ----------------------------------------------------------------------------------


class LocalRule:
    """How a client turns its minibatches into step directions: the plain rule (the task's loss,
    its gradient), and the base class of every other. ``begin(model, ctx)`` once before the first
    step, ``loss(net, x, y, hp)`` and ``direction(step)`` each step, one client's tensors or
    stacks of them (the configured optimizer then steps), ``end(model, ctx, num_steps, lr, out)``
    once after the last (update ``ctx.state``, write the report fields it produces into ``out``).
    A rule holds nothing across clients: what lasts lives in ``ctx.state`` (named in
    ``client_state``). docs/extending.md."""

    name = "plain"
    # persistent per-client state this rule keeps (names of tensors in ctx.state)
    client_state: tuple[str, ...] = ()
    # server state entries the rule reads from ctx.server_view (the server rule must keep and
    # broadcast them: Strategy.client_visible)
    reads_server: tuple[str, ...] = ()
    # report stacks the rule fills in its end hook (a server rule that needs one of these needs
    # a local rule that writes it)
    reports: tuple[str, ...] = ()
    # ctx.scratch entries its loss and direction read (step.scratch, net.scratch), as its begin
    # hook leaves them: a tensor, a list of tensors (shaped like the parameters) or a number;
    # side by side stacked over the clients, or one for all when every client's is the same
    per_step: tuple[str, ...] = ()
    doc = "Plain local SGD (or the configured optimizer) on the task's loss (cross-entropy or MSE)."
    # the rule's own hyperparameters in [algorithm.params] (read as hp.params[name]), name ->
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

    def loss(self, net, x, y, hp):
        """(the minibatch objective to differentiate, the data loss to report); the task's loss."""
        output = net(x)
        loss = net.mean(lambda reduction: net.task.loss(output, y, reduction=reduction))
        return loss, loss

    def direction(self, step) -> list[torch.Tensor]:
        """The step direction, shaped like ``step.params``: here the gradient g."""
        return step.grads

    def gradient(self, model, x, y, ctx):
        """One client's step, one after another: ``loss``, its gradient, ``direction`` written into
        each parameter's .grad (None at the call) for train_client's optimizer; returns the data
        loss. The direction gets + 0.0, the bits of adding it to zeroed gradients (``backward``).
        A parameter the loss does not reach keeps no gradient (the optimizer leaves it)."""
        params = _params(model)
        scratch = {key: ctx.scratch[key] for key in step_keys(self)}
        _frozen_twins(model, ctx)
        objective, loss = self.loss(OneNet(model, ctx, scratch), x, y, ctx.hp)
        grads = torch.autograd.grad(objective, params, allow_unused=True)
        reached = [g is not None for g in grads]
        grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)]
        with torch.no_grad():
            direction = list(self.direction(OneClient(model, params, grads, x, y, ctx, scratch)))
            if all(d is g for d, g in zip(direction, grads)):  # autograd's own tensors: no copy
                torch._foreach_add_(direction, 0.0)
            else:  # new tensors: one a rule keeps must not become a .grad the optimizer may change
                direction = torch._foreach_add(direction, 0.0)
        ctx.scratch.update(scratch)  # the entries the direction replaced
        for p, d, used in zip(params, direction, reached):
            p.grad = d if used else None
        return loss.detach()

    def end(self, model, ctx, num_steps: int, lr: float, out: dict) -> None:
        pass


def reads_trained_model(rule) -> bool:
    """Whether a rule's ``end`` hook may read the trained model (MOON keeps it); the base hook
    reads nothing. (A plugin's hooks are wrapped by fedddp.checks; ``__wrapped__`` is its own.)"""
    end = getattr(rule.end, "__func__", rule.end)
    return getattr(end, "__wrapped__", end) is not LocalRule.end


def one_client_only(rule) -> bool:
    """Whether a rule (class) overrides ``gradient``, the one-client step: then it trains one after
    another only. (A plugin's hooks are wrapped by fedddp.checks; ``__wrapped__`` is its own.)"""
    gradient = rule.gradient
    return getattr(gradient, "__wrapped__", gradient) is not LocalRule.gradient


class Prox(LocalRule):
    """FedProx: the gradient of CE + mu/2 ||w - w_global||^2. The returned loss is the CE alone."""

    name = "prox"
    per_step = ("anchor",)
    doc = __doc__
    params = {"prox_mu": 0.1}
    param_docs = {"prox_mu": "FedProx proximal weight mu."}

    @classmethod
    def check_params(cls, params: dict) -> list[str]:
        return at_least_zero(params, "prox_mu")

    def begin(self, model, ctx) -> None:
        ctx.scratch["anchor"] = param_views(ctx.layout, ctx.global_P)

    def direction(self, step):
        mu = step.hp.params["prox_mu"]
        # one torch._foreach_* op a line over the tensors (one launch a list on a GPU), the same
        # arithmetic as a loop of torch.add(g, w - a, alpha=mu)
        return torch._foreach_add(list(step.grads), torch._foreach_sub(list(step.params), list(step.scratch["anchor"])),
                                  alpha=mu)


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


class Moon(LocalRule):
    """MOON (Li et al. 2021): CE + mu * CE([cos(z, z_glob), cos(z, z_prev)] / tau, label 0),
    z the representation (projection head output if the model has one, else the features). The
    global and previous models are frozen, in eval mode, as in MOON's code: BatchNorm
    normalises with their running statistics, which their forward passes leave untouched, and
    dropout is off. A client without a previous model (its first round) has no contrastive term."""

    name = "moon"
    client_state = ("prev_P",)
    per_step = ("has_prev",)
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
        prev_P = ctx.state.get("prev_P")
        # the models net.frozen runs (side by side, a client without a previous model has the
        # global one twice when others of its group have theirs, and has_prev 0 gates its term)
        ctx.scratch["frozen_P"] = [ctx.global_P] + ([prev_P.to(ctx.global_P.device)] if prev_P is not None else [])
        ctx.scratch["has_prev"] = 1.0 if prev_P is not None else 0.0

    def loss(self, net, x, y, hp):
        z, output = net.represent(x)
        loss = net.mean(lambda reduction: net.task.loss(output, y, reduction=reduction))
        if net.frozen_count < 2:  # no previous model (side by side: none in the group)
            return loss, loss
        z_glob, z_prev = net.frozen(x)
        sims = torch.stack([F.cosine_similarity(z, z_glob, dim=1),
                            F.cosine_similarity(z, z_prev, dim=1)], dim=1) / hp.params["moon_tau"]
        labels = torch.zeros(sims.shape[0], dtype=torch.long, device=sims.device)
        term = hp.params["moon_mu"] * net.mean(lambda reduction: F.cross_entropy(sims, labels, reduction=reduction))
        # has_prev: 1.0 (a number: every client here has its previous model), or side by side each
        # client's 1 or 0 (a client without one has the global model twice, its term gated off)
        has_prev = net.scratch["has_prev"]
        return loss + (term if isinstance(has_prev, float) else has_prev * term), loss

    def end(self, model, ctx, num_steps: int, lr: float, out: dict) -> None:
        ctx.state["prev_P"] = ctx.layout.flatten(model)
        ctx.scratch.pop("frozen", None)


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
LOCAL_RULES.update({r.name: r for r in (LocalRule, Prox, Scaffold, Moon, Sam, Gam, GamCV, Smoo)})
RULES = LOCAL_RULES


def get(name: str) -> LocalRule:
    return RULES[name]()
