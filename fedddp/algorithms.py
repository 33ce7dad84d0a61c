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

def describe(hp) -> str:
    """The algorithm (``hp``: the AlgorithmConfig) as the rank-0 start line names it, e.g.
    'fedgam: gam clients, fedavg server rule, uniform weights'."""
    local, server = resolve(hp)
    return f"{hp.name}: {local} clients, {server} server rule, {weighting_of(hp)} weights"


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
    # what each rule refuses of this run (its optimizer, weighting, sampling, data), said by the rule
    check_server = strategy.check_config
    errors += [] if check_server is None else list(check_server(cfg, local, params))
    if cfg.algorithm.server_lr != 1.0 and not strategy.takes_server_lr:
        takers = [n for n, (_, s) in ALGORITHMS.items() if strategies.SERVER_RULES[s].takes_server_lr]
        errors.append(f"algorithm.server_lr: the {server} server rule (algorithm.name = {name}) has no "
                      f"server step for a learning rate to scale, so it would ignore "
                      f"{cfg.algorithm.server_lr}; leave it at 1, or use a rule that takes it "
                      f"({', '.join(takers)}; docs/algorithms.md)")
    errors += list(rule.check_config(cfg, server, params))
    return errors + check_optimizer(cfg.train)


def sampling_of(sampling: str, hp) -> str:
    """run.sampling (``sampling``), fixed or poisson: with auto, poisson for a private server rule
    of the algorithm section ``hp`` (DP-FedAvg, whose accountant then matches the sampling) and
    fixed for the others."""
    if sampling != "auto":
        return sampling
    server = resolve(hp)[1]
    return "poisson" if getattr(strategies.SERVER_RULES.get(server), "private", False) else "fixed"


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


def check_model(algorithm, model_name: str, net, task: str) -> list[str]:
    """What the rules of the algorithm section need of the built model (never its name, which
    only the lines say): the server rule's report fields (effective ranks need a conv layer to
    weigh), then the local rule's own check (LocalRule.check_model)."""
    local, server = resolve(algorithm)
    errors = []
    what = f"model.name = {model_name}"
    hp = resolved(algorithm)
    if strategies.SERVER_RULES[server].needs_for(hp) & {"eff_rank_KL"} and \
            not any(isinstance(m, nn.Conv2d) for m in net.modules()):
        errors.append(f"model.name: {server} weighs conv layers by effective rank; {what} has no "
                      "torch.nn.Conv2d layer (use cnn, resnet18 or a model with one)")
    errors += list(rules.RULES[local].check_model(net, task, hp.params, model_name))
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
    missing), then changed as the local rule says (LocalRule.adapt_model). Every rank builds the same model from the same
    seed."""
    # None: the task of a built-in data set by its name (the data's own FederatedData.task is
    # what the round loop passes)
    task = task or tasks.of_data(cfg.data.name) or "classification"
    net = models.build(cfg.model.name, input_shape, num_classes, task, cfg.model.hidden)
    errors = (check_model(cfg.algorithm, cfg.model.name, net, task)
              + check_output(cfg.model.name, net, tuple(input_shape), num_classes, task))
    if errors:
        raise ConfigError("; ".join(errors))
    # the local rule's own parts (MOON's projection head), after the checks above passed
    net = rules.RULES[resolve(cfg.algorithm)[0]].adapt_model(net, resolved(cfg.algorithm).params, num_classes)
    return net
