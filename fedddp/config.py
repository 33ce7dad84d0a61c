"""The experiment configuration: a typed dataclass tree mapped from TOML, one doc per field.

``load(path, overrides)`` reads a TOML file, applies dotted ``section.key=value`` overrides and
checks everything at once: unknown keys, wrong types, values outside their choices and
impossible combinations are collected with their dotted paths and raised as one ConfigError.
``dumps(cfg)`` writes the resolved config back as TOML (``run.out_dir/config.toml``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import plugins, registry, tasks
from .errors import ConfigError, close_match


# An int, or "auto": resolved when the run starts (run.parallel_clients).
IntOrAuto = int | typing.Literal["auto"]


# A number field's range (opt's ``bound``): its test and the words of its refusal.
BOUNDS = {">0": (lambda v: v > 0, "must be > 0"), ">=0": (lambda v: v >= 0, "must be >= 0"),
          "[0, 1)": (lambda v: 0 <= v < 1, "must be in [0, 1)"), "[0, 1]": (lambda v: 0 <= v <= 1, "must be in [0, 1]")}


def opt(default: Any, doc: str, choices: tuple | None = None, plugin: bool = False, bound: str | None = None):
    """A config field: its default, the one-line doc shown in ``--help`` and the docs, (for
    strings) the valid choices, whether a ``module:attr`` import path may stand for a choice
    (fedddp.plugins), and (for numbers) the range it must lie in (a key of BOUNDS; check_fields
    refuses a value outside it)."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"doc": doc, "choices": None})
    assert bound is None or bound in BOUNDS, bound
    return field(default=default, metadata={"doc": doc, "choices": choices, "plugin": plugin, "bound": bound})


@dataclass(frozen=True)
class RunConfig:
    rounds: int = opt(20, "Number of communication rounds (rounds are counted from 1).", bound=">0")
    seed: int = opt(0, "Seed for training: model initialisation, client sampling and local shuffling. "
                       "The data (partition, splits, synthetic samples, colours) follow data.seed, so "
                       "runs that differ only in run.seed train on the same clients.", bound=">=0")
    out_dir: str = opt("runs/default", "Output folder: config.toml, metrics.jsonl, metrics.csv, clients.jsonl, "
                                       "final.pt, checkpoints/ (and tensorboard/ with run.tensorboard).")
    clients_per_round: int = opt(0, "Clients sampled per round (K). 0: use participation instead.", bound=">=0")
    participation: float = opt(1.0, "Fraction of clients sampled per round when clients_per_round = 0.", bound="[0, 1]")
    sampling: str = opt("auto", "How a round's clients are drawn, from (seed, round) alone. fixed: exactly K "
                                "(clients_per_round, else participation x N rounded) of the N clients, "
                                "uniformly without replacement. poisson: each client independently with "
                                "probability q (participation, or clients_per_round / N when that is set), "
                                "drawn per (seed, round, client id): q N clients on average, and a round "
                                "may have none (the model then stays, except under a DP rule, whose noise "
                                "is released every round). auto: poisson for the DP rules (dpfedavg, "
                                "dpfedmom: the privacy accountant's sampling), fixed for the others; "
                                "resolved when the config loads (docs/algorithms.md).",
                        ("auto", "fixed", "poisson"))
    eval_every: int = opt(1, "Evaluate the global model on the test set every this many rounds (and at the end).",
                          bound=">0")
    client_eval_every: int = opt(0, "Client (federated) evaluation every this many rounds (and at the end); 0: "
                                    "off. A cohort of clients (run.client_eval_clients) evaluates the round's "
                                    "global model on its own held-out samples (data.client_test_fraction, which "
                                    "must then be > 0), split over ranks as training is: metrics.jsonl gains "
                                    "client_eval_* keys (the metric's mean, sample-weighted mean and 10/50/90th "
                                    "percentiles over the cohort, the loss's mean and weighted mean) and "
                                    "client_eval.jsonl a row per (round, client) (docs/running.md, \"Client "
                                    "evaluation\"). Training is unchanged by it.", bound=">=0")
    client_eval_clients: int = opt(0, "Clients a round's client evaluation takes (at most data.num_clients): drawn "
                                      "from (run.seed, round) among the clients with held-out samples, the "
                                      "same on any world size; 0: every client with held-out samples.", bound=">=0")
    client_eval_steps: int = opt(0, "Client evaluation's local steps k. 0: the global model as it is. k > 0: also "
                                    "personalized accuracy (client_eval_personalized_* keys): each client takes k "
                                    "steps of the run's local rule and optimizer (train.*, from an empty client "
                                    "state) on its training samples, from a seed of its own, on a copy, and "
                                    "evaluates the result: the global model and the client's state are left "
                                    "untouched.", bound=">=0")
    ckpt_every: int = opt(0, "Write a checkpoint every this many rounds (0: none but at run.stop_after; "
                             "final.pt is written either way).", bound=">=0")
    resume: bool = opt(False, "Continue from the newest complete checkpoint in out_dir/checkpoints. Forced "
                              "on in workers restarted by torchrun --max-restarts (TORCHELASTIC_RESTART_COUNT "
                              "> 0); a fresh run (false) first drops the old LATEST pointer.")
    stop_after: int = opt(0, "Stop (cleanly, after checkpointing, also with ckpt_every = 0) once this round is "
                             "done; 0: run all rounds.", bound=">=0")
    device: str = opt("cpu", "cpu or cuda. cuda: NCCL backend, rank r binds cuda:LOCAL_RANK; cpu: gloo.",
                      ("cpu", "cuda"))
    num_threads: int = opt(1, "torch intra-op threads per rank. Pinned so results are bitwise the same "
                              "for any number of ranks; raise it only if you do not need that.", bound=">0")
    collective_timeout_s: float = opt(1800.0, "Seconds a rank waits for the others in a collective, and "
                                              "without a heartbeat from one, before the run ends (exit 6, "
                                              "naming the rank that stopped answering).", bound=">0")
    progress: bool = opt(True, "Show a one-line progress display (round, accuracy, ETA) on rank 0.")
    tensorboard: bool = opt(False, "Also write TensorBoard event files under out_dir/tensorboard (rank 0): "
                                   "every number of metrics.jsonl as a scalar per round. Needs the "
                                   "optional extra: pip install 'fedddp[tensorboard]'.")
    callbacks: str = opt("", "Callbacks called on rank 0 at the run's events (round start and end, evaluation, "
                             "checkpoint): comma-separated module:attr import paths (a TOML list of them is "
                             "taken too), each a class (built with no arguments) or object with the hooks of "
                             "fedddp.callbacks.Callback. on_round_end gets the metrics.jsonl row and a read-only "
                             "view of the model, and may stop the run after its round (early stopping: "
                             "final.pt is written). Built in: fedddp.callbacks:WandbLogger and "
                             "fedddp.callbacks:MlflowLogger (extras fedddp[wandb], fedddp[mlflow]). A "
                             "callback never changes the run's bits; what it raises ends the run with one "
                             "line, exit 7 (docs/running.md, \"Callbacks and loggers\").")
    client_state: str = opt("memory", "Where per-client persistent state (SCAFFOLD's c_k, MOON's previous "
                                      "model, FedSMOO's duals) lives on its owner rank: memory (RAM or the "
                                      "device), or mmap (files under out_dir/client_state, rows read per "
                                      "client: for thousands of clients). Checkpointed either way.",
                            ("memory", "mmap"))
    overwrite: bool = opt(False, "A fresh run (resume = false) into an out_dir that already holds results "
                                 "(metrics.jsonl, final.pt, checkpoints) is refused; true deletes them "
                                 "first and starts over. Ignored when resuming.")
    dropout: float = opt(0.0, "Probability that a sampled client fails to report in a round, drawn per "
                              "(seed, round, client id); it does not train. A round with no reports leaves "
                              "the model and server state unchanged (metrics.jsonl: num_reports = 0).")
    deadline_steps: int = opt(0, "Drop (as a straggler) every sampled client whose local steps this round "
                                 "exceed this many; 0: no deadline. It does not train and its client "
                                 "state is untouched.")
    compile: bool = opt(False, "torch.compile the side-by-side step: with sgd and adam the whole step (gradients, "
                               "the local rule's direction, BatchNorm statistics, optimizer update), with "
                               "adamp and rmsgd the vmapped gradient alone; its shapes padded to B clients "
                               "and train.batch_size samples so one graph serves every step and round; on "
                               "CUDA captured as a CUDA graph. Compiled once a run before round 1, kept on "
                               "disk for later runs; the start line says in how long and the compiled step's "
                               "time against the eager one's (and that it does not pay where it does not). "
                               "One after another (B = 1) is not compiled. A model torch.compile cannot take "
                               "runs eagerly, said in one line. Equal to eager to float32 rounding, so it is "
                               "part of the run's identity.")
    parallel_clients: IntOrAuto = opt("auto", "Clients a rank trains side by side (B) as one batched computation "
                                              "over stacked parameters (fedddp.client.batched); 1: one after "
                                              "another, the reference, which B > 1 equals to float32 rounding (B "
                                              "decides bits: config.toml and checkpoints record it). auto: on CPU "
                                              "1; on CUDA the most clients that fit in free memory, at most the "
                                              "clients a rank trains a round; on resume the checkpoint's B; the "
                                              "start line says which. On CPU side by side pays only for small "
                                              "models (a few thousand parameters) whose clients take similar "
                                              "numbers of steps; with uneven clients, and for the CNN and "
                                              "ResNet-18, it loses (BENCHMARKS.md). With B > 1 on CPU the start line "
                                              "gives a quick measurement's prediction and warns when one after "
                                              "another is faster (docs/running.md).")
    mode: str = opt("sync", "sync: rounds of the sampled K clients, the server waiting for all of them. async: "
                            "FedBuff (docs/algorithms.md): run.async_concurrency clients train at once on the "
                            "simulated clock of data.client_speed, each from the model version it started "
                            "from, and every run.async_buffer arrivals make one server update, which counts "
                            "as a round (run.rounds, eval_every, ckpt_every count updates).", ("sync", "async"))
    async_concurrency: int = opt(0, "Async mode: clients training at once (C); 0: the sampled K "
                                    "(run.clients_per_round or run.participation).")
    async_buffer: int = opt(10, "Async mode: arrivals per server update (FedBuff's K), at most "
                                "data.num_clients; a client reports at most once per update.")
    async_staleness: str = opt("polynomial", "Async mode: staleness weight s(tau) of an update trained from "
                                             "a model tau versions old: polynomial (1 + tau)^-a (FedAsync's; "
                                             "FedBuff's experiments use a = 0.5), or constant 1.",
                               ("polynomial", "constant"))
    async_staleness_exponent: float = opt(0.5, "Async mode: a in the polynomial staleness weight (1 + tau)^-a.")
    aggregation: str = opt("gather", "Where the server rule runs. gather: every report row to rank 0, which runs "
                                     "the rule over [K, F] and broadcasts the model. sharded: the flat vector is "
                                     "cut into fixed blocks (run.aggregation_block), each rank receives the "
                                     "columns of its contiguous range of blocks from all K clients, runs the "
                                     "rule there and the ranges are all-gathered: the same bits as gather on "
                                     "any number of ranks, 1/W of the reports' memory per rank "
                                     "(docs/architecture.md, \"The sharded server\").", ("gather", "sharded"))
    aggregation_block: int = opt(65536, "Columns per block of the flat vector (a multiple of 64). Sums over the "
                                        "whole vector (CGW's dot products and norms, DP-FedAvg's clip norms) run "
                                        "per block, then over the blocks in block order, in both aggregation "
                                        "modes; run.aggregation = sharded gives each rank whole blocks.")

    def asked_parallel_clients(self) -> int:
        """B as the config asks for it, before the run resolves auto: auto counts as 1, since it
        falls back to one after another wherever side by side cannot run (client/parallel.py) and
        so is refused for nothing."""
        return 1 if self.parallel_clients == "auto" else self.parallel_clients



# Keys whose "auto" is resolved when a run starts (run.parallel_clients: from the device, or the
# checkpoint's on resume): a run folder's config.toml and a checkpoint's identity hold the resolved
# value, and a config that says "auto" accepts any recorded one (same_setting).
RESOLVED_AT_START = frozenset({"run.parallel_clients"})


def same_setting(key: str, recorded: Any, configured: Any) -> bool:
    """Whether a value recorded by a run (config.toml, a checkpoint's identity) is what the config
    asks for: equal, or ``auto`` for a key resolved when the run starts."""
    return recorded == configured or (key in RESOLVED_AT_START and configured == "auto")


# Keys that may differ between a checkpoint and the run that resumes from it: they do not decide
# the bits of any round (how many rounds, what is logged or saved, where and how state is kept, and
# where the server rule runs: gather and sharded give the same bits). Every other key, and nothing about the world size, makes up a checkpoint's run identity.
RESUME_MAY_CHANGE = frozenset({
    "run.rounds", "run.eval_every", "run.ckpt_every", "run.progress", "run.tensorboard", "run.stop_after",
    "run.resume", "run.overwrite", "run.out_dir", "run.client_state", "run.collective_timeout_s", "data.root",
    "data.download", "data.path", "run.aggregation", "run.client_eval_every", "run.client_eval_clients",
    "run.client_eval_steps", "run.callbacks"})


@dataclass(frozen=True)
class DataConfig:
    name: str = opt("synthetic", "Data set: a built-in one; tensors (arrays in the file data.path); "
                                 "clients_dir (a population on disk in the folder data.path, a client's "
                                 "samples read when it trains: docs/datasets.md); or "
                                 "module:attr, your callable (root, seed) -> mapping of arrays "
                                 "(docs/extending.md).",
                    tuple(registry.DATA_SETS), plugin=True)
    path: str = opt("", "data.name = tensors: the .npz (numpy) or .pt (torch) file holding x_train, y_train, "
                        "x_test, y_test and optionally client_train, task, num_classes (docs/extending.md); "
                        "data.name = clients_dir: its folder.")
    root: str = opt("", "Folder holding the data sets (torchvision layout, e.g. ROOT/MNIST/raw). "
                        "Empty: $FEDDDP_DATA, else ./data.")
    download: bool = opt(False, "Let torchvision download a missing data set (needs internet).")
    num_clients: int = opt(30, "Number of clients N.", bound=">0")
    partition: str = opt("dirichlet", "How samples are split over clients (synthetic data is split "
                                      "by its generator and ignores this). natural: the data set's own "
                                      "clients (femnist's writers; femnist needs it).",
                         ("iid", "dirichlet", "shards", "classes", "natural"))
    dirichlet_alpha: float = opt(0.3, "Dirichlet concentration for the label-skew split; smaller is more skewed.",
                                 bound=">0")
    shards_per_client: int = opt(2, "Shards per client for partition = shards; exact classes per client "
                                    "for partition = classes.", bound=">0")
    holdout_from_test: float = opt(0.0, "If > 0, carve both train and test sets from the standard test "
                                        "split, this fraction going to test (for folders with only the "
                                        "test split, e.g. 0.2 gives 8,000 / 2,000 on MNIST).", bound="[0, 1)")
    colored_variant: str = opt("binary", "Colored MNIST: binary (digit < 5, red/green) or multiclass "
                                         "(10 digits, class colours); docs/datasets.md.", ("binary", "multiclass"))
    colored_flip_min: float = opt(0.1, "Colored MNIST binary: smallest client probability of the other colour.")
    colored_flip_max: float = opt(0.2, "Colored MNIST binary: largest client probability of the other colour.")
    colored_test_flip: float = opt(0.9, "Colored MNIST binary: probability of the reversed colour in the test set.",
                                   bound="[0, 1]")
    client_test_fraction: float = opt(0.0, "Share of each client's samples held out of its training for client "
                                           "evaluation (run.client_eval_every), in [0, 1): round(fraction x n) of "
                                           "a client's n (at most n - 1), picked by a permutation seeded by "
                                           "(data.seed, client id), so the same on every rank and world size. "
                                           "0: none, every sample trains (as without the key); > 0 with "
                                           "run.client_eval_every = 0 trains on the same reduced data without "
                                           "evaluating.", bound="[0, 1)")
    synthetic_alpha: float = opt(1.0, "Synthetic(alpha, beta): std of the per-client model mean u_k.", bound=">=0")
    synthetic_beta: float = opt(1.0, "Synthetic(alpha, beta): std of the per-client input mean B_k.", bound=">=0")
    synthetic_iid: bool = opt(False, "Synthetic IID variant: one shared model, v_k = 0.")
    synthetic_dim: int = opt(60, "Synthetic input dimension d.", bound=">0")
    synthetic_classes: int = opt(10, "Synthetic number of classes.", bound=">0")
    augment: bool = opt(False, "CIFAR only: random crop + flip + cutout on training batches.")
    cmapss_subset: str = opt("FD001", "CMAPSS sub-data set, ROOT/CMAPSS/{train,test,RUL}_FD00x.txt. Its "
                                      "clients are pairs of engines in unit order (data.partition is "
                                      "ignored), so data.num_clients must be ceil(engines / 2): 50, 130, "
                                      "50, 125 for FD001-FD004.", ("FD001", "FD002", "FD003", "FD004"))
    client_speed: str = opt("constant", "Each client's seconds per local step on the simulated clock "
                                        "(metrics.jsonl's sim_time_s; the schedule of run.mode = async): "
                                        "constant[:S] (S, default 1), uniform:A:B, lognormal:SIGMA[:MEDIAN] "
                                        "(MEDIAN exp(SIGMA z), MEDIAN default 1), drawn per (data.seed, "
                                        "client id); or file:PATH, a CSV of client_id,seconds_per_step rows or "
                                        "a JSON object {\"client_id\": seconds_per_step} naming every client "
                                        "(e.g. from FedScale's device traces).")
    seed: int = opt(0, "Seed for the data: the partition over clients, the holdout split, synthetic samples, "
                       "colored MNIST's colours and the clients' speeds (data.client_speed). Fixed (0) by "
                       "default, so the spread over run.seed is training variation only; sweep it to measure "
                       "variation over data draws.", bound=">=0")


@dataclass(frozen=True)
class ModelConfig:
    name: str = opt("logistic", "Model. ffnn: seed 004's regressor (20-30-20 tanh, sigmoid output), "
                                "for regression data (cmapss). module:attr: your callable (input_shape, "
                                "num_classes) -> torch.nn.Module (docs/extending.md).",
                    ("logistic", "mlp", "cnn", "resnet18", "ffnn"), plugin=True)
    hidden: int = opt(200, "MLP hidden width.", bound=">0")
    flat_buffers: bool = opt(True, "Send buffers (BatchNorm statistics) with the parameters and average them.")


@dataclass(frozen=True)
class TrainConfig:
    optimizer: str = opt("sgd", "Client optimizer. Built fresh for each client each round (the papers' "
                                "default): no momentum buffer, Adam moment or RMSGD metric survives a round.",
                         ("sgd", "adam", "adamp", "rmsgd"))
    lr: float = opt(0.01, "Client learning rate.", bound=">=0")
    momentum: float = opt(0.0, "SGD momentum.", bound=">=0")
    nesterov: bool = opt(False, "Nesterov momentum for sgd (torch.optim.SGD's nesterov; needs momentum > 0).")
    weight_decay: float = opt(0.0, "Weight decay.", bound=">=0")
    batch_size: int = opt(10, "Local minibatch size (0: full batch).", bound=">=0")
    local_epochs: int = opt(1, "Local epochs per round (ignored when local_steps > 0).", bound=">=0")
    local_steps: int = opt(0, "Local minibatch steps per round; 0: use local_epochs.", bound=">=0")
    lr_schedule: str = opt("none", "Learning-rate schedule: none, or steplr (lr * gamma every step_size units).",
                           ("none", "steplr"))
    lr_step_size: int = opt(25, "StepLR period, in lr_schedule_unit units.", bound=">0")
    lr_gamma: float = opt(0.5, "StepLR factor.", bound=">=0")
    lr_schedule_unit: str = opt("round", "What StepLR counts: rounds (lr fixed within a round), or local "
                                         "epochs on the clock (round - 1) * local_epochs + epoch of the "
                                         "round (needs local_epochs, not local_steps).",
                                ("round", "epoch"))
    rmsgd_beta: float = opt(0.8, "RMSGD beta (its velocity averaging). RMSGD adapts its per-layer rates "
                                 "between local epochs (epoch_step), so with one local epoch per round "
                                 "and a fresh optimizer it is plain SGD.")
    precision: str = opt("fp32", "Arithmetic of local training's forward and backward passes, one after another "
                                 "and side by side. fp32: float32 throughout. tf32: on CUDA, float32 matmuls "
                                 "and convolutions on TensorFloat-32 tensor cores during local steps (a no-op "
                                 "on CPU). bf16: convolutions and linear layers in bfloat16, the loss and "
                                 "BatchNorm statistics in float32 (side by side the parameters cast once a "
                                 "step, channels-last on CUDA; one after another torch.autocast). It pays only "
                                 "where bfloat16 units do the arithmetic (GPU tensor cores, CPUs with AMX or "
                                 "AVX512-BF16) and the model is large enough: it cannot pay for small models "
                                 "bound by per-op overhead (the FFNN, a small MLP: slower than fp32), on CPUs "
                                 "without bfloat16 units, or in GPU steps bound by kernel launches. Weights, "
                                 "optimizer state, report rows and evaluation stay float32 "
                                 "(fedddp/client/precision.py; docs/running.md, BENCHMARKS.md).",
                         ("fp32", "tf32", "bf16"))
    local_work_min: int = opt(0, "Uneven local work: > 0 draws each sampled client's local epochs (local "
                                 "steps when local_steps > 0) every round uniformly from [local_work_min, "
                                 "local_epochs (local_steps)], per (seed, round, client id). 0: everyone "
                                 "does local_epochs (steps then scale with the client's size) or local_steps.")


@dataclass(frozen=True)
class AlgorithmConfig:
    name: str = opt(registry.DEFAULT_ALGORITHM, "Federated algorithm (see docs/algorithms.md), or module:attr, your server "
                              "rule (docs/extending.md).")
    local: str = opt("auto", "Client-side local rule; auto: the one algorithm.name implies. Another rule "
                             "composes with the name's server rule, e.g. name = fedgma with local = prox, "
                             "or name = feder with local = gam. module:attr: your LocalRule subclass. The "
                             "built-in rules (plain, prox, scaffold, moon, sam, gam, gam_cv, smoo, clip) are "
                             "the registry's (fedddp.registry.LOCAL_RULES: a new one registers in its own "
                             "file), checked when the config loads.", plugin=True)
    params: dict = opt({}, "The server and local rules' own hyperparameters (each rule declares its names, "
                           "defaults and checks; python -m fedddp --help lists the built-ins'). [algorithm.params] "
                           "NAME = value for the run's rules (a name they do not declare is refused), or "
                           "[algorithm.params.RULE] for one rule, ignored when RULE (an algorithm, server or "
                           "local rule name) does not run, so one file serves a sweep over rules. Overrides: "
                           "algorithm.params.NAME=value, algorithm.params.RULE.NAME=value. config.toml "
                           "records the run's resolved values (docs/extending.md).")
    weighting: str = opt("auto", "Client weights p_k for averaging: by sample count (n_k / n) or uniform "
                                 "(1/K); auto: the weighting of algorithm.name's paper or reference code "
                                 "(docs/algorithms.md), resolved when the config is loaded.",
                         ("auto", "samples", "uniform"))
    server_lr: float = opt(1.0, "Server learning rate eta: w <- w + eta (aggregate - w) for FedAvg's server "
                                "rule (fedavg, fedprox, moon, fedsam, fedgam) and DP-FedAvg, SCAFFOLD's "
                                "and FedGAM-CV's eta_g, FedMom's w <- w + eta v, FedNova's step, FedGMA's "
                                "eta_s; rules without a server step (fedcong, cgw, feder, fedsmoo, fedmedian, "
                                "fedtrimmedavg, krum, bulyan) and fedadam, fedyogi, fedadagrad (their step is "
                                "algorithm.params.eta) refuse a value other than 1 (docs/algorithms.md).", bound=">=0")


# The flat keys the built-in rules' hyperparameters had before each rule declared its own
# (algorithm.cong_alpha = 0.5): still accepted, in files, overrides and sweeps, as shorthand for
# the table of every rule that reads it ([algorithm.params.fedcong] cong_alpha = 0.5), which is
# ignored when that rule does not run. Checkpoint identities and config.toml files written with
# them translate the same way (fedddp.checkpoint.identity_changes). The declarations themselves
# (defaults, docs, checks) are the rules' (tests/test_config.py holds the two in step).
ALIASES = registry.ALIASES


# What a key meant before fedddp had it: a checkpoint whose run identity does not name the key was
# written by code that behaved as this value does, so fedddp.checkpoint.identity_changes compares
# with it (not with today's default, where the two differ: auto sampling is poisson for DP-FedAvg,
# which sampled a fixed K of N before). A rule's parameter (algorithm.params.NAME) counts only
# where the resuming run's rules declare it.
BEFORE_THE_KEY: dict[str, Any] = {
    "run.parallel_clients": 1, "run.sampling": "fixed", "algorithm.params.dp_accountant": "rdp", "algorithm.params.dp_adaptive_quantile": 0.0,
    "algorithm.params.dp_adaptive_lr": 0.2, "algorithm.params.dp_adaptive_count_noise": 0.0,
    "algorithm.params.dp_noise_cohort": 0}


@dataclass(frozen=True)
class Cohort:
    """Who a round samples, from run.sampling (resolved: fixed or poisson), run.clients_per_round,
    run.participation and data.num_clients (``Config.cohort``)."""

    num_clients: int   # N
    poisson: bool      # each client independently with probability ``rate``; else exactly ``num_sampled``
    num_sampled: int   # K, fixed-size sampling's clients a round
    rate: float        # q, Poisson sampling's probability
    expected: float    # clients a round on average: K, or q N under Poisson sampling


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)

    def num_sampled(self) -> int:
        """K: clients sampled per round (fixed-size sampling)."""
        if self.run.clients_per_round > 0:
            return self.run.clients_per_round
        return max(1, round(self.run.participation * self.data.num_clients))

    def sampling_rate(self) -> float:
        """q, each client's probability of being sampled in a round under Poisson sampling:
        clients_per_round / N when that is set, else participation."""
        if self.run.clients_per_round > 0:
            return self.run.clients_per_round / self.data.num_clients
        return self.run.participation

    def expected_cohort(self) -> float:
        """Clients sampled per round on average: K (fixed-size sampling) or q N (Poisson), the
        denominator of DP-FedAvg's fixed-denominator estimator."""
        if self.run.sampling == "poisson":
            return float(self.run.clients_per_round) if self.run.clients_per_round > 0 else \
                self.run.participation * self.data.num_clients
        return float(self.num_sampled())

    def cohort(self) -> Cohort:
        """Who a round samples; run.sampling must be resolved (fedddp.checks.load, prepare.prepare)."""
        assert self.run.sampling != "auto", "run.sampling = auto is resolved when the config loads"
        return Cohort(self.data.num_clients, self.run.sampling == "poisson", self.num_sampled(),
                      self.sampling_rate(), self.expected_cohort())

    def data_root(self) -> str:
        return self.data.root or os.environ.get("FEDDDP_DATA", "") or "data"


SECTIONS = typing.get_type_hints(Config)


def _section_types(section_cls) -> dict[str, type]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


INT_MIN, INT_MAX = -(2 ** 63), 2 ** 63 - 1  # torch and numpy take seeds and sizes as 64-bit integers
TYPE_NAMES = {int: "int", float: "float", bool: "bool (true or false)", str: "str"}


def _coerce(value: Any, typ: type, path: str, errors: list[str], text: bool = False) -> Any:
    """A TOML value (typed: ``rounds = "3"`` is an error) or, with ``text``, an override's string
    (parsed: ``run.rounds=3``) -> the field's type; None after appending an error naming the path.
    Numbers must be finite and integers must fit in 64 bits."""
    if typ == IntOrAuto:  # "auto", else an int whose errors say that auto is taken too
        if (value.strip() if text and isinstance(value, str) else value) == "auto":
            return "auto"
        mine: list[str] = []
        value = _coerce(value, int, path, mine, text)
        errors += [e.replace("expected int,", 'expected int or "auto",', 1) for e in mine]
        return value
    if text and typ is not str:
        word = value.strip()
        try:
            if typ is bool:
                if word.lower() not in ("true", "false"):
                    raise ValueError
                value = word.lower() == "true"
            else:
                value = typ(word)
        except ValueError:
            errors.append(f"{path}: expected {TYPE_NAMES[typ]}, got {value!r}")
            return None
    elif typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif isinstance(value, bool) != (typ is bool) or not isinstance(value, typ):
        hint = " (remove the quotes)" if isinstance(value, str) and _parses_as(value, typ) else ""
        errors.append(f"{path}: expected {TYPE_NAMES[typ]}, got {type(value).__name__} {value!r}{hint}")
        return None
    if typ is float and not math.isfinite(value):
        errors.append(f"{path}: must be a finite number, got {value}")
        return None
    if typ is int and not INT_MIN <= value <= INT_MAX:
        errors.append(f"{path}: {value} is out of range (at most {INT_MAX})")
        return None
    return value


def _parses_as(word: str, typ: type) -> bool:
    try:
        return word.strip().lower() in ("true", "false") if typ is bool else (typ(word.strip()), True)[1]
    except ValueError:
        return False


def from_dict(raw: dict[str, Any], errors: list[str], cfg: Config | None = None, text: bool = False) -> Config:
    """TOML tables (or, with ``text``, override strings) over ``cfg`` (default: a fresh Config),
    as a new Config; every error is appended, and a bad value leaves the field as it was."""
    cfg = Config() if cfg is None else cfg
    sections = {}
    for section, table in raw.items():
        if section == "sweep":  # read by fedddp.study.sweep, which runs the file's base config per combination
            errors.append("sweep: this file is a sweep; run it with python -m fedddp.study.sweep FILE")
            continue
        if section not in SECTIONS:
            errors.append(f"{section}: unknown section{_did_you_mean(section, SECTIONS)} (valid: {', '.join(SECTIONS)})")
            continue
        if not isinstance(table, dict):
            errors.append(f"{section}: expected a table")
            continue
        target = getattr(cfg, section)
        sections[section] = dataclasses.replace(target, **_section_values(section, target, table, errors, text))
    return dataclasses.replace(cfg, **sections)


def _section_values(section: str, target, table: dict[str, Any], errors: list[str], text: bool) -> dict[str, Any]:
    """The fields of one section that ``table`` sets, coerced to their types (errors appended)."""
    types = _section_types(type(target))
    values: dict[str, Any] = {}
    for key, value in table.items():
        path = f"{section}.{key}"
        if section == "algorithm" and (key == "params" or key.startswith("params.") or key in ALIASES):
            values["params"] = _set_params(values.get("params", target.params), key, value, path, errors, text)
            continue
        if key not in types:
            near = close_match(key, types)
            hint = f", did you mean {section}.{near}?" if near else ""
            errors.append(f"{path}: unknown key{hint} (valid: {', '.join(types)})")
            continue
        if path == "run.callbacks" and isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = ",".join(value)  # a TOML list of import paths, as the comma-separated string
        coerced = _coerce(value, types[key], path, errors, text)
        if coerced is not None:
            values[key] = coerced
    return values


def _set_params(params: dict, key: str, value: Any, path: str, errors: list[str], text: bool) -> dict:
    """``params`` with ``key`` set (NAME -> value for the run's rules, RULE -> {NAME: value} for one
    rule): ``[algorithm.params]`` and ``[algorithm.params.RULE]`` (TOML tables), one override
    ``algorithm.params.NAME=value`` or ``algorithm.params.RULE.NAME=value`` (the value read as a
    TOML value: ``0.5``, ``true``, ``"x"``, else taken as a string; RULE may hold dots, as a
    module:attr path does, NAME does not), or an old flat key (ALIASES) into its rules' tables.
    A refused value leaves ``params`` as it was."""
    if key == "params":
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a table [algorithm.params], got {type(value).__name__} {value!r}")
            return params
        for name, item in value.items():
            params = _set_params(params, f"params.{name}", item, f"{path}.{name}", errors, text=False)
        return params
    if text:
        try:
            value = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            pass  # a bare word is a string
    if key in ALIASES:
        tables = {rule: {**_table(params, rule), key: value} for rule in ALIASES[key]}
    elif isinstance(value, dict):  # a table [algorithm.params.RULE]; RULE is the whole rest
        rule = key.removeprefix("params.")
        tables = {rule: {**_table(params, rule), **value}}
    else:
        rule, _, name = key.removeprefix("params.").rpartition(".")
        tables = {rule: {**_table(params, rule), name: value}} if rule else {name: value}
    for rule, table in tables.items():
        for name, item in (table.items() if isinstance(table, dict) else [("", table)]):
            if isinstance(item, float) and not math.isfinite(item):
                errors.append(f"{path}: must be a finite number, got {item}")
                return params
            if not rule or (isinstance(table, dict) and not name) or not _param_value_ok(item):
                errors.append(f"{path}: a parameter is algorithm.params.NAME (or algorithm.params.RULE.NAME) = "
                              f"a number, bool, string or list of them, got {item!r}")
                return params
    return {**params, **tables}


def _table(params: dict, rule: str) -> dict:
    table = params.get(rule)
    return table if isinstance(table, dict) else {}


def _did_you_mean(word: str, candidates) -> str:
    near = close_match(word, candidates)
    return f", did you mean {near}?" if near else ""


def _param_value_ok(value: Any) -> bool:
    if isinstance(value, list):
        return all(_param_value_ok(v) and not isinstance(v, list) for v in value)
    return isinstance(value, (bool, int, float, str)) and not (isinstance(value, float) and not math.isfinite(value))


def parse_overrides(overrides: list[str], errors: list[str]) -> dict[str, dict[str, str]]:
    tables: dict[str, dict[str, str]] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or not name:
            errors.append(f"{item}: an override is section.key=value, e.g. run.rounds=5")
            continue
        tables.setdefault(section, {})[name] = value
    return tables


def check_fields(cfg: Config) -> list[str]:
    """Every impossible value or combination of the config's own fields, each naming its dotted
    path (what needs the rules, the plugins or the data is checked above, in fedddp.checks)."""
    errors = []
    for section in SECTIONS:
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            choices = f.metadata.get("choices")
            value = getattr(obj, f.name)
            if f.metadata.get("plugin") and plugins.is_path(value):
                continue
            if choices and value not in choices:
                own = ", or module:attr (docs/extending.md)" if f.metadata.get("plugin") else ""
                errors.append(f"{section}.{f.name}: {value!r} is not one of {', '.join(choices)}{own}"
                              f"{_did_you_mean(value, choices)}")
            if f.metadata.get("bound") and not BOUNDS[f.metadata["bound"]][0](value):
                errors.append(f"{section}.{f.name}: {BOUNDS[f.metadata['bound']][1]}, got {value}")
    if cfg.run.aggregation_block <= 0 or cfg.run.aggregation_block % 64:
        errors.append(f"run.aggregation_block: must be a positive multiple of 64, got {cfg.run.aggregation_block}")
    if cfg.run.client_eval_every > 0 and cfg.data.client_test_fraction == 0:
        errors.append(f"run.client_eval_every: {cfg.run.client_eval_every} evaluates clients on their held-out "
                      "samples, but data.client_test_fraction = 0 holds none out; set e.g. "
                      "data.client_test_fraction=0.2")
    if cfg.run.client_eval_clients > cfg.data.num_clients:
        errors.append(f"run.client_eval_clients: {cfg.run.client_eval_clients} but only data.num_clients = "
                      f"{cfg.data.num_clients}; lower it (0: every client with held-out samples)")
    if cfg.run.participation <= 0 and cfg.run.clients_per_round == 0:
        errors.append("run.participation: must be > 0 (or set run.clients_per_round)")
    if cfg.num_sampled() > cfg.data.num_clients:
        errors.append(f"run.clients_per_round: {cfg.num_sampled()} sampled clients but only "
                      f"data.num_clients = {cfg.data.num_clients}; lower it or raise data.num_clients")
    if not 0.0 <= cfg.data.colored_flip_min <= cfg.data.colored_flip_max <= 1.0:
        errors.append(f"data.colored_flip_min: need 0 <= colored_flip_min <= colored_flip_max <= 1, got "
                      f"{cfg.data.colored_flip_min} and {cfg.data.colored_flip_max}")
    # clients come with the data; the others are partitioned. A tensors file or a data callable
    # may bring its own (client_train), checked when it is read.
    own_clients = ("femnist", "synthetic", "cmapss", "tensors", "clients_dir")
    if cfg.data.partition == "natural" and cfg.data.name not in own_clients and not plugins.is_path(cfg.data.name):
        errors.append(f"data.partition: natural needs a data set with its own clients (femnist: its writers); "
                      f"data.name = {cfg.data.name} has none, use iid, dirichlet, shards or classes")
    if cfg.data.name == "tensors" and not cfg.data.path.endswith((".npz", ".pt")):
        errors.append(f"data.path: data.name = tensors reads its arrays from an .npz (numpy) or .pt (torch) "
                      f"file; got {cfg.data.path!r} (docs/extending.md)")
    if cfg.data.name == "femnist" and cfg.data.partition != "natural":
        errors.append(f"data.partition: femnist's clients are its writers; set data.partition = natural, not "
                      f"{cfg.data.partition} (IID FEMNIST: LEAF's preprocess.sh -s iid)")
    if cfg.train.local_epochs == 0 and cfg.train.local_steps == 0:
        errors.append("train.local_epochs: set train.local_epochs or train.local_steps > 0")
    if cfg.data.name == "synthetic" and cfg.model.name in ("cnn", "resnet18"):
        errors.append(f"model.name: {cfg.model.name} needs images; data.name = synthetic has flat "
                      "features (use logistic or mlp)")
    if tasks.of_data(cfg.data.name) == "regression" and cfg.model.name in ("cnn", "resnet18"):
        errors.append(f"model.name: {cfg.model.name} needs images; data.name = {cfg.data.name} has flat "
                      "features (use ffnn, logistic or mlp)")
    if tasks.of_data(cfg.data.name) == "classification" and cfg.model.name == "ffnn":
        errors.append(f"model.name: ffnn is a regressor (one sigmoid output); data.name = {cfg.data.name} "
                      "is a classification task (use logistic, mlp, cnn or resnet18)")
    return errors


def parse(path: str | os.PathLike | Mapping[str, Any] | None, overrides: list[str] = ()) -> tuple[Config, list[str], str | None]:
    """The file (or its tables as nested dicts), then the overrides: (the Config, the errors of
    both, the file's path or None). A key whose value was refused keeps its default, so the
    other keys can still be checked (fedddp.checks.load)."""
    errors: list[str] = []
    raw: Mapping[str, Any] = {}
    if isinstance(path, Mapping):
        raw, path = path, None
    elif path is not None:
        path = os.fspath(path)
        raw = _read_toml(path)
    cfg = from_dict(raw, errors)
    cfg = from_dict(parse_overrides(list(overrides), errors), errors, cfg, text=True)
    return cfg, errors, path


def refuse(errors: list[str], path: str | None) -> None:
    """Every error at once, as one ConfigError (nothing when there is none)."""
    if errors:
        where = f" in {path}" if path else ""
        raise ConfigError(f"{len(errors)} configuration error(s){where}: " + "; ".join(errors))


def check_alone(path: str | os.PathLike | Mapping[str, Any] | None, overrides: list[str] = ()) -> None:
    """What the file and its overrides show by themselves (TOML, an unknown key, a value of the
    wrong type or out of range), refused before anything imports torch: a typo answers at once.
    fedddp.checks.load then says the rest (the rules, the plugins) with these."""
    cfg, errors, path = parse(path, overrides)
    reported = {e.split(":", 1)[0] for e in errors}
    refuse(errors + [e for e in check_fields(cfg) if e.split(":", 1)[0] not in reported], path)


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file (give a .toml file, e.g. "
                          "configs/quickstart.toml)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (a TOML config is UTF-8 text)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _toml_key(key: str) -> str:
    return key if key and all(c.isalnum() or c in "_-" for c in key) else _toml_value(str(key))


def dumps(cfg: Config) -> str:
    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            lines.append(f"{f.name} = {_toml_value(getattr(obj, f.name))}")
        lines.append("")
    return "\n".join(lines)


def describe() -> str:
    """Every key with its default and doc, for ``python -m fedddp --help``."""
    lines = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            choices = f.metadata.get("choices")
            extra = f" [{'|'.join(choices)}]" if choices else ""
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            lines.append(f"  {section}.{f.name} = {_toml_value(default)}{extra}\n      {f.metadata['doc']}")
    return "\n".join(lines)
