"""Your own data, model and rules by import path: ``"module:attr"`` wherever a name goes
(``data.name``, ``model.name``, ``algorithm.name``, ``algorithm.local``); docs/extending.md.

This module imports them: ``get(path, key)``, once per process, from ``sys.path`` with the
working directory first; an import that fails is one ConfigError naming the key, the path and the
cause. ``checks.register_plugins`` registers the rules a config names in fedddp.registry, beside
the built-ins.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

from .errors import ConfigError, PluginError, UserError

# key -> what the attribute must be, for the error line
KEYS = {"data.name": "a data callable (root, seed) -> mapping of arrays",
        "model.name": "a model callable (input_shape, num_classes) -> torch.nn.Module",
        "algorithm.name": "a server rule: a fedddp.strategies.Strategy or an aggregate function",
        "algorithm.local": "a local rule: a subclass of fedddp.client.rules.LocalRule"}


def is_path(name: str) -> bool:
    """A ``module:attr`` import path rather than a built-in name."""
    return ":" in name


def _import(path: str, key: str, what: str | None = None):
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
                              f"attribute {attr!r}; {key} needs {what or KEYS[key]}")
        obj = getattr(obj, part)
    return module, obj


@contextlib.contextmanager
def calling(key: str, name: str):
    """Run the user's callable ``name`` (given by ``key``): whatever it raises but fedddp's own
    errors becomes one PluginError line naming it (exit 7; status 1 stays fedddp's bugs), with the
    user's traceback kept as its cause for FEDDDP_TRACEBACK=1."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the user's code is one line
        cause = " ".join(str(exc).split())
        raise PluginError(f"{key}: {name} raised {type(exc).__name__}: {cause} (in your code, not fedddp; "
                          "FEDDDP_TRACEBACK=1 prints its traceback)") from exc


def get(path: str, key: str, what: str | None = None):
    """The object at ``path``, imported once per process; ``what``: what the attribute must be,
    for a key not in KEYS (run.callbacks)."""
    if path not in _objects:
        _objects[path] = _import(path, key, what)
    return _objects[path][1]


_objects: dict[str, tuple[object, object]] = {}


def module_of(path: str):
    """The module ``path`` was imported from (``get`` first): its LOCAL_RULE and WEIGHTING."""
    return _objects[path][0]
