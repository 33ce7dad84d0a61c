"""The names fedddp knows, at the bottom of the import graph: server rules, local rules, the
algorithms that pair them, and each algorithm's client weighting.

Built-in rules register from their own modules (``strategies.base.register``, the table at the
end of ``client/rules.py``); plugins (``module:attr``) register the same way when a config names
them (``checks.register_plugins``). Everything above reads these dicts; nothing here imports
fedddp.
"""

from __future__ import annotations

# name -> Strategy (fedddp.strategies.base): the server rules
SERVER_RULES: dict[str, object] = {}
# name -> LocalRule subclass (fedddp.client.rules): how a client trains
LOCAL_RULES: dict[str, type] = {}

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
    "dpfedavg": ("plain", "dpfedavg"),
}


# name -> the client weights p_k its paper or reference code averages with (algorithm.weighting =
# auto; the sources are in docs/algorithms.md). samples: n_k / n over the sampled clients; uniform: 1/K.
WEIGHTING: dict[str, str] = {
    "fedavg": "samples",     # McMahan et al. 2017, n_k / n
    "fedmom": "samples",     # seed 004, eq. 5
    "fedcong": "samples",    # seed 004, eq. 1 (eq. 3 is silent within a group)
    "fedgma": "samples",     # seed 001, sec. 3: weighted by the clients' numbers of examples
    "cgw": "samples",        # seed 000, eq. 8: corrects W_FedAvg
    "feder": "uniform",      # seed 003, Alg. 4: its own per-layer weights, 1/K where it has none
    "fedprox": "samples",    # FedProx's code weights by sample count (its Alg. 2 samples by p_k instead)
    "scaffold": "uniform",   # SCAFFOLD Alg. 1: 1/|S|
    "fednova": "samples",    # FedNova: p_i = n_i / n
    "moon": "samples",       # MOON Alg. 1 and code: |D_i| / |D| over the round's clients
    "fedsam": "uniform",     # FL-Simulator's FedSAM (the code seed 002's baselines follow): mean
    "fedgam": "uniform",     # seed 002, Alg. 1 line 12
    "fedgam_cv": "uniform",  # seed 002, Alg. 2 line 15
    "fedsmoo": "uniform",    # FL-Simulator's FedSMOO: mean
    "dpfedavg": "uniform",   # McMahan et al. 2018 with w_k = 1: one client's influence is at most C / K
}


def weighting_of(hp) -> str:
    """The run's client weighting, samples or uniform: algorithm.weighting, or with auto the one of
    algorithm.name's paper (WEIGHTING). ``hp`` is an AlgorithmConfig."""
    weighting = getattr(hp, "weighting", "samples")
    return WEIGHTING[hp.name] if weighting == "auto" else weighting


def resolve(hp) -> tuple[str, str]:
    """(local rule, server rule) of an AlgorithmConfig: the name's pair, with hp.local if not auto."""
    local, server = ALGORITHMS[hp.name]
    return (local if hp.local == "auto" else hp.local), server
