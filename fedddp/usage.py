"""What ``python -m fedddp`` says about itself: the usage (no arguments), ``--help`` (every config
key, the algorithms, the built-in rules' parameters), ``--help RULE`` (one algorithm's or rule's
parameters, a plugin's ``module:attr`` too) and ``--version``."""

from __future__ import annotations

import importlib.metadata
import textwrap

from . import config, plugins
from .errors import ConfigError, close_match
from .registry import LOCAL_RULES, SERVER_RULES  # filled as fedddp.algorithms imports the rules

# The registry and the rules import torch (seconds on a busy machine): --help prints the command
# and the config keys first, and imports them only for what names the rules.


def version() -> str:
    """The installed distribution's version (fedddp.__version__ is the package's, above this layer)."""
    try:
        return f"fedddp {importlib.metadata.version('fedddp')}"
    except importlib.metadata.PackageNotFoundError:
        return "fedddp (not installed, so no version: pip install -e .)"


def short(doc: str) -> str:
    """The command's first line and its command lines: what to type, in a few lines."""
    title, commands = doc.strip().split("\n\n")[:2]
    return f"{title}\n\n{commands}"


def full(doc: str) -> str:
    """--help: the command's doc, every config key, the algorithms and the built-in rules' parameters."""
    return keys(doc) + "\n\n" + rules()


def keys(doc: str) -> str:
    """--help's first part, which needs no torch: the command's doc and every config key."""
    return doc.strip() + "\n\nConfig keys (TOML tables; override as section.key=value):\n" + config.describe()


def rules() -> str:
    """--help's second part: the algorithms and the built-in rules' parameters."""
    from . import algorithms
    from .algorithms import ALGORITHMS

    names = textwrap.fill(", ".join(n for n in ALGORITHMS if not plugins.is_path(n)), 96,
                          initial_indent="  ", subsequent_indent="  ")
    return ("Algorithms (algorithm.name; python -m fedddp --help NAME shows its rules and "
            "parameters; docs/algorithms.md):\n" + names + "\n  or your own server rule, \"module:attr\" "
            "(docs/extending.md): python -m fedddp --help module:attr lists its parameters"
            "\n\nThe built-in rules' own parameters ([algorithm.params], or [algorithm.params.RULE] for one "
            "rule; the old flat key algorithm.NAME still works):\n" + algorithms.describe_params())


def _register(name: str) -> None:
    """A plugin's rule registered as a run that names it would register it (ConfigError if not)."""
    from . import checks
    from .client.rules import LocalRule

    rule = plugins.get(name, "algorithm.name")
    key = "algorithm.local" if isinstance(rule, type) and issubclass(rule, LocalRule) else "algorithm.name"
    errors = checks.register_plugins({key: name})
    if errors:
        raise ConfigError(errors[0])


def rule(name: str) -> str:
    """--help NAME: the rules of an algorithm, or one server or local rule, with their parameters
    (default, doc) and the TOML table that sets them for it alone."""
    from .algorithms import ALGORITHMS  # importing it registers the built-in rules

    if plugins.is_path(name) and name not in SERVER_RULES and name not in LOCAL_RULES:
        _register(name)
    if name in ALGORITHMS:
        local, server = ALGORITHMS[name]
        owners = [(server, SERVER_RULES[server], "server rule"), (local, LOCAL_RULES[local], "local rule")]
        head = f"{name}: algorithm.name; its clients train with the {local} local rule, its server aggregates " \
               f"with the {server} server rule"
    elif name in SERVER_RULES or name in LOCAL_RULES:
        kind = "server rule" if name in SERVER_RULES else "local rule"
        owners = [(name, SERVER_RULES.get(name) or LOCAL_RULES[name], kind)]
        head = f"{name}: a {kind} ({'algorithm.name' if name in SERVER_RULES else 'algorithm.local'})"
    else:
        known = list(ALGORITHMS) + list(SERVER_RULES) + list(LOCAL_RULES)
        near = close_match(name, known)
        raise ConfigError(f"--help {name}: no algorithm or rule of that name{f', did you mean {near}?' if near else ''} "
                          "(python -m fedddp --help lists them; a plugin is module:attr)")
    lines = [head]
    for owner, obj, kind in owners:
        docs = getattr(obj, "param_docs", {}) or {}
        lines += [f"  algorithm.params.{key} = {config._toml_value(default)}  ({owner} {kind})\n"
                  f"      {docs.get(key) or '(no doc: the rule declares none in param_docs)'}"
                  for key, default in obj.params.items()]
    if len(lines) == 1:
        return head + "; it has no parameters of its own"
    table = f'"{name}"' if plugins.is_path(name) else name
    return "\n".join(lines + [f"Set them for it alone in [algorithm.params.{table}], or on the command line "
                              f"algorithm.params.{name}.NAME=VALUE."])
