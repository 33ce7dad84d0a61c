"""The checks a rule's own hyperparameters share, for its ``check_params`` (built-in rules and
plugins alike): each returns one error line per bad value, naming ``algorithm.params.NAME``.

A rule declares its parameters next to its code: ``params`` (name -> default; a given value must
have the default's type, an int is taken for a float), ``param_docs`` (name -> one line, shown by
``python -m fedddp --help``) and ``check_params(params) -> [error lines]``. Nothing here imports
fedddp.
"""

from __future__ import annotations


def _bad(name: str, value, what: str) -> str:
    return f"algorithm.params.{name}: must be {what}, got {value!r}"


def at_least_zero(params: dict, *names: str) -> list[str]:
    return [_bad(n, params[n], ">= 0") for n in names if not params[n] >= 0]


def positive(params: dict, *names: str) -> list[str]:
    return [_bad(n, params[n], "> 0") for n in names if not params[n] > 0]


def in_unit(params: dict, *names: str) -> list[str]:
    """In [0, 1]: a fraction of clients, a threshold, a momentum."""
    return [_bad(n, params[n], "in [0, 1]") for n in names if not 0.0 <= params[n] <= 1.0]


def one_of(params: dict, name: str, choices: tuple[str, ...]) -> list[str]:
    return [] if params[name] in choices else [_bad(name, params[name], f"one of {', '.join(choices)}")]
