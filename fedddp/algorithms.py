"""``algorithm.name`` -> the pair (local rule, server rule) it runs.

A paper's algorithm is a client-side local rule (how a client trains) and a server rule (how
rank 0 combines the reports). Keeping the two apart is what lets them compose.
"""

from __future__ import annotations

from . import strategies

# name -> (local rule in fedddp.client, server rule in fedddp.strategies)
ALGORITHMS: dict[str, tuple[str, str]] = {
    "fedavg": ("plain", "fedavg"),
    "fedmom": ("plain", "fedmom"),
    "fedcong": ("plain", "fedcong"),
    "fedgma": ("plain", "fedgma"),
    "cgw": ("plain", "cgw"),
    "feder": ("plain", "feder"),
}


def resolve(cfg) -> tuple[str, str]:
    return ALGORITHMS[cfg.algorithm.name]


def check_algorithm(cfg) -> list[str]:
    name = cfg.algorithm.name
    if name not in ALGORITHMS:
        return [f"algorithm.name: unknown algorithm {name!r} (valid: {', '.join(ALGORITHMS)})"]
    _, server = ALGORITHMS[name]
    if server not in strategies.REGISTRY:
        return [f"algorithm.name: {name!r} needs the server rule {server!r}, which is not available"]
    errors = []
    if server == "feder" and cfg.model.name not in ("cnn", "resnet18"):
        errors.append(f"algorithm.name: feder weighs conv layers by effective rank; model.name = "
                      f"{cfg.model.name} has no conv layer (use cnn or resnet18)")
    return errors
