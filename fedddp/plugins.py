"""Your own data, model and rules by import path: ``"module:attr"`` wherever a name goes
(``data.name``, ``model.name``, ``algorithm.name``, ``algorithm.local``); docs/extending.md.

``resolve(cfg)`` imports every path of a config (on every rank, before the config is validated)
and registers the server and local rules under their path, so the rest of fedddp looks them up
like the built-ins: ``algorithms.ALGORITHMS[path]`` is (the module's ``LOCAL_RULE``, else plain;
the path), ``WEIGHTING[path]`` the module's ``WEIGHTING``, else samples. Modules come from
``sys.path`` with the working directory first. An import that fails is one ConfigError naming
the key, the path and the cause.
"""

from __future__ import annotations

import importlib
import os
import sys

from .errors import ConfigError

# key -> what the attribute must be, for the error line
KEYS = {"data.name": "a data callable (root, seed) -> mapping of arrays",
        "model.name": "a model callable (input_shape, num_classes) -> torch.nn.Module",
        "algorithm.name": "a server rule: a fedddp.strategies.Strategy or an aggregate function",
        "algorithm.local": "a local rule: a subclass of fedddp.client.rules.LocalRule"}


def is_path(name: str) -> bool:
    """A ``module:attr`` import path rather than a built-in name."""
    return ":" in name


def _import(path: str, key: str):
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key}: {path!r} is not an import path; write module:attr, e.g. "
                          f"mypackage.mymodule:{'make_data' if key == 'data.name' else 'thing'}")
    cwd = os.getcwd()
    if sys.path[:1] not in ([""], [cwd]):  # the working directory first, as python -m puts it
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's module is one line
        cause = " ".join(str(exc).split())  # one line, whatever the module raised
        raise ConfigError(f"{key}: cannot import {module_name!r} for {path!r} ({type(exc).__name__}: {cause}); "
                          f"it is looked up on sys.path from the working directory {cwd}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                              f"attribute {attr!r}; {key} needs {KEYS[key]}")
        obj = getattr(obj, part)
    return module, obj


def get(path: str, key: str):
    """The object at ``path``, imported once per process."""
    if path not in _objects:
        _objects[path] = _import(path, key)
    return _objects[path][1]


_objects: dict[str, tuple[object, object]] = {}


def resolve(cfg) -> list[str]:
    """Import every import path of ``cfg`` and register its rules; one error line per key that
    fails (config.validate calls this first)."""
    errors = []
    for key in KEYS:
        section, name = key.split(".")
        path = getattr(getattr(cfg, section), name)
        if not is_path(path):
            continue
        try:
            obj = get(path, key)
            if key in ("data.name", "model.name") and not callable(obj):
                raise ConfigError(f"{key}: {path!r} is a {type(obj).__name__}, not callable; it must be {KEYS[key]}")
            if key == "algorithm.name":
                _register_server(path, obj)
            elif key == "algorithm.local":
                _register_local(path, obj)
        except ConfigError as exc:
            errors.append(str(exc))
    return errors


def _register_server(path: str, obj) -> None:
    from . import algorithms, strategies

    if path in strategies.REGISTRY:
        return
    if isinstance(obj, strategies.Strategy):
        strategy = obj
    elif callable(obj):
        strategy = strategies.Strategy(path, obj, doc=obj.__doc__ or "")
    else:
        raise ConfigError(f"algorithm.name: {path!r} is a {type(obj).__name__}; it must be "
                          f"{KEYS['algorithm.name']}")
    module = _objects[path][0]
    local = getattr(module, "LOCAL_RULE", "plain")
    weighting = getattr(module, "WEIGHTING", "samples")
    if weighting not in ("samples", "uniform"):
        raise ConfigError(f"algorithm.name: {path!r}: its module's WEIGHTING is {weighting!r}; it must be "
                          "samples or uniform")
    if is_path(local):
        _register_local(local, get(local, "algorithm.local"))
    strategies.REGISTRY[path] = strategies.plugin_form(strategy, path)
    algorithms.ALGORITHMS[path] = (local, path)
    algorithms.WEIGHTING[path] = weighting


def _register_local(path: str, obj) -> None:
    from .client import rules

    if not (isinstance(obj, type) and issubclass(obj, rules.LocalRule)):
        raise ConfigError(f"algorithm.local: {path!r} is a {type(obj).__name__}; it must be {KEYS['algorithm.local']}")
    rules.RULES[path] = obj
