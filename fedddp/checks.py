"""Loading a config: parse it, import and register its plugins, then every check at once.

The checks that need more than the config's own fields (the rules a name pairs, what the local
rule reads of the server rule, participation, side by side) live in the modules that own those
concepts; this module sits above all of them and calls them in one place, so no lower module
imports upward. ``load`` is what the command line, ``fedddp.run``, the sweep and the launchers
call.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any

from . import algorithms, asynchrony, callbacks, config, participation, plugins, strategies
from .client import batched, rules
from .errors import ConfigError
from .registry import ALGORITHMS, LOCAL_RULES, SERVER_RULES, WEIGHTING, weighting_of


def load(path: str | os.PathLike | Mapping[str, Any] | None, overrides: list[str] = ()) -> config.Config:
    """The file (or its tables as nested dicts), then the overrides; every error of both at once,
    as one ConfigError."""
    cfg, errors, path = config.parse(path, overrides)
    # A key whose value was refused keeps its default, so the other keys are still checked;
    # only errors about keys not already reported are added.
    reported = {e.split(":", 1)[0] for e in errors}
    errors += [e for e in validate(cfg) if e.split(":", 1)[0] not in reported]
    config.refuse(errors, path)
    # resolved once, so config.toml, the start line and every rule see the same weighting,
    # sampling and rule parameters (the declared defaults filled in)
    hp = algorithms.resolved(cfg.algorithm)
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(hp, weighting=weighting_of(hp)),
                               run=dataclasses.replace(cfg.run, sampling=algorithms.sampling_of(cfg.run.sampling,
                                                                                                cfg.algorithm)))


def validate(cfg: config.Config) -> list[str]:
    """Every impossible value or combination, each naming its dotted path: the plugins first
    (their rules are checked with the built-ins'), then the fields, then what spans modules."""
    named = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in plugins.KEYS}
    errors = register_plugins(named) + callbacks.check(cfg.run.callbacks)
    # a key whose import failed is said once: what the later checks say of it (an "unknown
    # algorithm" that is only not imported) follows from that failure and would mislead
    failed = {e.split(":", 1)[0] for e in errors}
    rest = (config.check_fields(cfg) + algorithms.check_algorithm(cfg) + participation.check(cfg.run, cfg.train)
            + batched.check(cfg.run.parallel_clients, cfg.algorithm, cfg.train, cfg.model)
            + asynchrony.check(cfg.run, cfg.data, cfg.algorithm))
    return errors + [e for e in rest if e.split(":", 1)[0] not in failed]


def register_plugins(named: Mapping[str, str]) -> list[str]:
    """Import every ``module:attr`` that ``named`` (a key of plugins.KEYS -> its configured value)
    gives (on every rank, before the config is validated) and register its rules under their
    path, so the rest of fedddp looks them up like the built-ins: ``ALGORITHMS[path]`` is (the
    module's ``LOCAL_RULE``, else plain; the path), ``WEIGHTING[path]`` the module's
    ``WEIGHTING``, else samples. One error line per key that fails."""
    errors = []
    for key, path in named.items():
        if not plugins.is_path(path):
            continue
        try:
            obj = plugins.get(path, key)
            if key in ("data.name", "model.name") and not callable(obj):
                raise ConfigError(f"{key}: {path!r} is a {type(obj).__name__}, not callable; it must be "
                                  f"{plugins.KEYS[key]}")
            if key == "algorithm.name":
                _register_server(path, obj)
            elif key == "algorithm.local":
                _register_local(path, obj)
        except ConfigError as exc:
            errors.append(str(exc))
    return errors


def _register_server(path: str, obj) -> None:
    if path in SERVER_RULES:
        return
    if isinstance(obj, strategies.Strategy):
        strategy = obj
    elif callable(obj):
        strategy = strategies.Strategy(path, obj, doc=obj.__doc__ or "")
    else:
        raise ConfigError(f"algorithm.name: {path!r} is a {type(obj).__name__}; it must be "
                          f"{plugins.KEYS['algorithm.name']}")
    module = plugins.module_of(path)
    local = getattr(module, "LOCAL_RULE", rules.LocalRule.name)
    weighting = getattr(module, "WEIGHTING", "samples")
    if weighting not in ("samples", "uniform"):
        raise ConfigError(f"algorithm.name: {path!r}: its module's WEIGHTING is {weighting!r}; it must be "
                          "samples or uniform")
    if plugins.is_path(local):
        _register_local(local, plugins.get(local, "algorithm.local"))
    SERVER_RULES[path] = strategies.plugin_form(strategy, path)
    ALGORITHMS[path] = (local, path)
    WEIGHTING[path] = weighting


def _register_local(path: str, obj) -> None:
    if not (isinstance(obj, type) and issubclass(obj, rules.LocalRule)):
        raise ConfigError(f"algorithm.local: {path!r} is a {type(obj).__name__}; it must be "
                          f"{plugins.KEYS['algorithm.local']}")
    LOCAL_RULES[path] = _guarded_rule(obj, path)


def _guarded_rule(cls: type, path: str) -> type:
    """The user's LocalRule with its hooks run under plugins.calling: what they raise is one line
    naming the hook (exit 7), not a traceback that reads as fedddp's bug."""
    def guard(hook: str):
        method = getattr(cls, hook)

        @functools.wraps(method)  # __wrapped__: the user's own (rules.one_client_only reads it)
        def call(self, *args, **kwargs):
            with plugins.calling("algorithm.local", f"{path}.{hook}"):
                return method(self, *args, **kwargs)
        return call

    def guard_class(hook: str):  # a classmethod of the rule: check_params, check_config, ...
        method = getattr(cls, hook)

        def call(*args):
            with plugins.calling("algorithm.local", f"{path}.{hook}"):
                return method(*args)
        return staticmethod(call)

    hooks = {hook: guard(hook) for hook in ("begin", "loss", "direction", "gradient", "end")}
    hooks |= {hook: guard_class(hook) for hook in ("check_params", "check_config", "check_model", "adapt_model")}
    return type(cls.__name__, (cls,), {**hooks, "__module__": cls.__module__, "__doc__": cls.__doc__})
