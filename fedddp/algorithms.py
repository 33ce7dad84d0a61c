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
import dataclasses

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


def describe_params() -> str:
    """Every built-in rule's own parameters with default, owner and doc, for ``--help``."""
    owners: dict[str, list[str]] = {}
    docs, defaults = {}, {}
    for kind, table in (("server rule", strategies.SERVER_RULES), ("local rule", rules.RULES)):
        for rule_name, rule in table.items():
            if plugins.is_path(rule_name):
                continue
            for key, default in rule.params.items():
                owners.setdefault(key, []).append(f"{rule_name} {kind}")
                docs.setdefault(key, rule.param_docs.get(key, ""))
                defaults.setdefault(key, default)
    shown = {k: f'"{v}"' if isinstance(v, str) else repr(v) for k, v in defaults.items()}
    return "\n".join(f"  algorithm.params.{key} = {shown[key]}  ({', '.join(owners[key])})\n      {docs[key]}"
                     for key in owners)


def _check_pair(cfg, local: str, server: str, params: dict) -> list[str]:
    """What the rules local and server, run together under cfg (``params``: the rules' resolved
    hyperparameters), cannot do."""
    name, errors = cfg.algorithm.name, []
    rule, strategy = rules.RULES[local], strategies.SERVER_RULES[server]
    pair = f"algorithm.local = {local} with the {server} server rule (algorithm.name = {name})"
    missing = [k for k in rule.reads_server if k not in strategy.client_visible]
    if missing:
        keepers = [s.name for s in strategies.SERVER_RULES.values() if set(missing) <= set(s.client_visible)]
        errors.append(f"algorithm.local: {pair}: the {local} clients correct their steps with the server's "
                      f"{', '.join(missing)}, which {server} does not keep or update; choose an algorithm.name "
                      f"whose server rule does ({', '.join(n for n, (_, s) in ALGORITHMS.items() if s in keepers)})")
    produced = {k for r in rules.RULES.values() for k in r.reports}
    needs = strategy.needs_for(dataclasses.replace(cfg.algorithm, params=params))
    unmet = sorted(k for k in needs if k in produced and k not in rule.reports)
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
    if strategy.private:
        errors += _check_dp(cfg, server, params)
    if cfg.algorithm.server_lr != 1.0 and not strategy.takes_server_lr:
        takers = [n for n, (_, s) in ALGORITHMS.items() if strategies.SERVER_RULES[s].takes_server_lr]
        errors.append(f"algorithm.server_lr: the {server} server rule (algorithm.name = {name}) has no "
                      f"server step for a learning rate to scale, so it would ignore "
                      f"{cfg.algorithm.server_lr}; leave it at 1, or use a rule that takes it "
                      f"({', '.join(takers)}; docs/algorithms.md)")
    if local in ("scaffold", "gam_cv"):
        errors += _check_control(cfg, local, params)
    if local == "moon":
        if tasks.of_data(cfg.data.name) == "regression":  # known by name: said before any data is read
            errors.append(f"algorithm.local: {pair}: MOON is defined for classification; data.name = "
                          f"{cfg.data.name} is a regression task (choose another algorithm.name or "
                          "algorithm.local)")
    return errors + check_optimizer(cfg.train)


def sampling_of(cfg) -> str:
    """run.sampling, fixed or poisson: with auto, poisson for a private server rule (DP-FedAvg,
    whose accountant then matches the sampling) and fixed for the others."""
    if cfg.run.sampling != "auto":
        return cfg.run.sampling
    server = resolve(cfg.algorithm)[1]
    return "poisson" if getattr(strategies.SERVER_RULES.get(server), "private", False) else "fixed"


def _check_dp(cfg, server: str, params: dict) -> list[str]:
    """DP-FedAvg's bound on one client's influence, C / K, holds for equal weights; its epsilon is
    dp-accounting's, for the run's sampling (its own values are checked by the rule:
    strategies/dpfedavg.py); the noise cohort and adaptive clipping's count noise against the
    cohort."""
    errors = []
    if weighting_of(cfg.algorithm) != "uniform":
        errors.append(f"algorithm.weighting: {server} bounds one client's influence by C / K with equal "
                      f"weights; set algorithm.weighting = uniform or auto, not {cfg.algorithm.weighting}")
    try:
        import dp_accounting  # noqa: F401
    except ImportError:
        errors.append(f"algorithm.name: {server} accounts its privacy with Google's dp-accounting (PLD or "
                      "RDP), which is not installed: pip install 'fedddp[dp]' (or pip install dp-accounting)")
    sampling = dataclasses.replace(cfg.run, sampling=sampling_of(cfg))
    if sampling.sampling == "fixed" and params.get("dp_accountant") == "pld":
        errors.append("algorithm.params.dp_accountant: pld cannot account run.sampling = fixed (K of N without "
                      "replacement: dp-accounting's PLD accountant has no such event); use run.sampling=poisson, "
                      "or algorithm.params.dp_accountant=rdp")
    cohort = dataclasses.replace(cfg, run=sampling).expected_cohort()
    noise_cohort, n = params.get("dp_noise_cohort", 0), cfg.data.num_clients
    if noise_cohort and not cohort <= noise_cohort <= n:
        errors.append(f"algorithm.params.dp_noise_cohort: the noise is calibrated for this many clients a round, "
                      f"so it must lie between the clients that train ({cohort:g} a round) and data.num_clients "
                      f"= {n}; got {noise_cohort}")
    elif params.get("dp_adaptive_quantile", 0) > 0 and params.get("dp_noise", 0) > 0:
        z, m = params["dp_noise"], noise_cohort or cohort
        sigma_b = params["dp_adaptive_count_noise"] or m / 20
        if not 2 * sigma_b > z:
            # the value to set: sigma_b = z costs the update 1.155x its noise multiplier
            # ((z^-2 - (2 z)^-2)^-1/2); or a cohort whose m / 20 exceeds z / 2
            errors.append(f"algorithm.params.dp_adaptive_count_noise: adaptive clipping's count noise sigma_b = "
                          f"{sigma_b:g} (0: the cohort {m:g} / 20) must exceed dp_noise / 2 = {z / 2:g}, else no "
                          "update noise keeps the total privacy at dp_noise; set "
                          f"algorithm.params.dp_adaptive_count_noise={z:g} (the update's noise multiplier then "
                          f"{z * (1 - 0.25) ** -0.5:.3g} instead of {z:g}), or a cohort (run.clients_per_round or "
                          f"algorithm.params.dp_noise_cohort) above {10 * z:g}")
    return errors


def _check_control(cfg, local: str, params: dict) -> list[str]:
    """SCAFFOLD's option II and FedGAM-CV's eq. 21 (its only option) read the client's mean step
    direction off (w - w_k) / (tau lr): true for plain SGD only (momentum or Adam move w by
    something else)."""
    tc, option = cfg.train, params.get("scaffold_control", "II")
    if tc.optimizer == "sgd" and tc.momentum == 0:
        return []
    what = f"train.optimizer = {tc.optimizer}" if tc.optimizer != "sgd" else f"train.momentum = {tc.momentum}"
    key = "train.optimizer" if tc.optimizer != "sgd" else "train.momentum"
    if local == "scaffold" and option == "II":
        return [f"algorithm.params.scaffold_control: option II's c_k+ = c_k - c + (w - w_k) / (tau lr) holds for "
                f"plain SGD only, not with {what}; set algorithm.params.scaffold_control = I (c_k+ = the client's "
                "gradient at the global model, valid for any optimizer) or use plain SGD"]
    if local == "gam_cv":
        return [f"{key}: FedGAM-CV's c_k update (seed 002 eq. 21) holds for plain SGD only, not with {what}; "
                "use train.optimizer = sgd with train.momentum = 0, or algorithm.name = scaffold with "
                "algorithm.params.scaffold_control = I"]
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
    if local not in rules.RULES:
        near = close_match(local, rules.RULES)
        hint = f", did you mean {near}?" if near else ""
        return [f"algorithm.local: unknown local rule {local!r}{hint} (valid: auto, {', '.join(rules.RULES)}, or "
                "module:attr, your LocalRule subclass: docs/extending.md)"]
    param_errors, given = _check_params(cfg.algorithm.params, name, local, server)
    # the pair is judged with the values that passed (a refused one is at its default)
    return _check_pair(cfg, local, server, params_of(given, name, local, server)) + param_errors


def _declared_params(local: str, server: str) -> dict[str, tuple[str, object]]:
    """name -> (the rule that declares it, its default); the server rule's first."""
    declared = {k: (local, v) for k, v in rules.RULES[local].params.items()}
    declared.update({k: (server, v) for k, v in strategies.SERVER_RULES[server].params.items()})
    return declared


def _rule_params(rule: str) -> dict[str, tuple[str, object]] | None:
    """What the table [algorithm.params.RULE] may hold when RULE is known: an algorithm's name
    (both its rules'), a server rule's or a local rule's; None for a name fedddp does not know."""
    if rule in ALGORITHMS:
        return _declared_params(*ALGORITHMS[rule])
    if rule in strategies.SERVER_RULES:
        return {k: (rule, v) for k, v in strategies.SERVER_RULES[rule].params.items()}
    if rule in rules.RULES:
        return {k: (rule, v) for k, v in rules.RULES[rule].params.items()}
    return None


def _applied(params: dict, name: str, local: str, server: str) -> list[tuple[str, dict]]:
    """The parts of [algorithm.params] the run uses, least specific first, each (its path, its
    entries): the local rule's table, the server rule's, the algorithm's, then the plain names."""
    tables = [(rule, params[rule]) for rule in dict.fromkeys((local, server, name))
              if isinstance(params.get(rule), dict)]
    plain = {k: v for k, v in params.items() if not isinstance(v, dict)}
    return [(f"algorithm.params.{rule}", table) for rule, table in tables] + [("algorithm.params", plain)]


def _typed(entries: dict, declared: dict, where: str, pair: str, errors: list[str]) -> dict:
    """The entries whose names ``declared`` holds, of their default's type; an error line for
    each other one."""
    good = {}
    for key, value in entries.items():
        if key not in declared:
            known = ", ".join(f"{k} ({rule})" for k, (rule, _) in declared.items()) or "none"
            near = close_match(key, declared)
            hint = f", did you mean {near}?" if near else ""
            errors.append(f"{where}.{key}: not a parameter of {pair}{hint} (theirs: {known})")
            continue
        rule, default = declared[key]
        want = float if type(default) is float else type(default)
        ok = isinstance(value, want) and isinstance(value, bool) == (want is bool)
        if not ok and not (want is float and isinstance(value, int) and not isinstance(value, bool)):
            errors.append(f"{where}.{key}: {rule} takes a {want.__name__} (default {default!r}), "
                          f"got {type(value).__name__} {value!r}")
        else:
            good[key] = value
    return good


def _check_params(params: dict, name: str, local: str, server: str) -> tuple[list[str], dict]:
    """[algorithm.params]: every plain name, and every name in the tables of the run's rules, is
    declared by the server or the local rule, of its default's type; a table of a rule the run
    does not use is checked against that rule when fedddp knows it (a typo in a sweep's file is
    caught in every combination) and otherwise ignored. Then each rule checks its own values,
    the refused ones left at their defaults, so one bad name does not hide the other values'
    errors. Returns (the error lines, the accepted values as plain names)."""
    errors, given = [], {}
    pair = f"the {server} server rule or the {local} local rule"
    for where, entries in _applied(params, name, local, server):
        given.update(_typed(entries, _declared_params(local, server), where, pair, errors))
    for rule, table in params.items():
        if not isinstance(table, dict) or rule in (name, local, server):
            continue
        declared = _rule_params(rule)
        if declared is not None:
            _typed(table, declared, f"algorithm.params.{rule}", f"{rule}", errors)
        elif not plugins.is_path(rule):
            known = [*ALGORITHMS, *strategies.SERVER_RULES, *rules.RULES]
            near = close_match(rule, known)
            hint = f", did you mean {near}?" if near else ""
            errors.append(f"algorithm.params.{rule}: a table [algorithm.params.RULE] is for an algorithm, "
                          f"server or local rule, and no rule is called {rule!r}{hint}")
    full = params_of(given, name, local, server)
    check_server = strategies.SERVER_RULES[server].check_params
    own = ([] if check_server is None else list(check_server(full))) + list(rules.RULES[local].check_params(full))
    errors += [e if e.startswith("algorithm.params") else f"algorithm.params: {e}" for e in own]
    return errors, given


def params_of(params: dict, name: str, local: str, server: str) -> dict:
    """The run's rule hyperparameters as plain names, as config.toml records them and the rules
    read them (hp.params): each declared default, then the tables of the local rule, the server
    rule and the algorithm, then the plain names (ints given for floats as floats). Tables of
    rules the run does not use are left out. Idempotent: resolved params resolve to themselves."""
    full = {k: default for k, (_, default) in _declared_params(local, server).items()}
    for _, entries in _applied(params, name, local, server):
        full.update({k: float(v) if type(full.get(k)) is float else v for k, v in entries.items() if k in full})
    return full


def resolved(hp):
    """hp (an AlgorithmConfig) with its params resolved (params_of) for its own rules: the config
    checks.load returns already holds them so; a hand-made one (tests) gets the defaults."""
    return dataclasses.replace(hp, params=params_of(hp.params, hp.name, *resolve(hp)))


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
    hp = resolved(cfg.algorithm)
    if strategies.SERVER_RULES[server].needs_for(hp) & {"eff_rank_KL"} and \
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
        elif hp.params["moon_proj_dim"] > 0 and not isinstance(net.head, nn.Linear):
            errors.append(f"model.name: MOON's projection head (algorithm.params.moon_proj_dim = "
                          f"{hp.params['moon_proj_dim']}) replaces the classifier .head, "
                          f"which must be a torch.nn.Linear; {what} has a {type(net.head).__name__} (or set "
                          "algorithm.params.moon_proj_dim = 0)")
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
        proj_dim = resolved(cfg.algorithm).params["moon_proj_dim"]
        if proj_dim > 0:
            net = models.add_projection_head(net, proj_dim, num_classes)
    return net
