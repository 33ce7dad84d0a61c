"""Client steps per second: one client after another (run.parallel_clients = 1) against K
clients side by side (run.parallel_clients = K), with peak memory.

Runs fedddp's own code on random data of the models' shapes: ``train_client`` for each client
in turn, and ``BatchedTrainer.train_group`` for all K at once; plain SGD (--optimizer: any of
train.optimizer's choices, default hyper-parameters), batch 32, every client --steps full
batches over --epochs local epochs (RMSGD's epoch_step runs between them). Seed 002's CNN on
1x28x28 images, seed 004's FFNN on 14 features, and ResNet-18 (CIFAR stem, 3x32x32; side by side
its BatchNorm layers are the masked ones of fedddp.client.masked, each client's running
statistics stacked). On CUDA when present
(--device), else on CPU with one thread. The sequential rate does not depend on K; it is
measured over min(K, --seq-clients) clients. Each measurement runs in a fresh process after
one untimed warm-up call; peak memory is the measurement's own: on CUDA
torch.cuda.max_memory_allocated above what was allocated before it, on CPU the process's peak
resident memory above its resident memory before it.

    python bench/parallel_clients.py [--device cpu|cuda] [--clients 1,10,100,300] [--models cnn,ffnn,resnet18]
                                     [--optimizer sgd|adam|adamp|rmsgd] [--epochs E]
                                     [--compile] [--precision fp32|tf32|bf16]
    python bench/parallel_clients.py --models resnet18 --clients 1,2,4 --steps 2    # ResNet-18 on CPU

``--compile`` times the compiled side-by-side step (run.compile: the whole step, one graph; a
CUDA graph on CUDA) against the eager one too, and gives the compile time (of the untimed first
call; seconds where an earlier run's graphs are on disk).

``--batch-norm K`` times instead one ResNet-18 gradient step of K clients side by side: with full
batches, the masked BatchNorm (the form a padded call takes) and fedddp's form of a call without
padding (torch's fused kernel, the statistics beside it) against torch's own BatchNorm under
vmap (running statistics batched in place; it cannot leave padded samples out); and with the
last client's batch partial (12 of 32), padded under the mask against split by width into one
call per width, with torch's BatchNorm and with fedddp's form (what the CPU path runs,
client/batched.py's ``_by_width``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"cnn": ((1, 28, 28), 10), "ffnn": ((14,), 1), "resnet18": ((3, 32, 32), 10)}
BATCH = 32


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(model_name: str, num_clients: int, mode: str, steps: int, device_name: str, seq_clients: int,
            optimizer: str = "sgd", epochs: int = 1, compile_: bool = False, precision: str = "fp32") -> dict:
    """One measurement in this process: client steps per second and peak memory (MiB); ``mode``
    sequential, batched, or eager (batched without run.compile: the compiled step's reference)."""
    import torch

    sys.path.insert(0, REPO)
    from fedddp import checks, tasks
    from fedddp.client import ClientContext, LocalTraining, train_client
    from fedddp.client import rules
    from fedddp.client.batched import BatchedTrainer
    from fedddp.data import ClientData
    from fedddp.flat import FlatLayout
    from fedddp import models

    torch.set_num_threads(1)
    device = torch.device(device_name)
    shape, classes = SHAPES[model_name]
    data_name = "cmapss" if model_name == "ffnn" else "mnist"
    cfg = checks.load(None, [f"model.name={model_name}", f"data.name={data_name}", f"train.batch_size={BATCH}",
                             f"train.local_steps={steps}", "train.lr=0.01", "data.num_clients=1000",
                             f"train.optimizer={optimizer}", f"run.compile={str(compile_).lower()}",
                             f"train.precision={precision}",
                             f"run.parallel_clients={num_clients if mode == 'batched' else 1}"])
    if mode == "eager":
        mode, compile_ = "batched", False
    task = tasks.get("regression" if model_name == "ffnn" else "classification")
    torch.manual_seed(0)
    model = getattr(models, model_name)(shape, classes).to(device)  # the built-in model itself
    layout = FlatLayout(model)
    global_P = layout.flatten(model).clone()
    rule, needs = rules.get("plain"), frozenset({"params_KP"})
    count = num_clients if mode == "batched" else min(num_clients, seq_clients)
    gen = torch.Generator().manual_seed(1)
    clients = []
    samples = BATCH * -(-steps // epochs)  # the local steps then span ``epochs`` epochs
    for _ in range(count):
        x = torch.randn((samples,) + shape, generator=gen).to(device)
        y = (torch.rand(samples, generator=gen) if model_name == "ffnn" else
             torch.randint(0, classes, (samples,), generator=gen)).to(device)
        clients.append(ClientData(x, y))
    rows_KP = torch.empty(count, layout.numel, device=device)

    def context(k):
        return ClientContext(k, 1, global_P, layout, cfg.algorithm, {}, {}, task=task)

    if mode == "batched":
        trainer = BatchedTrainer(model, layout, LocalTraining.of(cfg), rule, needs, task)

        def once(clients_now):
            trainer.train_group([(context(k), d, 1000 + k, 0, {"params_P": rows_KP[k]})
                                 for k, d in enumerate(clients_now)])
    else:
        def once(clients_now):
            for k, d in enumerate(clients_now):
                layout.unflatten_into(global_P, model)
                train_client(model, context(k), d, LocalTraining.of(cfg), rule, needs, 1000 + k,
                             {"params_P": rows_KP[k]})

    once(clients[:min(2, count)])  # warm-up: first allocations, kernel choice
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_mib()
    start = time.perf_counter()
    once(clients)
    sync()
    seconds = time.perf_counter() - start
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    out = {"steps_per_s": count * steps / seconds, "peak_mib": max(peak, 0.0), "clients_timed": count}
    if mode == "batched" and compile_:  # compiled in the untimed warm-up call
        compiled = trainer.whole_step or trainer.compiled
        out["compile_s"] = compiled.seconds
    return out


def batch_norm_forms(num_clients: int, steps: int, device_name: str) -> None:
    """Seconds per gradient step of ResNet-18 for num_clients clients side by side (batch 32, no
    padding), BatchNorm masked (fedddp.client.batched) against torch's, alternating, best of
    ``steps`` each."""
    import torch
    from torch.func import functional_call, grad_and_value, vmap

    sys.path.insert(0, REPO)
    from fedddp import models
    from fedddp.client import masked as masked_layers

    torch.set_num_threads(1)
    device = torch.device(device_name)
    torch.manual_seed(0)
    model = models.resnet18((3, 32, 32), 10).to(device)
    x = torch.randn(num_clients, BATCH, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (num_clients, BATCH), device=device)
    mask, count = torch.ones(num_clients, BATCH, device=device), torch.full((num_clients,), float(BATCH), device=device)
    params = {n: p.detach().expand((num_clients,) + p.shape).clone() for n, p in model.named_parameters()}
    buffers = {n: b.expand((num_clients,) + b.shape).clone() for n, b in model.named_buffers()}
    batch = masked_layers.Batch()
    twin = masked_layers.masked_twin(model, batch).train()

    def masked(p, b, x, y, mask, count):
        batch.mask, batch.count, batch.names, batch.stats = mask, count, [], []
        out = functional_call(twin, {**p, **b}, (x,))
        return torch.nn.functional.cross_entropy(out, y), tuple(batch.stats)

    def native(p, b, x, y, mask, count):  # updates the batched running statistics in place
        return torch.nn.functional.cross_entropy(functional_call(model, {**p, **b}, (x,)), y), ()

    masked_step, native_step = vmap(grad_and_value(masked, has_aux=True)), vmap(grad_and_value(native, has_aux=True))
    # a step where the last client has a partial batch of ``part``: padded under the mask, or
    # split by width into one call per width with torch's BatchNorm
    part, last = BATCH * 3 // 8, num_clients - 1
    mask_partial = mask.clone()
    mask_partial[last, part:] = 0
    count_partial = mask_partial.sum(1)

    def split_step(step):
        head = {n: t[:last] for n, t in params.items()}, {n: t[:last] for n, t in buffers.items()}
        tail = {n: t[last:] for n, t in params.items()}, {n: t[last:] for n, t in buffers.items()}
        if last:
            step(*head, x[:last], y[:last], mask[:last], count[:last])
        step(*tail, x[last:, :part], y[last:, :part], mask[last:, :part], count_partial[last:])

    def full(flag: bool, form):  # batch.full: the twin's BatchNorm runs torch's kernel (no padding)
        def call():
            batch.full = flag
            return form()
        return call

    forms = {"masked, full batches": full(False, lambda: masked_step(params, buffers, x, y, mask, count)),
             "fedddp's, full batches": full(True, lambda: masked_step(params, buffers, x, y, mask, count)),
             "torch, full batches": lambda: native_step(params, buffers, x, y, mask, count),
             f"masked, one batch of {part}": full(False, lambda: masked_step(params, buffers, x, y, mask_partial,
                                                                           count_partial)),
             f"split by width (torch's), one batch of {part}": lambda: split_step(native_step),
             f"split by width (fedddp's), one batch of {part}": full(True, lambda: split_step(masked_step))}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = {name: float("inf") for name in forms}
    for i in range(steps + 1):  # the first round warms up and is not counted
        for name, form in forms.items():
            sync()
            start = time.perf_counter()
            form()
            sync()
            if i:
                best[name] = min(best[name], time.perf_counter() - start)
    print(f"ResNet-18, {num_clients} clients side by side, batch {BATCH}, {device_name}, s a step: "
          + ", ".join(f"{name} {seconds:.3f}" for name, seconds in best.items())
          + f"; load average {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--clients", default="1,10,100,300")
    parser.add_argument("--models", default=None, help="default: cnn,ffnn,resnet18 on CUDA, cnn,ffnn on CPU "
                                                         "(ResNet-18 takes seconds a step there)")
    parser.add_argument("--steps", type=int, default=8, help="local steps (full batches of 32) per client")
    parser.add_argument("--seq-clients", type=int, default=10, help="clients timed one after another")
    parser.add_argument("--batch-norm", type=int, default=0, metavar="K",
                        help="time ResNet-18's masked BatchNorm against torch's for K clients side by side")
    parser.add_argument("--optimizer", default="sgd", help="train.optimizer: sgd, adam, adamp or rmsgd")
    parser.add_argument("--epochs", type=int, default=1, help="local epochs the --steps span (each client holds "
                                                               "steps / epochs batches)")
    parser.add_argument("--compile", action="store_true", help="run.compile=true: the side-by-side step compiled "
                        "(during the untimed warm-up), also timed against the eager side-by-side step")
    parser.add_argument("--precision", default="fp32", help="train.precision: fp32, tf32 or bf16 (both paths)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # model,K,mode: one measurement, JSON out
    args = parser.parse_args()
    if args.batch_norm:
        batch_norm_forms(args.batch_norm, args.steps, args.device or "cpu")
        return
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.models is None:
        args.models = "cnn,ffnn,resnet18" if args.device == "cuda" else "cnn,ffnn"
    if args.one:
        model_name, k, mode = args.one.split(",")
        print(json.dumps(measure(model_name, int(k), mode, args.steps, args.device, args.seq_clients,
                                 args.optimizer, args.epochs, args.compile, args.precision)))
        return
    device_text = args.device
    if args.device == "cuda":
        import torch
        device_text = torch.cuda.get_device_name()
    print(f"device {device_text}; batch {BATCH}, {args.steps} local steps per client over {args.epochs} "
          f"epoch(s), {args.optimizer}, precision {args.precision}{', compiled' if args.compile else ''}; "
          f"CPU: 1 thread; load average before: {os.getloadavg()[0]:.1f}\n")
    extra = " eager side by side steps/s | compiled / eager | compile s |" if args.compile else ""
    print("| model | clients K | sequential steps/s | side by side steps/s | speed-up | peak MiB sequential "
          "| peak MiB side by side |" + extra)
    print("|---|---|---|---|---|---|---|" + "---|" * (3 if args.compile else 0))
    for model_name in args.models.split(","):
        for k in [int(c) for c in args.clients.split(",")]:
            results = {}
            for mode in ("sequential", "batched") + (("eager",) if args.compile else ()):
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", f"{model_name},{k},{mode}",
                                       "--device", args.device, "--steps", str(args.steps),
                                       "--seq-clients", str(args.seq_clients), "--optimizer", args.optimizer,
                                       "--epochs", str(args.epochs), "--precision", args.precision]
                                      + (["--compile"] if args.compile else []),
                                      capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
                if proc.returncode != 0:
                    last = (proc.stderr.strip().splitlines() or ["?"])[-1]
                    results[mode] = {"error": last[:80]}
                else:
                    results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
            seq, bat = results["sequential"], results["batched"]

            def rate(r):
                return r.get("error") or f"{r['steps_per_s']:.3g}"

            def mem(r):
                return "-" if "error" in r else f"{r['peak_mib']:.1f}"

            speedup = (f"{bat['steps_per_s'] / seq['steps_per_s']:.2f}x"
                       if "error" not in bat and "error" not in seq else "-")
            row = f"| {model_name} | {k} | {rate(seq)} | {rate(bat)} | {speedup} | {mem(seq)} | {mem(bat)} |"
            if args.compile:
                eager = results["eager"]
                ratio = (f"{bat['steps_per_s'] / eager['steps_per_s']:.2f}x"
                         if "error" not in bat and "error" not in eager else "-")
                row += f" {rate(eager)} | {ratio} | {bat.get('compile_s') or 0:.1f} |"
            print(row, flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
