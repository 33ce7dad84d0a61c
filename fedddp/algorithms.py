"""``algorithm.name`` -> the pair (local rule, server rule) it runs.

A paper's algorithm is a client-side local rule (how a client trains) and a server rule (how
rank 0 combines the reports). Keeping the two apart is what lets them compose:
``algorithm.local`` replaces the name's local rule (e.g. FedProx clients under FedGMA's server,
GAM clients under FedER's). A pair that cannot work (a rule that reads server state the server
rule does not keep, or a server rule that needs a report the local rule does not write) is a
configuration error naming both.
"""

from __future__ import annotations

from . import strategies, tasks

# name -> (local rule in fedddp.client, server rule in fedddp.strategies)
ALGORITHMS: dict[str, tuple[str, str]] = {
    "fedavg": ("plain", "fedavg"),
    "fedmom": ("plain", "fedmom"),
    "fedcong": ("plain", "fedcong"),
    "fedgma": ("plain", "fedgma"),
    "cgw": ("plain", "cgw"),
    "feder": ("plain", "feder"),
    "fedprox": ("prox", "fedavg"),
    "scaffold": ("scaffold", "scaffold"),
    "fednova": ("plain", "fednova"),
    "moon": ("moon", "fedavg"),
    "fedsam": ("sam", "fedavg"),
    "fedgam": ("gam", "fedavg"),
    "fedgam_cv": ("gam_cv", "fedgam_cv"),
    "fedsmoo": ("smoo", "fedsmoo"),
}


def resolve(cfg) -> tuple[str, str]:
    """(local rule, server rule) of the run: the name's pair, with algorithm.local if not auto."""
    local, server = ALGORITHMS[cfg.algorithm.name]
    return (local if cfg.algorithm.local == "auto" else cfg.algorithm.local), server


def _check_pair(cfg, local: str, server: str) -> list[str]:
    from .client import rules  # late: the client package imports the data and model code
    name, errors = cfg.algorithm.name, []
    if local not in rules.RULES:
        return [f"algorithm.local: unknown local rule {local!r} (valid: auto, {', '.join(rules.RULES)})"]
    rule, strategy = rules.RULES[local], strategies.REGISTRY[server]
    pair = f"algorithm.local = {local} with the {server} server rule (algorithm.name = {name})"
    missing = [k for k in rule.reads_server if k not in strategy.client_visible]
    if missing:
        keepers = [s.name for s in strategies.REGISTRY.values() if set(missing) <= set(s.client_visible)]
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
    if local == "moon":
        if cfg.algorithm.moon_tau <= 0:
            errors.append(f"algorithm.moon_tau: must be > 0, got {cfg.algorithm.moon_tau}")
        if cfg.algorithm.moon_proj_dim < 0:
            errors.append(f"algorithm.moon_proj_dim: must be >= 0, got {cfg.algorithm.moon_proj_dim}")
        if tasks.of_data(cfg.data.name) == "regression":
            # MOON's projection head sits between the features and a classifier, and its
            # contrastive term is part of a cross-entropy objective: neither exists for a regressor.
            errors.append(f"algorithm.local: {pair}: MOON is defined for classification; data.name = "
                          f"{cfg.data.name} is a regression task (choose another algorithm.name or "
                          "algorithm.local)")
    from .client.optim import check_optimizer
    return errors + check_optimizer(cfg.train)


def check_algorithm(cfg) -> list[str]:
    name = cfg.algorithm.name
    if name not in ALGORITHMS:
        return [f"algorithm.name: unknown algorithm {name!r} (valid: {', '.join(ALGORITHMS)})"]
    _, server = ALGORITHMS[name]
    if server not in strategies.REGISTRY:
        return [f"algorithm.name: {name!r} needs the server rule {server!r}, which is not available"]
    errors = _check_pair(cfg, resolve(cfg)[0], server)
    if server == "feder" and cfg.model.name not in ("cnn", "resnet18"):
        errors.append(f"algorithm.name: feder weighs conv layers by effective rank; model.name = "
                      f"{cfg.model.name} has no conv layer (use cnn or resnet18)")
    return errors
