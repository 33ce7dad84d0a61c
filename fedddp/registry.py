"""The names fedddp knows, at the bottom of the import graph: server rules, local rules, the
algorithms that pair them, each algorithm's client weighting, and the data sets.

Every rule joins through one path: ``add_server``, ``add_local`` and ``add_algorithm``, which
refuse a name already taken. Built-in rules call them from their own modules (a server rule in
``strategies/NAME.py``, a local rule in ``client/rules/NAME.py``, an algorithm that is not a row
of ``BUILT_IN`` beside its server rule); plugins (``module:attr``) register the same way when a
config names them (``checks.register_plugins``). Everything above reads these dicts; nothing
here imports fedddp. ``snapshot`` and ``restore`` (or ``kept``) let a test register and leave
the tables as it found them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

# name -> Strategy (fedddp.strategies.base): the server rules
SERVER_RULES: dict[str, object] = {}
# name -> LocalRule subclass (fedddp.client.rules): how a client trains
LOCAL_RULES: dict[str, type] = {}

# algorithm.name -> (local rule in fedddp.client, server rule in fedddp.strategies, the client
# weights p_k its paper or reference code averages with: samples n_k / n over the sampled clients,
# or uniform 1/K; algorithm.weighting = auto takes it, sources in docs/algorithms.md). One line
# an algorithm; a new one is one line here or one add_algorithm call in its own file.
BUILT_IN: dict[str, tuple[str, str, str]] = {
    "fedavg": ("plain", "fedavg", "samples"),            # McMahan et al. 2017, n_k / n
    "fedmom": ("plain", "fedmom", "samples"),            # seed 004, eq. 5
    "fedcong": ("plain", "fedcong", "samples"),          # seed 004, eq. 1 (eq. 3 is silent within a group)
    "fedgma": ("plain", "fedgma", "samples"),            # seed 001, sec. 3: by the clients' numbers of examples
    "cgw": ("plain", "cgw", "samples"),                  # seed 000, eq. 8: corrects W_FedAvg
    "feder": ("plain", "feder", "uniform"),              # seed 003, Alg. 4: its own per-layer weights, 1/K elsewhere
    "fedprox": ("prox", "fedavg", "samples"),            # FedProx's code by sample count (its Alg. 2 samples by p_k)
    "scaffold": ("scaffold", "scaffold", "uniform"),     # SCAFFOLD Alg. 1: 1/|S|
    "fednova": ("plain", "fednova", "samples"),          # FedNova: p_i = n_i / n
    "moon": ("moon", "fedavg", "samples"),               # MOON Alg. 1 and code: |D_i| / |D| over the round's clients
    "fedsam": ("sam", "fedavg", "uniform"),              # FL-Simulator's FedSAM (seed 002's baselines): mean
    "fedgam": ("gam", "fedavg", "uniform"),              # seed 002, Alg. 1 line 12
    "fedgam_cv": ("gam_cv", "fedgam_cv", "uniform"),     # seed 002, Alg. 2 line 15
    "fedsmoo": ("smoo", "fedsmoo", "uniform"),           # FL-Simulator's FedSMOO: mean
    "dpfedavg": ("plain", "dpfedavg", "uniform"),        # McMahan et al. 2018, w_k = 1: one client moves w by <= C / K
    "dpfedmom": ("plain", "dpfedmom", "uniform"),        # DP-FedAvg's mechanism, then FedMom's step (post-processing)
    "fedadam": ("plain", "fedadam", "samples"),          # Reddi et al. 2021, Alg. 2: FedAvg's weighted update
    "fedyogi": ("plain", "fedyogi", "samples"),          # Reddi et al. 2021, Alg. 2, as FedAdam
    "fedadagrad": ("plain", "fedadagrad", "samples"),    # Reddi et al. 2021, Alg. 2, as FedAdam
    "fedmedian": ("plain", "fedmedian", "uniform"),      # Yin et al. 2018: unweighted (weights only train_loss)
    "fedtrimmedavg": ("plain", "fedtrimmedavg", "uniform"),  # Yin et al. 2018: unweighted
    "krum": ("plain", "krum", "uniform"),                # Blanchard et al. 2017: Multi-Krum's plain mean
    "bulyan": ("plain", "bulyan", "uniform"),            # El Mhamdi et al. 2018: unweighted
}

# name -> (local rule, server rule) and name -> weighting, of the built-ins and the plugins a
# config registered (checks.register_plugins)
ALGORITHMS: dict[str, tuple[str, str]] = {name: (local, server) for name, (local, server, _) in BUILT_IN.items()}
WEIGHTING: dict[str, str] = {name: weighting for name, (_, _, weighting) in BUILT_IN.items()}


def weighting_of(hp) -> str:
    """The run's client weighting, samples or uniform: algorithm.weighting, or with auto the one of
    algorithm.name's paper (WEIGHTING). ``hp`` is an AlgorithmConfig."""
    weighting = getattr(hp, "weighting", "samples")
    return WEIGHTING[hp.name] if weighting == "auto" else weighting


def resolve(hp) -> tuple[str, str]:
    """(local rule, server rule) of an AlgorithmConfig: the name's pair, with hp.local if not auto."""
    local, server = ALGORITHMS[hp.name]
    return (local if hp.local == "auto" else hp.local), server


class DuplicateName(ValueError):
    """A rule or algorithm registered under a name already taken."""


def _refuse_taken(table: dict, name: str, kind: str) -> None:
    if name in table:
        raise DuplicateName(f"{kind} {name!r} is registered twice; give the new one another name")


def add_server(strategy):
    """Registers a server rule (a fedddp.strategies.Strategy) under ``strategy.name``."""
    _refuse_taken(SERVER_RULES, strategy.name, "server rule")
    SERVER_RULES[strategy.name] = strategy
    return strategy


def add_local(rule: type, name: str | None = None) -> type:
    """Registers a local rule (a LocalRule subclass) under ``name``, by default its ``name``;
    usable as a class decorator."""
    name = rule.name if name is None else name
    _refuse_taken(LOCAL_RULES, name, "local rule")
    LOCAL_RULES[name] = rule
    return rule


def add_algorithm(name: str, local: str, server: str, weighting: str) -> None:
    """Registers ``algorithm.name = name``: the local and server rules it pairs and the client
    weighting (samples or uniform) its paper averages with."""
    if weighting not in ("samples", "uniform"):
        raise ValueError(f"algorithm {name!r}: weighting must be samples or uniform, not {weighting!r}")
    _refuse_taken(ALGORITHMS, name, "algorithm")
    ALGORITHMS[name] = (local, server)
    WEIGHTING[name] = weighting


_TABLES = (SERVER_RULES, LOCAL_RULES, ALGORITHMS, WEIGHTING)


def snapshot() -> tuple[dict, ...]:
    """Copies of every table, for ``restore``."""
    return tuple(dict(table) for table in _TABLES)


def restore(saved: tuple[dict, ...]) -> None:
    """The tables as ``snapshot`` copied them (their identity kept: modules hold references)."""
    for table, content in zip(_TABLES, saved):
        table.clear()
        table.update(content)


@contextlib.contextmanager
def kept():
    """The tables restored on exit, whatever was registered inside."""
    saved = snapshot()
    try:
        yield
    finally:
        restore(saved)


# data.name -> the function that builds it (fedddp.data.build). The built-in names stand here, so a
# config is checked (config.DataConfig's choices) before fedddp.data, and torch, is imported; each
# builder fills its entry when fedddp.data.build is imported (``builds``).
DATA_SETS: dict[str, Callable | None] = dict.fromkeys((
    "synthetic", "mnist", "fashionmnist", "cifar10", "cifar100", "cmapss", "femnist", "colored_mnist", "tensors",
    "clients_dir"))


def builds(name: str) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` builds data.name = ``name``, a name DATA_SETS declares."""
    if name not in DATA_SETS:
        raise KeyError(f"data set {name!r} is not declared in fedddp.registry.DATA_SETS")

    def register(fn: Callable) -> Callable:
        DATA_SETS[name] = fn
        return fn
    return register


# algorithm.name when a config names none
DEFAULT_ALGORITHM = "fedavg"

# The old flat keys of the rules' parameters (algorithm.NAME) and the rules that read each: the
# config translates them into the rules' tables (fedddp.config.ALIASES, and its comment says how).
ALIASES: dict[str, tuple[str, ...]] = {
    "server_momentum": ("fedmom", "dpfedmom"), "cong_alpha": ("fedcong",),
    "gma_threshold": ("fedgma",), "gma_grad": ("fedgma",), "gma_mask": ("fedgma",),
    "cgw_alpha": ("cgw",), "feder_unfold": ("feder",),
    "dp_clip": ("dpfedavg", "dpfedmom"), "dp_noise": ("dpfedavg", "dpfedmom"), "dp_delta": ("dpfedavg", "dpfedmom"),
    "prox_mu": ("prox",), "scaffold_control": ("scaffold",),
    "moon_mu": ("moon",), "moon_tau": ("moon",), "moon_proj_dim": ("moon",),
    "sam_rho": ("sam", "smoo", "fedsmoo"), "gam_rho": ("gam", "gam_cv"), "gam_alpha": ("gam", "gam_cv"),
    "smoo_lambda": ("smoo",),
}
