"""pfl-research's published CIFAR10 benchmark, run by fedddp and by pfl itself, alternating.

pfl-research (Apple; the ``pfl`` package) publishes its speed on this workload
(benchmarks/image_classification, configs/baseline.yaml): 1000 users x 50 CIFAR10 images (IID),
50 users a round, 1 local epoch of batch 10 (5 SGD steps) at lr 0.1, server SGD lr 1.0 (FedAvg),
its ``simple_cnn`` (~1.63M parameters, two Dropouts), central evaluation every 10 rounds, 1500
rounds. This script runs that workload with both frameworks in one process, on the same device,
the same thread count and the same arrays (bench/peers/workloads.py), one after the other in
each repeat (fedddp, pfl, fedddp, pfl, ...), and prints per framework and repeat:

  start s          time before round 1: from the framework's call (fedddp.run; pfl: its data set,
                   model and backend built, then its run up to its first iteration) to the start
                   of round 1. fedddp's counts loading the config, the data's checks and
                   partition, the model, the checks and the warm-up; --start-phases prints
                   fedddp's own breakdown of it (the --verbose start line's "ready in")
  round 1 s        the first round (warm-up: allocation, caches), left out of the steady figure
  steady s/round   mean wall-clock seconds of rounds 2..R, evaluation rounds included. Both
                   evaluate once per 10 rounds (pfl after its iterations 10, 20, ..., fedddp
                   after rounds 10, 20, ...); beyond that pfl evaluates once before round 1
                   (outside its rounds) and fedddp once after the last round, which is left out
                   of fedddp's last round here, so both count the same evaluations
  whole run s      the framework's whole call: building its data set and model, every round,
                   its evaluations and its own logs (fedddp's metrics files, pfl's metrics csv)
  client steps/s   local SGD steps of the steady rounds per steady second
  final train loss the last round's mean minibatch loss during local training (fedddp's
                   metrics.jsonl train_loss; for pfl the same mean, tallied in the loss function)
  test loss / acc  the final global model on the workload's test set, computed by this script
                   identically for both (not timed)

and the paired ratio pfl / fedddp of steady seconds per round, repeat by repeat.

How each side runs (as the frameworks' users would run them):

- fedddp: ``fedddp.run`` with the model and the data given by import path
  (``bench.peers.workloads:simple_cnn``, ``...:cifar10_data``), ``data.partition = "natural"``
  (the users), FedAvg (its weighted mean is the server SGD step at lr 1.0), no checkpoints,
  ``run.eval_every`` as the workload's. A round's wall clock is read after fedddp writes the
  round's metrics row, so it holds the whole round as pfl's does.
- pfl: what benchmarks/image_classification/pytorch/train.py builds: the arrays as tensors on
  the device (pfl's ``to_tensor``), ``FederatedDataset.from_slices`` with the random user sampler,
  ``PyTorchModel`` with local torch SGD and central SGD at lr 1.0, ``SimulatedBackend`` with
  WeightByUser and no privacy, ``FederatedAveraging``, the published callbacks (stopwatch,
  central evaluation at batch 10000, metrics to disk, best-metric tracking). Its per-iteration
  metrics print goes to /dev/null. The device comes from PFL_PYTORCH_DEVICE, set from --device.
  On its evaluation iterations (0, 10, 20, ...) pfl also evaluates each user of the round before
  and after its local training: part of its published workload, kept.

Second row, the FLUTE FEMNIST shape (msrflute experiments/cv_cnn_femnist): 10 clients a round,
FedML's CNN_DropOut (1.21M parameters), batch 20, 1 local epoch, client lr 0.1, server SGD lr
1.0, clients weighted by samples, test every 50 rounds. FLUTE's population is FedML's 3,400
writers; without LEAF's files this uses 300 synthetic writers of 50-350 images (mean ~200, about
a FEMNIST writer's): only 10 train a round, so the population changes memory, not a round's work.

Data: real CIFAR10 when DATA_ROOT/cifar-10-batches-py/ exists (the python batches), real FEMNIST
when DATA_ROOT/FEMNIST/train and test hold LEAF's JSON; otherwise synthetic arrays of the same
shapes drawn from --seed. The output says which.

    python bench/peers/pfl_cifar10.py                          # CPU, 1 thread, 10 rounds x 3 reps
    python bench/peers/pfl_cifar10.py --device cuda --rounds 30 --reps 2 --parallel-clients 1,50
    python bench/peers/pfl_cifar10.py --data-root DIR --workloads cifar10
    python bench/peers/pfl_cifar10.py --smoke --frameworks fedddp    # tiny shapes, 2 rounds (tests)
    python bench/peers/pfl_cifar10.py --frameworks fedddp --workloads cifar10 --rounds 1 --start-phases

pfl is an optional extra: ``pip install -e ".[peers]"`` (pfl[pytorch] 0.6). pfl 0.6.0 pins
packaging<26 and, through dp-accounting<0.6, absl-py~=1.0 and attrs<24; where those would
downgrade packages the environment relies on, install it without them:
``pip install --no-deps pfl==0.6.0 dp-accounting==0.5.1 dm-tree multiprocess dill prv-accountant``
(the simulation runs with newer absl-py, attrs and packaging). Without pfl the script runs
fedddp's side and says so.

``--parallel-clients 1,50`` runs fedddp once per B in each repeat (pfl once); a B that fails
(e.g. side by side with Dropout before that is supported) is one line and the other runs go on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import types

import numpy as np
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import fedddp  # noqa: E402
from fedddp import book as fedddp_book  # noqa: E402
from bench.peers import workloads  # noqa: E402


@dataclasses.dataclass
class Workload:
    name: str
    title: str
    model: str          # attribute of bench.peers.workloads
    cohort: int         # users a round
    batch: int
    local_lr: float
    eval_every: int
    weighting: str      # fedddp's algorithm.weighting; pfl: WeightByUser / WeightByDatapoints
    mapping: dict
    source: str
    server_lr: float = 1.0

    @property
    def sizes_U(self) -> np.ndarray:
        return np.bincount(self.mapping["client_train"])

    def steps(self, clients) -> int:
        """Local steps of these clients in one round (1 local epoch; a last partial batch counts)."""
        sizes_U = self.sizes_U
        return sum(math.ceil(sizes_U[c] / self.batch) for c in clients)


def build_workload(name: str, args) -> Workload:
    root = "" if args.smoke else args.data_root
    if name == "cifar10":
        users, per_user, test = (20, 10, 64) if args.smoke else (1000, 50, 10000)
        mapping, source = workloads.cifar10_arrays(root, users, per_user, test, args.seed)
        return Workload("cifar10", f"pfl-research CIFAR10 benchmark: {users} users x {per_user} images, "
                        f"{4 if args.smoke else 50} a round, 1 epoch of batch {5 if args.smoke else 10}, "
                        "local lr 0.1, server SGD lr 1.0, simple_cnn, central eval every 10 rounds",
                        "simple_cnn", 4 if args.smoke else 50, 5 if args.smoke else 10, 0.1, 10, "uniform",
                        mapping, source)
    writers, low, high, test = (8, 5, 15, 32) if args.smoke else (args.femnist_writers, 50, 350, 2000)
    mapping, source = workloads.femnist_arrays(root, writers, low, high, test, args.seed)
    return Workload("femnist", f"FLUTE FEMNIST shape: {len(np.bincount(mapping['client_train']))} writers, "
                    f"{3 if args.smoke else 10} a round, 1 epoch of batch {4 if args.smoke else 20}, local lr 0.1, "
                    "server SGD lr 1.0, CNN_DropOut, clients weighted by samples, test every 50 rounds",
                    "femnist_cnn", 3 if args.smoke else 10, 4 if args.smoke else 20, 0.1, 50, "samples",
                    mapping, source)


@dataclasses.dataclass
class Outcome:
    label: str
    round_s: list          # every round's wall-clock seconds, round 1 first
    whole_s: float
    steady_steps: int      # local steps in rounds 2..R
    train_loss: float
    model: torch.nn.Module
    start_s: float = float("nan")  # the call to round 1's start
    phases: dict = dataclasses.field(default_factory=dict)  # fedddp's start, phase by phase

    @property
    def steady_s(self) -> float:
        return statistics.fmean(self.round_s[1:]) if len(self.round_s) > 1 else float("nan")

    @property
    def steps_per_s(self) -> float:
        return self.steady_steps / sum(self.round_s[1:]) if len(self.round_s) > 1 else float("nan")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_fedddp(w: Workload, args, device: torch.device, parallel: int, folder: str) -> Outcome:
    """One fedddp run through its Python API; a round's clock stops after its metrics row."""
    tables = {
        "run": {"rounds": args.rounds, "clients_per_round": w.cohort, "eval_every": w.eval_every, "ckpt_every": 0,
                "progress": False, "num_threads": args.threads, "seed": args.seed, "device": device.type,
                "parallel_clients": parallel},
        "data": {"name": f"bench.peers.workloads:{w.name}_data", "num_clients": len(w.sizes_U),
                 "partition": "natural", "seed": args.seed},
        "model": {"name": f"bench.peers.workloads:{w.model}"},
        "train": {"optimizer": "sgd", "lr": w.local_lr, "batch_size": w.batch, "local_epochs": 1},
        "algorithm": {"name": "fedavg", "weighting": w.weighting},
    }
    marks, ready = [], {}
    write_round, book_init = fedddp_book.Book.write_round, fedddp_book.Book.__init__

    def timed_write_round(self, *a, **k):
        write_round(self, *a, **k)
        sync(device)
        marks.append(time.perf_counter())

    def timed_book_init(self, run, comm):  # the last step before round 1 starts its clock
        book_init(self, run, comm)
        sync(device)
        ready.update(at=time.perf_counter(), phases=dict(getattr(run, "start_phases", {})))

    fedddp_book.Book.write_round, fedddp_book.Book.__init__ = timed_write_round, timed_book_init
    try:
        sync(device)
        start = time.perf_counter()
        result = fedddp.run(tables, ["run.overwrite=true"], out_dir=folder)
        sync(device)
        whole = time.perf_counter() - start
    finally:
        fedddp_book.Book.write_round, fedddp_book.Book.__init__ = write_round, book_init
    rows = result.metrics
    round_s = [rows[0]["time_s"]] + [b - a for a, b in zip(marks, marks[1:])]
    if len(round_s) > 1:  # the evaluation after the last round: pfl's twin is its one before round 1
        round_s[-1] -= rows[-1]["evaluate_s"]
    model = getattr(workloads, w.model)(tuple(w.mapping["x_train"].shape[1:]), w.mapping["num_classes"])
    model.load_state_dict(result.state_dict)
    return Outcome(f"fedddp B={parallel}", round_s, whole, sum(w.steps(r["clients"]) for r in rows[1:]),
                   rows[-1]["train_loss"], model.to(device), ready["at"] - start, ready["phases"])


def run_pfl(w: Workload, args, device: torch.device, folder: str) -> Outcome:
    """pfl's benchmark script, as benchmarks/image_classification/pytorch/train.py builds it."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints, WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.aggregate_metrics_to_disk import AggregateMetricsToDisk
    from pfl.callback.base import TrainingProcessCallback
    from pfl.callback.central_evaluation import CentralEvaluationCallback
    from pfl.callback.stopwatch import StopwatchCallback
    from pfl.callback.track_best_overall_metrics import TrackBestOverallMetrics
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops.pytorch_ops import to_tensor
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel
    from pfl.privacy import CentrallyAppliedPrivacyMechanism, NoPrivacy

    tally = {"sum": torch.zeros((), device=device), "steps": 0}

    def loss(self, inputs, targets, eval=False):  # noqa: A002 - pfl's signature
        self.eval() if eval else self.train()
        value = F.cross_entropy(self(inputs), targets.reshape(-1).long())
        if not eval:  # a training step: tallied without a host sync
            tally["sum"] += value.detach()
            tally["steps"] += 1
        return value

    @torch.no_grad()
    def metrics(self, inputs, targets, eval=True):  # noqa: A002
        self.eval() if eval else self.train()
        logits, labels = self(inputs), targets.reshape(-1).long()
        return {"loss": Weighted(F.cross_entropy(logits, labels, reduction="sum").item(), len(inputs)),
                "accuracy": Weighted((logits.argmax(-1) == labels).float().sum().item(), len(inputs))}

    class RoundClock(TrainingProcessCallback):
        """Last in the callback list: a round ends after pfl's own callbacks (central evaluation)."""

        def __init__(self):
            self.marks, self.losses, self.steps = [], [], []

        def on_train_begin(self, *, model):
            sync(device)
            self.marks.append(time.perf_counter())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            self.losses.append(tally["sum"].clone())
            self.steps.append(tally["steps"])
            tally["sum"].zero_()
            tally["steps"] = 0
            sync(device)
            self.marks.append(time.perf_counter())
            return False, Metrics()

    os.environ["PFL_PYTORCH_DEVICE"] = device.type
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        sync(device)
        start = time.perf_counter()
        torch.manual_seed(args.seed)
        np.random.seed(args.seed)
        m = w.mapping
        x_train, y_train = to_tensor(m["x_train"]), to_tensor(m["y_train"])  # float32 labels, as pfl's pipeline
        bounds = np.concatenate([[0], np.cumsum(w.sizes_U)])
        users = {u: (x_train[bounds[u]:bounds[u + 1]], y_train[bounds[u]:bounds[u + 1]])
                 for u in range(len(w.sizes_U))}
        federated = FederatedDataset.from_slices(users, get_user_sampler("random", list(range(len(users)))))
        central = Dataset(raw_data=[to_tensor(m["x_test"]), to_tensor(m["y_test"])])
        net = getattr(workloads, w.model)(tuple(m["x_train"].shape[1:]), m["num_classes"])
        net.loss = types.MethodType(loss, net)
        net.metrics = types.MethodType(metrics, net)
        params = [p for p in net.parameters() if p.requires_grad]
        model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                             central_optimizer=torch.optim.SGD(params, w.server_lr))
        weighting = WeightByUser() if w.weighting == "uniform" else WeightByDatapoints()
        backend = SimulatedBackend(training_data=federated, val_data=federated,
                                   postprocessors=[weighting, NoPrivacy(), CentrallyAppliedPrivacyMechanism(NoPrivacy())])
        eval_params = NNEvalHyperParams(local_batch_size=10000)
        clock = RoundClock()
        callbacks = [StopwatchCallback(),
                     CentralEvaluationCallback(central, model_eval_params=eval_params, frequency=w.eval_every),
                     AggregateMetricsToDisk(os.path.join(folder, "metrics.csv")),
                     TrackBestOverallMetrics(higher_is_better_metric_names=["Central val | accuracy"],
                                             assert_metrics_found_within_frequency=max(25, w.eval_every + 1)),
                     clock]
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            FederatedAveraging().run(
                algorithm_params=NNAlgorithmParams(central_num_iterations=args.rounds, evaluation_frequency=w.eval_every,
                                                   train_cohort_size=w.cohort, val_cohort_size=0),
                backend=backend, model=model,
                model_train_params=NNTrainHyperParams(local_learning_rate=w.local_lr, local_num_epochs=1,
                                                      local_batch_size=w.batch),
                model_eval_params=eval_params, callbacks=callbacks)
        sync(device)
        whole = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    round_s = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    last_loss = clock.losses[-1].item() / max(clock.steps[-1], 1)
    return Outcome("pfl", round_s, whole, sum(clock.steps[1:]), last_loss, net, clock.marks[0] - start)


@torch.no_grad()
def test_metrics(model: torch.nn.Module, x_test: torch.Tensor, y_test: torch.Tensor) -> tuple[float, float]:
    """The final model's test loss and accuracy, the same computation for both frameworks."""
    model.eval()
    loss = correct = 0.0
    for start in range(0, len(y_test), 1000):
        logits = model(x_test[start:start + 1000])
        y = y_test[start:start + 1000]
        loss += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
    return loss / len(y_test), correct / len(y_test)


def start_phase_words(out: Outcome) -> str:
    """fedddp's start phase by phase, and what its phases leave out of the time before round 1
    (loading the config, the out_dir check, the imports fedddp.run makes on its first call)."""
    words = ", ".join(f"{name} {s:.2f}" for name, s in out.phases.items())
    return f"start {out.start_s:.2f} s: {words}, other {out.start_s - sum(out.phases.values()):.2f}"


def fmt(value: float, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--rounds", type=int, default=None, help="rounds per run (default 10; 2 with --smoke)")
    p.add_argument("--reps", type=int, default=None, help="alternating repeats (default 3; 1 with --smoke)")
    p.add_argument("--parallel-clients", default="1",
                   help="fedddp's run.parallel_clients B, or a comma list: each B runs in every repeat (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both frameworks (default 1)")
    p.add_argument("--data-root", default=os.environ.get("FEDDDP_DATA", ""),
                   help="folder holding cifar-10-batches-py/ and/or FEMNIST/{train,test}/ (default $FEDDDP_DATA); "
                        "without them, synthetic arrays of the same shapes")
    p.add_argument("--workloads", default="cifar10,femnist", help="cifar10, femnist or both (default both)")
    p.add_argument("--frameworks", default="fedddp,pfl", help="fedddp, pfl or both (default both)")
    p.add_argument("--femnist-writers", type=int, default=300, help="synthetic FEMNIST population (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-phases", action="store_true",
                   help="print each fedddp run's time before round 1 phase by phase (data, model, checks, ...)")
    p.add_argument("--smoke", action="store_true", help="tiny synthetic shapes, 2 rounds, 1 repeat (for tests)")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.smoke else 10)
    args.reps = args.reps or (1 if args.smoke else 3)
    args.parallel = [int(b) for b in str(args.parallel_clients).split(",") if b.strip()]
    args.workload_names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    args.framework_names = [n.strip() for n in args.frameworks.split(",") if n.strip()]
    bad = [n for n in args.workload_names if n not in ("cifar10", "femnist")] + \
          [n for n in args.framework_names if n not in ("fedddp", "pfl")]
    if bad or args.rounds < 1 or args.reps < 1 or not args.parallel or min(args.parallel) < 1:
        p.error(f"bad value(s): {', '.join(bad) or 'rounds, reps and every B must be >= 1'}; workloads: cifar10, "
                "femnist; frameworks: fedddp, pfl")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("pfl_cifar10: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    pfl_version = None
    if "pfl" in args.framework_names:
        try:
            import pfl  # noqa: F401
            from pfl.version import __version__ as pfl_version  # noqa: F811
        except Exception as exc:  # noqa: BLE001 - a missing or broken optional extra is one line
            print(f"pfl: not usable here ({one_line(exc)}); running fedddp only "
                  "(pip install -e \".[peers]\"; see this script's docstring)", flush=True)
            args.framework_names = [n for n in args.framework_names if n != "pfl"]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"device {device.type} ({where}), {args.threads} thread(s); torch {torch.__version__}; pfl "
          f"{pfl_version or '-'}; {args.rounds} rounds x {args.reps} alternating repeat(s); fedddp B = "
          f"{', '.join(map(str, args.parallel))}; load average {os.getloadavg()[0]:.2f}", flush=True)

    for name in args.workload_names:
        w = build_workload(name, args)
        workloads.ARRAYS[w.name] = w.mapping
        print(f"\n== {w.name}: {w.title}\ndata: {w.source}", flush=True)
        print("| rep | framework | start s | round 1 s | steady s/round | whole run s | client steps/s "
              "| final train loss | test loss | test acc |\n|---|---|---|---|---|---|---|---|---|---|", flush=True)
        x_test = torch.as_tensor(w.mapping["x_test"], device=device)
        y_test = torch.as_tensor(w.mapping["y_test"], device=device)
        steady: dict[str, list] = {}
        started: dict[str, list] = {}  # seconds before round 1
        per_step: dict[str, list] = {}  # steady seconds per client step
        failed: dict[int, str] = {}
        with tempfile.TemporaryDirectory(prefix="pfl_cifar10_") as tmp:
            for rep in range(1, args.reps + 1):
                runs = [("fedddp", b) for b in args.parallel if "fedddp" in args.framework_names] + \
                       ([("pfl", None)] if "pfl" in args.framework_names else [])
                for framework, b in runs:
                    if b in failed:
                        continue
                    folder = os.path.join(tmp, f"{framework}{b or ''}_rep{rep}")
                    os.makedirs(folder, exist_ok=True)
                    try:
                        out = run_fedddp(w, args, device, b, folder) if framework == "fedddp" else \
                            run_pfl(w, args, device, folder)
                    except Exception as exc:  # noqa: BLE001 - a failing run is one line; the others go on
                        label = f"fedddp B={b}" if framework == "fedddp" else "pfl"
                        print(f"| {rep} | {label} | failed: {one_line(exc)} ||||||||", flush=True)
                        if framework == "fedddp":
                            failed[b] = one_line(exc)
                        continue
                    test_loss, test_acc = test_metrics(out.model, x_test, y_test)
                    steady.setdefault(out.label, []).append(out.steady_s)
                    started.setdefault(out.label, []).append(out.start_s)
                    per_step.setdefault(out.label, []).append(1 / out.steps_per_s)
                    print(f"| {rep} | {out.label} | {fmt(out.start_s, 2)} | {fmt(out.round_s[0])} | {fmt(out.steady_s)} | "
                          f"{fmt(out.whole_s, 2)} | "
                          f"{fmt(out.steps_per_s, 1)} | {fmt(out.train_loss, 4)} | {fmt(test_loss, 4)} | "
                          f"{fmt(test_acc, 4)} |", flush=True)
                    if args.start_phases and out.phases:
                        print(f"|   | {out.label} {start_phase_words(out)} |||||||||", flush=True)
        del workloads.ARRAYS[w.name]
        for label, values in steady.items():
            print(f"{label}: steady s/round median {fmt(statistics.median(values))} over {len(values)} repeat(s)")
        print("time before round 1, median: " + ", ".join(f"{label} {fmt(statistics.median(values), 2)} s"
                                                         for label, values in started.items()))
        for b, why in failed.items():
            print(f"fedddp B={b}: failed ({why})")
        # Clients of unequal sizes (FEMNIST) make a round's work depend on which were sampled, and
        # the two frameworks sample differently: there the ratio per client step is the fair one.
        uneven = len(set(w.sizes_U.tolist())) > 1
        for b in args.parallel:
            label = f"fedddp B={b}"
            for what, table in (("steady s/round", steady),) + ((("s per client step", per_step),) if uneven else ()):
                mine, theirs = table.get(label), table.get("pfl")
                if mine and theirs and len(mine) == len(theirs):
                    ratios = [t / f for f, t in zip(mine, theirs)]
                    print(f"paired ratio pfl / {label} ({what}, > 1: fedddp faster): "
                          f"{', '.join(fmt(r, 2) for r in ratios)}; median {fmt(statistics.median(ratios), 2)}")
        print(f"load average after {w.name}: {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
