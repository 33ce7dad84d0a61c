"""``algorithm.name`` -> the pair (local rule, server rule) it runs.

A paper's algorithm is a client-side local rule (how a client trains) and a server rule (how
rank 0 combines the reports). Keeping the two apart is what lets them compose:
``algorithm.local`` replaces the name's local rule (e.g. FedProx clients under FedGMA's server,
GAM clients under FedER's). A pair that cannot work (a rule that reads server state the server
rule does not keep, or a server rule that needs a report the local rule does not write) is a
configuration error naming both.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import models, plugins, strategies, tasks
from .errors import ConfigError, close_match
from .client import rules
from .client.optim import check_optimizer
from .registry import ALGORITHMS, resolve, weighting_of

def describe(cfg) -> str:
    """The algorithm as the rank-0 start line names it, e.g.
    'fedgam: gam clients, fedavg server rule, uniform weights'."""
    local, server = resolve(cfg.algorithm)
    return f"{cfg.algorithm.name}: {local} clients, {server} server rule, {weighting_of(cfg.algorithm)} weights"


def _check_pair(cfg, local: str, server: str) -> list[str]:
    name, errors = cfg.algorithm.name, []
    if local not in rules.RULES:
        return [f"algorithm.local: unknown local rule {local!r} (valid: auto, {', '.join(rules.RULES)})"]
    rule, strategy = rules.RULES[local], strategies.SERVER_RULES[server]
    pair = f"algorithm.local = {local} with the {server} server rule (algorithm.name = {name})"
    missing = [k for k in rule.reads_server if k not in strategy.client_visible]
    if missing:
        keepers = [s.name for s in strategies.SERVER_RULES.values() if set(missing) <= set(s.client_visible)]
        errors.append(f"algorithm.local: {pair}: the {local} clients correct their steps with the server's "
                      f"{', '.join(missing)}, which {server} does not keep or update; choose an algorithm.name "
                      f"whose server rule does ({', '.join(n for n, (_, s) in ALGORITHMS.items() if s in keepers)})")
    produced = {k for r in rules.RULES.values() for k in r.reports}
    unmet = sorted(k for k in strategy.needs_for(cfg.algorithm) if k in produced and k not in rule.reports)
    if unmet:
        writers = [n for n, r in rules.RULES.items() if set(unmet) <= set(r.reports)]
        errors.append(f"algorithm.local: {pair}: {server} needs {', '.join(unmet)} from its clients, which "
                      f"{local} clients do not report; use algorithm.local = auto or {' / '.join(writers)}")
    if server == "fednova":
        if cfg.train.optimizer != "sgd":
            errors.append(f"train.optimizer: fednova normalises by the (momentum) SGD step count; "
                          f"{cfg.train.optimizer} has no such a_k here (use sgd)")
        if local == "prox":
            errors.append(f"algorithm.local: {pair}: FedNova's a_k for FedProx's proximal solver differs "
                          "from the SGD one implemented here; use another local rule")
        if not cfg.train.momentum < 1:
            errors.append(f"train.momentum: fednova needs momentum < 1, got {cfg.train.momentum}")
    errors += _check_dp(cfg, server)
    if cfg.algorithm.server_lr != 1.0 and not strategy.takes_server_lr:
        takers = [n for n, (_, s) in ALGORITHMS.items() if strategies.SERVER_RULES[s].takes_server_lr]
        errors.append(f"algorithm.server_lr: the {server} server rule (algorithm.name = {name}) has no "
                      f"server step for a learning rate to scale, so it would ignore "
                      f"{cfg.algorithm.server_lr}; leave it at 1, or use a rule that takes it "
                      f"({', '.join(takers)}; docs/algorithms.md)")
    if local in ("scaffold", "gam_cv"):
        errors += _check_control(cfg, local)
    if local == "moon":
        if cfg.algorithm.moon_tau <= 0:
            errors.append(f"algorithm.moon_tau: must be > 0, got {cfg.algorithm.moon_tau}")
        if cfg.algorithm.moon_proj_dim < 0:
            errors.append(f"algorithm.moon_proj_dim: must be >= 0, got {cfg.algorithm.moon_proj_dim}")
        if tasks.of_data(cfg.data.name) == "regression":  # known by name: said before any data is read
            errors.append(f"algorithm.local: {pair}: MOON is defined for classification; data.name = "
                          f"{cfg.data.name} is a regression task (choose another algorithm.name or "
                          "algorithm.local)")
    return errors + check_optimizer(cfg.train)


def _check_dp(cfg, server: str) -> list[str]:
    """Client-level DP is the dpfedavg server rule's: the others reweight, mask, normalise or keep
    state over the clients' raw updates, which voids its C / K bound on one client's influence."""
    hp = cfg.algorithm
    if server != "dpfedavg":
        if hp.dp_clip > 0:
            return [f"algorithm.dp_clip: client-level DP is algorithm.name = dpfedavg (FedAvg's server rule "
                    f"with clipping and noise; any local rule it pairs with via algorithm.local, e.g. prox, sam, "
                    f"gam, moon); the other server rules ({server} here) reweight, mask or normalise raw "
                    f"updates, which voids the clip bound: use dpfedavg or set algorithm.dp_clip = 0"]
        return []
    errors = []
    if not hp.dp_clip > 0:
        errors.append(f"algorithm.dp_clip: dpfedavg clips each client's update to this L2 norm; set it > 0, "
                      f"got {hp.dp_clip}")
    if hp.dp_noise < 0:
        errors.append(f"algorithm.dp_noise: must be >= 0, got {hp.dp_noise}")
    if not 0 < hp.dp_delta < 1:
        errors.append(f"algorithm.dp_delta: must be in (0, 1), got {hp.dp_delta}")
    if weighting_of(hp) != "uniform":
        errors.append(f"algorithm.weighting: dpfedavg bounds one client's influence by C / K with equal "
                      f"weights; set algorithm.weighting = uniform or auto, not {hp.weighting}")
    try:
        import dp_accounting  # noqa: F401
    except ImportError:
        errors.append("algorithm.name: dpfedavg accounts its privacy with Google's dp-accounting (RDP, "
                      "sampling without replacement), which is not installed: pip install 'fedddp[dp]' "
                      "(or pip install dp-accounting)")
    return errors


def _check_control(cfg, local: str) -> list[str]:
    """SCAFFOLD's option II and FedGAM-CV's eq. 21 read the client's mean step direction off
    (w - w_k) / (tau lr): true for plain SGD only (momentum or Adam move w by something else)."""
    tc, option = cfg.train, cfg.algorithm.scaffold_control
    if local == "gam_cv" and option == "I":
        return ["algorithm.scaffold_control: I is SCAFFOLD's option; FedGAM-CV updates c_k by seed 002's "
                "eq. 21 (option II) only; set algorithm.scaffold_control = II"]
    if tc.optimizer == "sgd" and tc.momentum == 0:
        return []
    what = f"train.optimizer = {tc.optimizer}" if tc.optimizer != "sgd" else f"train.momentum = {tc.momentum}"
    key = "train.optimizer" if tc.optimizer != "sgd" else "train.momentum"
    if local == "scaffold" and option == "II":
        return [f"algorithm.scaffold_control: option II's c_k+ = c_k - c + (w - w_k) / (tau lr) holds for "
                f"plain SGD only, not with {what}; set algorithm.scaffold_control = I (c_k+ = the client's "
                "gradient at the global model, valid for any optimizer) or use plain SGD"]
    if local == "gam_cv":
        return [f"{key}: FedGAM-CV's c_k update (seed 002 eq. 21) holds for plain SGD only, not with {what}; "
                "use train.optimizer = sgd with train.momentum = 0, or algorithm.name = scaffold with "
                "algorithm.scaffold_control = I"]
    return []


def check_algorithm(cfg) -> list[str]:
    name = cfg.algorithm.name
    if name not in ALGORITHMS:
        near = close_match(name, ALGORITHMS)
        hint = f", did you mean {near}?" if near else ""
        return [f"algorithm.name: unknown algorithm {name!r}{hint} (valid: {', '.join(ALGORITHMS)}, or module:attr, "
                "your server rule: docs/extending.md)"]
    _, server = ALGORITHMS[name]
    if server not in strategies.SERVER_RULES:
        return [f"algorithm.name: {name!r} needs the server rule {server!r}, which is not available"]
    local = resolve(cfg.algorithm)[0]
    errors = _check_pair(cfg, local, server)
    return errors or _check_params(cfg.algorithm.params, local, server)


def _declared_params(local: str, server: str) -> dict[str, tuple[str, object]]:
    """name -> (the rule that declares it, its default); the server rule's first."""
    declared = {k: (local, v) for k, v in rules.RULES[local].params.items()}
    declared.update({k: (server, v) for k, v in strategies.SERVER_RULES[server].params.items()})
    return declared


def _check_params(params: dict, local: str, server: str) -> list[str]:
    """[algorithm.params]: every name declared by the server or the local rule, of its default's
    type; then each rule checks its own values, the refused ones left at their defaults, so one
    bad name does not hide the other values' errors."""
    declared, errors, good = _declared_params(local, server), [], {}
    for key, value in params.items():
        if key not in declared:
            known = ", ".join(f"{k} ({rule})" for k, (rule, _) in declared.items()) or "none"
            near = close_match(key, declared)
            hint = f", did you mean {near}?" if near else ""
            errors.append(f"algorithm.params.{key}: not a parameter of the {server} server rule or the "
                          f"{local} local rule{hint} (theirs: {known})")
            continue
        rule, default = declared[key]
        want = float if type(default) is float else type(default)
        ok = isinstance(value, want) and isinstance(value, bool) == (want is bool)
        if not ok and not (want is float and isinstance(value, int) and not isinstance(value, bool)):
            errors.append(f"algorithm.params.{key}: {rule} takes a {want.__name__} (default {default!r}), "
                          f"got {type(value).__name__} {value!r}")
        else:
            good[key] = value
    full = params_of(good, local, server)
    check_server = strategies.SERVER_RULES[server].check_params
    errors += [] if check_server is None else list(check_server(full))
    errors += list(rules.RULES[local].check_params(full))
    return [e if e.startswith("algorithm.params") else f"algorithm.params: {e}" for e in errors]


def params_of(params: dict, local: str, server: str) -> dict:
    """[algorithm.params] with every declared default filled in (ints given for floats as floats),
    as config.toml records it and the rules read it (hp.params)."""
    full = {k: default for k, (_, default) in _declared_params(local, server).items()}
    full.update({k: float(v) if type(full.get(k)) is float else v for k, v in params.items()})
    return full


def _outside(net, parts) -> list[str]:
    """Names of the parameters and buffers of ``net`` that none of ``parts`` holds."""
    inside = {id(t) for part in parts for t in [*part.parameters(), *part.buffers()]}
    return [n for n, t in [*net.named_parameters(), *net.named_buffers()] if id(t) not in inside]


def check_model(cfg, net, task: str) -> list[str]:
    """What the run's rules need of the built model (never its name): FedER a conv layer to
    weigh by effective rank; MOON a classifier and its split into ``features`` and ``head``."""
    local, server = resolve(cfg.algorithm)
    errors = []
    what = f"model.name = {cfg.model.name}"
    if strategies.SERVER_RULES[server].needs_for(cfg.algorithm) & {"eff_rank_KL"} and \
            not any(isinstance(m, nn.Conv2d) for m in net.modules()):
        errors.append(f"model.name: {server} weighs conv layers by effective rank; {what} has no "
                      "torch.nn.Conv2d layer (use cnn, resnet18 or a model with one)")
    if local == "moon":
        if task != "classification":
            # MOON's projection head sits between the features and a classifier, and its
            # contrastive term is part of a cross-entropy objective: neither exists for a regressor.
            errors.append(f"algorithm.local: MOON is defined for classification; data.name = "
                          f"{cfg.data.name} is a {task} task (choose another algorithm.name or algorithm.local)")
        missing = [a for a in ("features", "head") if not isinstance(getattr(net, a, None), nn.Module)]
        if missing:
            errors.append(f"model.name: MOON compares representations, so the model must be head(features(x)) "
                          f"with submodules .features and .head; {what} has no {' and no '.join(missing)} "
                          "(docs/extending.md, \"MOON\")")
        elif outside := _outside(net, (net.features, net.head)):
            errors.append(f"model.name: MOON runs the model as head(features(x)); {what} has tensors outside "
                          f".features and .head ({', '.join(outside[:3])}); move them into one of the two")
        elif cfg.algorithm.moon_proj_dim > 0 and not isinstance(net.head, nn.Linear):
            errors.append(f"model.name: MOON's projection head (algorithm.moon_proj_dim = "
                          f"{cfg.algorithm.moon_proj_dim}) replaces the classifier .head, which must be a "
                          f"torch.nn.Linear; {what} has a {type(net.head).__name__} (or set "
                          "algorithm.moon_proj_dim = 0)")
    return errors


@torch.no_grad()
def check_output(name: str, net: nn.Module, input_shape: tuple, num_classes: int, task: str) -> list[str]:
    """One forward pass of two zero samples (the data's one input shape), in eval mode so that no
    BatchNorm statistic moves and no random number is drawn (the run's bits stay as they were):
    the output must be what the task's loss reads (fedddp.tasks), else round 1 would end in a torch
    traceback. An exception in a plugin model's forward is the user's (plugins.calling)."""
    want = [2, num_classes if task == "classification" else 1]
    modes = [m.training for m in net.modules()]
    net.eval()
    try:
        with (plugins.calling("model.name", f"{name}'s forward") if plugins.is_path(name)
              else contextlib.nullcontext()):
            out = net(torch.zeros(2, *input_shape))
    finally:
        for m, mode in zip(net.modules(), modes):
            m.training = mode
    got = list(out.shape) if isinstance(out, torch.Tensor) else f"a {type(out).__name__}, not a tensor,"
    if got == want:
        return []
    what = (f"a classification task with {num_classes} classes, so it must return {want} (one logit per class)"
            if task == "classification" else f"a regression task, so it must return {want} (one prediction each)")
    return [f"model.name: {name} returns {got} for a batch of 2 samples of shape {list(input_shape)}; the data "
            f"are {what}"]


def build_model(cfg, input_shape, num_classes: int, task: str | None = None) -> nn.Module:
    """The run's model: ``model.name`` built for data of this shape and task (fedddp.models),
    checked against what the run's rules need (``check_model``: a ConfigError naming what is
    missing), and MOON's projection head added. Every rank builds the same model from the same
    seed."""
    # None: the task of a built-in data set by its name (the data's own FederatedData.task is
    # what the round loop passes)
    task = task or tasks.of_data(cfg.data.name) or "classification"
    net = models.build(cfg.model.name, input_shape, num_classes, task, cfg.model.hidden)
    errors = check_model(cfg, net, task) + check_output(cfg.model.name, net, tuple(input_shape), num_classes, task)
    if errors:
        raise ConfigError("; ".join(errors))
    if resolve(cfg.algorithm)[0] == "moon":
        if not isinstance(net, models.Net):
            net = models.Net(net.features, net.head)  # the contrastive term reads features, the loss head(...)
        if cfg.algorithm.moon_proj_dim > 0:
            net = models.add_projection_head(net, cfg.algorithm.moon_proj_dim, num_classes)
    return net
