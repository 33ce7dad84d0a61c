"""The ``LocalRule`` base class and the helpers rules share (a step's view, norms, the shifted
passes). What a rule is and the built-in rules' formulas: the package's docstring
(``fedddp/client/rules/__init__.py``).

Legend: P flat elements (the model's FlatLayout: parameters, then buffers); L clients stepping
side by side.
"""

import copy
import functools
from contextlib import contextmanager

import torch

from ...registry import add_local

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

    @classmethod
    def check_config(cls, cfg, server: str, params: dict) -> list[str]:
        """One error line per thing this rule cannot do in the run ``cfg`` beside the ``server``
        rule (``params``: the rules' resolved values), said when the config loads and by --check."""
        return []

    @classmethod
    def check_model(cls, net, task: str, params: dict, model_name: str) -> list[str]:
        """One error line per thing this rule needs of the built model ``net`` (model.name =
        ``model_name``, for the lines) for ``task`` and does not find (MOON: a split into
        features and head)."""
        return []

    @classmethod
    def adapt_model(cls, net, params: dict, num_classes: int):
        """The model this rule trains, built from the checked ``net`` (MOON adds its projection
        head); the model itself by default. Every rank builds the same from the same seed."""
        return net

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


add_local(LocalRule)
