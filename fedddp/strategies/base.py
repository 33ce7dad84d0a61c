"""What every server rule is built from: the Strategy record, its registration, the client
weights and the fused weighted mean. The rules' interface is in the package's docstring
(fedddp/strategies/__init__.py)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

from .. import plugins
from ..blocks import block_slices
from ..registry import SERVER_RULES, add_server, weighting_of
from . import kernels

Stacks = dict[str, torch.Tensor]
State = dict[str, torch.Tensor]
AggregateFn = Callable[[torch.Tensor, Stacks, State, object], tuple[torch.Tensor, State, dict]]


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True)
class Span:
    """The columns [start, stop) of the flat vector that one rank aggregates: whole blocks of
    ``width`` columns (fedddp.blocks), the rank's range in a sharded round (run.aggregation =
    sharded), or the whole vector in one process. A rule's ``aggregate_span`` works on it block by
    block (``blocks``): each block sees the same inputs on any number of ranks (its columns of
    every client, in client-id order, and the global sums), so its outputs are the same bits. A
    sum over the whole vector is one float64 row per block, added over every rank's blocks in
    block order (``total``); ``gather_vector`` makes a range the whole vector on every rank."""

    start: int
    stop: int
    numel: int                    # P: the whole vector
    width: int                    # columns per block
    device: torch.device
    # [b, X] rows of this rank's blocks -> [NB, X] rows of every block, in block order
    gather_blocks: Callable[[torch.Tensor], torch.Tensor] = _same
    # [stop - start] this range -> [P] the whole vector, on every rank
    gather_vector: Callable[[torch.Tensor], torch.Tensor] = _same

    @staticmethod
    def whole(numel: int, width: int, device) -> "Span":
        """Every block in this process: the gathered form's sums, in the same block order."""
        return Span(0, numel, numel, width, torch.device(device))

    @property
    def blocks(self) -> list[slice]:
        """The range's blocks as slices of its columns (counted from ``start``), in order."""
        return block_slices(self.start, self.stop, self.width)

    def total(self, rows: list[torch.Tensor], size: int) -> torch.Tensor:
        """sum over the vector's blocks of a float64 row [size] each: this rank's ``rows`` (one per
        block of ``blocks``, in order) with the other ranks', added in block order as one running
        sum (row 0, plus row 1, ...; torch.cumsum on the CPU), whatever the rank of a block."""
        mine = (torch.stack([r.to(torch.float64).reshape(size) for r in rows]) if rows else
                torch.zeros(0, size, dtype=torch.float64, device=self.device))
        every = self.gather_blocks(mine.to(self.device)).cpu()
        return torch.cumsum(every, 0)[-1].to(self.device)


def block_width(stacks: Stacks, numel: int) -> int:
    """The run's block width (the static ``aggregation_block``), or one block of the whole vector
    for a caller that passes none (tests, benchmarks): the sums of a gathered rule then run in
    one piece."""
    width = stacks.get("aggregation_block")
    return int(width) if width is not None else max(numel, 1)

ALWAYS = frozenset({"params_KP", "num_samples_K", "train_loss_K"})


def _no_state(global_P: torch.Tensor, hp) -> State:
    return {}


@dataclass(frozen=True)
class Strategy:
    """A server rule: ``aggregate(global_P, stacks, state, hp) -> (new_global_P, new_state,
    diagnostics)`` once a round on rank 0 (run.aggregation = gather; with sharded, ``aggregate_span``
    on every rank over its range), with what it declares it needs. ``stacks`` holds the
    report fields named in ``needs`` (beyond params_KP, num_samples_K and train_loss_K, which every
    rule gets), ``state`` the dict of tensors ``init_state(global_P, hp)`` made at round 1 (then
    what the last call returned; checkpointed), ``hp`` the run's AlgorithmConfig (its own values:
    ``hp.params``, declared with defaults in ``params``). Fields and shapes: the package docstring
    (fedddp/strategies/__init__.py); a worked rule: docs/extending.md."""

    name: str
    aggregate: AggregateFn
    needs: frozenset[str] = frozenset()
    init_state: Callable[[torch.Tensor, object], State] = _no_state
    # state entries every rank needs before local training (e.g. SCAFFOLD's server control c):
    # broadcast from rank 0 with the global model each round (run.aggregation = gather), or
    # all-gathered from the ranks' ranges with it (sharded), so every rank holds them whole.
    client_visible: tuple[str, ...] = ()
    # report fields needed under given hyper-parameters, when that depends on them (``needs``
    # is then the widest set, for documentation)
    needs_fn: Callable[[object], frozenset[str]] | None = None
    doc: str = ""
    # ledger(state, static_stacks, hp) -> diagnostics describing the state itself, written every
    # round, also one without reports that leaves the state as it was (DP-FedAvg's epsilon)
    ledger: Callable[[State, Stacks, object], dict] | None = None
    # spent(state, static_stacks, hp) -> the privacy spent so far, epsilon (DP-FedAvg): written as
    # metrics.jsonl's epsilon on the rounds that evaluate and the last (an accountant may take
    # seconds), also a round without reports
    spent: Callable[[State, Stacks, object], float] | None = None
    # a differentially private mechanism (DP-FedAvg): run.sampling = auto is poisson for it, and
    # under Poisson sampling it aggregates every round, also one without reports (its noise is
    # released whatever the cohort)
    private: bool = False
    # the rule's own hyperparameters in [algorithm.params], name -> default (its type is the
    # type a given value must have; an int is taken for a float), read as hp.params[name]
    params: dict = dataclasses.field(default_factory=dict)
    # name -> one line for --help and the docs (fedddp.params)
    param_docs: dict = dataclasses.field(default_factory=dict)
    # check_params(params) -> one error line per bad value (params with defaults filled in)
    check_params: Callable[[dict], list[str]] | None = None
    # the rule reads hp.server_lr (it has a server step for it to scale); otherwise a value
    # other than 1 is a configuration error rather than silently ignored
    takes_server_lr: bool = False
    # The rule on one rank's range of the flat vector (run.aggregation = sharded), called on every
    # rank: aggregate_span(global_P, stacks, state, hp, span) -> (new range, new state,
    # diagnostics). global_P, the [K, P] stacks, param_mask_P and the state's [P] entries are cut
    # to the span's columns (conv_runs_R3 counted from its start); a client-visible entry may come
    # back whole ([P], e.g. after span.gather_vector), any other [P] entry as its range; the
    # diagnostics are the whole round's, the same on every rank. None: the rule cannot work on a
    # range and runs gathered on rank 0 (the start line says so).
    aggregate_span: Callable | None = None
    # start_words(params, expected cohort, P) -> what the start line adds about this rule before
    # round 1 (DP-FedAvg: its noise against its clip); "" for nothing
    start_words: Callable[[dict, float, int], str] | None = None
    # check_config(cfg, local, params) -> one error line per thing this rule cannot do in the run
    # cfg beside the local rule ``local`` (params: the rules' resolved values; FedNova's optimizer,
    # DP-FedAvg's weighting and sampling), said when the config loads and by --check
    check_config: Callable[[object, str, dict], list[str]] | None = None
    # closing_words(last metrics row, params) -> what the closing line adds about this rule once the
    # run is done (DP-FedAvg: the final epsilon); "" for nothing
    closing_words: Callable[[dict, dict], str] | None = None
    # the rule's step is FedAvg's weighted mean, the one asynchronous mode (run.mode = async,
    # FedBuff) applies to its buffered updates: the algorithms with this server rule run async
    buffered: bool = False

    def needs_for(self, hp) -> frozenset[str]:
        return self.needs_fn(hp) if self.needs_fn is not None else self.needs




def gathered(aggregate_span: Callable) -> AggregateFn:
    """A rule's gathered form derived from its span form: the whole vector as one range of the
    run's block width (``Span.whole``), so a rule is written once, on a range, and both servers
    run the same function."""
    def aggregate(global_P, stacks, state, hp):
        numel = global_P.numel()
        return aggregate_span(global_P, stacks, state, hp, Span.whole(numel, block_width(stacks, numel),
                                                                        global_P.device))
    aggregate.__doc__, aggregate.__module__ = aggregate_span.__doc__, aggregate_span.__module__
    return aggregate


def register(strategy: Strategy) -> Strategy:
    """A built-in server rule registered by name (registry.add_server: a taken name is refused)."""
    return add_server(strategy)


def plugin_form(strategy: Strategy, name: str) -> Strategy:
    """A plugin server rule, registered under its import path ``name``: its aggregate runs with
    every helper it calls (weighted_mean_P) in the torch-op form on every device, since only the
    built-in rules have fused kernels. What its functions raise is the user's (plugins.calling)."""
    def guarded(fn, what):
        def call(*args):
            with plugins.calling("algorithm.name", f"{name} ({what})"):
                return fn(*args)
        return call if fn is not None and fn is not _no_state else fn

    def aggregate(global_P, stacks, state, hp):
        with kernels.forced("torch"):
            return strategy.aggregate(global_P, stacks, state, hp)

    def aggregate_span(global_P, stacks, state, hp, span):
        with kernels.forced("torch"):
            return strategy.aggregate_span(global_P, stacks, state, hp, span)

    span_form = guarded(aggregate_span, "its aggregate_span") if strategy.aggregate_span is not None else None
    return dataclasses.replace(strategy, name=name, aggregate=guarded(aggregate, "its aggregate"),
                               aggregate_span=span_form,
                               **{f: guarded(getattr(strategy, f), f"its {f}")
                                  for f in ("init_state", "ledger", "spent", "check_params", "check_config",
                                          "closing_words", "start_words")})


def get(name: str) -> Strategy:
    return SERVER_RULES[name]


def client_weights_K(stacks: Stacks, hp) -> torch.Tensor:
    """p_k summing to 1: n_k / n (samples) or 1/K (uniform), as hp.weighting says; auto (a config
    not resolved by config.load) is the algorithm's own, fedddp.registry.weighting_of."""
    n_K = stacks["num_samples_K"].to(stacks["params_KP"].dtype)
    if weighting_of(hp) == "uniform":
        n_K = torch.ones_like(n_K)
    return n_K / n_K.sum()


def weighted_mean_P(weights_K: torch.Tensor, rows_KP: torch.Tensor) -> torch.Tensor:
    """sum_k w_k rows_k in one pass over [K, P]: the fused kernel, C on CPU or Triton on CUDA
    (whose client-order sums every other kernel of its form repeats, so a rule's neutral
    setting gives these bits), else one matrix-vector product."""
    lib = kernels.lib(rows_KP, rule="fedavg")
    if lib is None:
        return weights_K.to(rows_KP.dtype) @ rows_KP
    return kernels.mean(lib, rows_KP, weights_K)


def server_step(global_P: torch.Tensor, target_P: torch.Tensor, server_lr: float) -> torch.Tensor:
    """w + eta (target - w): the server's step of size eta = hp.server_lr along the rule's update
    target - w (FedOpt's server SGD, Reddi et al. 2021). eta = 1 returns target itself, so the
    default keeps every rule's bits; otherwise torch.lerp, as SCAFFOLD's eta_g always was."""
    server_lr = float(server_lr)
    return target_P if server_lr == 1.0 else torch.lerp(global_P, target_P, server_lr)


def column_block(num_rows: int, device: torch.device) -> int:
    """Columns per block for rules that need [K, block] temporaries: about 1 MiB of float32 per
    temporary on CPU (fits in L2), 256 MiB on an accelerator (few kernel launches)."""
    budget = 1 << 18 if device.type == "cpu" else 1 << 26
    return max(256, budget // max(num_rows, 1))


def min_agreeing(fraction: float, num_clients: int) -> int:
    """Smallest integer count >= fraction * K, with a 1e-9 slack: 0.28 * 25 is 7.000000000000001."""
    return max(0, math.ceil(fraction * num_clients - 1e-9))


