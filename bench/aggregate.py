"""Throughput of the server rules over stacked [K, P] float32 reports.

    python bench/aggregate.py               # cuda if available, else cpu; ~5 minutes on 1 core
    python bench/aggregate.py --quick       # K = 4 and 32 only
    python bench/aggregate.py --threads 2   # torch intra-op threads (default 1 = run.num_threads)
    python bench/aggregate.py --rules fedcong,cgw --counts 4 --models resnet18-c100 --no-naive
    python bench/aggregate.py --quick --march x86-64-v3   # the AVX2 kernels on any x86-64-v3 CPU
    python bench/aggregate.py --quick --lanes 16          # A/B: FedGMA's and FedCong's lane count
    python bench/aggregate.py --device cuda               # Triton kernels beside the torch ops
    TRITON_INTERPRET=1 python bench/aggregate.py --device cpu --kernel triton --smoke
                                            # the CUDA code path on CPU, tiny sizes (a test)

For each rule, K in {4, 32, 100} and P of seed 002's CNN (MNIST) and of ResNet-18 (CIFAR-100,
buffers included, as fedddp flattens them), it prints one Markdown row:
  form         the form the runtime uses for the rule on this machine: "c" (fused C kernel) or
               "torch" (torch ops), as chosen by the probe of fedddp.strategies.kernels; on
               CUDA "triton" (fused Triton kernel) where triton imports
  ms/call      best time of one aggregate call over a few repetitions after a warm-up (inputs
               already on the device), in that form. On one CPU thread the clock is the
               process's CPU time (user + sys, so page faults of fresh outputs count) rather
               than wall time: on a machine shared with other jobs wall time mostly measures
               the other jobs.
  GB/s         bytes of the [K, P] stacks the rule reads (K P 4 per stack: 2 stacks for FedGMA
               with the last-step gradient and for CGW) divided by ms/call
  ratio        GB/s / copy bandwidth, where copy bandwidth = (read + write bytes) / time of one
               512 MiB tensor copy measured in the same run (so ratio 1 means the rule streams
               its input as fast as a copy moves bytes in and out)
  C / Triton   ms and ratio of the rule's fused kernel: the C kernel (FEDDDP_KERNELS=c) on
               CPU, the Triton kernel (FEDDDP_KERNELS=triton) on CUDA (--kernel picks)
  torch-op     ms and ratio of the rule's torch-op form (FEDDDP_KERNELS=torch; the fallback
               on CUDA; --no-torch-form skips it); the default form's figures are the ones
               of its form, measured once
  naive ratio  the same for the obvious composition of torch ops (every step materialising its
               [K, P] temporary), and speedup = naive ms / fused ms.
Naive versions that would need more than NAIVE_BUDGET bytes of temporaries are skipped.
Legend: K sampled clients, P flat parameters, L conv layers.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as python -m fedddp sets it (see __main__)
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fedddp import strategies  # noqa: E402
from fedddp.config import AlgorithmConfig  # noqa: E402
from fedddp.flat import FlatLayout, runs_R3  # noqa: E402
from fedddp.strategies import kernels  # noqa: E402

NAIVE_BUDGET = 4 * 2 ** 30
HP = AlgorithmConfig(server_lr=1.0, params={"server_momentum": 0.9, "cong_alpha": 0.7, "gma_threshold": 0.8,
                                            "gma_grad": "last", "gma_mask": "hard", "cgw_alpha": 0.1,
                                            "trim_beta": 0.2})


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


SMOKE = False   # --smoke: one timed call each, tiny sizes (the code path, not a measurement)


def timed(fn, device, min_total=0.4, max_reps=30) -> float:
    """Best seconds per call after one warm-up (none with --smoke); fewer repetitions for slow calls (on a shared
    machine the best of many short calls is the stable figure)."""
    if SMOKE:
        min_total, max_reps = 0.0, 1
    else:
        fn()
        sync(device)
    times = []
    while len(times) < max_reps and (len(times) < 2 or sum(times) < min_total):
        start = clock()
        fn()
        sync(device)
        times.append(clock() - start)
        if sum(times) > 2.0:  # multi-second calls: one timed call after the warm-up is enough
            break
    return min(times)


def copy_bandwidth(device) -> float:
    """(read + write) bytes per second of one 512 MiB copy."""
    src = torch.rand(2 ** 16 if SMOKE else 128 * 2 ** 20, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, min_total=1.0, max_reps=10)
    return 2 * src.numel() * 4 / seconds


MODELS = ("cnn-mnist", "resnet18-c100")   # --models names (--smoke: "smoke")


def model_layouts():
    """(name, P, conv_group_P, L) for seed 002's CNN on MNIST and ResNet-18 on CIFAR-100
    (--smoke: a made-up 1,001-column layout of 3 conv layers)."""
    if SMOKE:
        group_P = torch.cat([torch.full((5,), -1), torch.arange(3).repeat_interleave(332)])
        return [("smoke", group_P.numel(), group_P, 3)]
    try:
        from fedddp.models import cnn, resnet18
        nets = list(zip(MODELS, (cnn((1, 28, 28), 10), resnet18((3, 32, 32), 100))))
    except ImportError:
        # Fallback: the same architectures built here (two 5x5 convs: 1->32, 32->64, FC 1024->512->10).
        import torchvision
        from torch import nn
        small = nn.Sequential(nn.Conv2d(1, 32, 5), nn.Conv2d(32, 64, 5), nn.Flatten(),
                              nn.Linear(64 * 4 * 4, 512), nn.Linear(512, 10))
        nets = list(zip(MODELS, (small, torchvision.models.resnet18(num_classes=100))))
    out = []
    for name, net in nets:
        layout = FlatLayout(net)
        out.append((name, layout.numel, layout.conv_group_P(), len(layout.conv_entries())))
    return out


# -- naive compositions: the obvious way, each step materialising its [K, P] temporary -------

def naive_weights(stacks):
    n = stacks["num_samples_K"]
    return n / n.sum()


def naive_fedavg(global_P, stacks, state, hp):
    return (naive_weights(stacks)[:, None] * stacks["params_KP"]).sum(0)


def naive_fedmom(global_P, stacks, state, hp):
    delta = (naive_weights(stacks)[:, None] * (stacks["params_KP"] - global_P)).sum(0)
    velocity = hp.params["server_momentum"] * (global_P - state["previous_P"]) + delta
    return global_P + velocity


def naive_fedcong(global_P, stacks, state, hp):
    W = stacks["params_KP"]
    K = W.shape[0]
    u = W - global_P
    pos, neg = u > 0, u < 0
    num_pos, num_neg = pos.sum(0), neg.sum(0)
    need = max(1, math.ceil(hp.params["cong_alpha"] * K - 1e-9))
    take_pos = (num_pos >= need) & ((num_neg < need) | (num_pos >= num_neg))
    take_neg = (num_neg >= need) & ~take_pos
    member = torch.where(take_pos, pos, torch.where(take_neg, neg, torch.ones_like(pos)))
    wts = naive_weights(stacks)[:, None] * member
    return (wts * W).sum(0) / wts.sum(0)


def naive_fedgma(global_P, stacks, state, hp):
    W, G = stacks["params_KP"], stacks["last_grad_KP"]
    p = naive_weights(stacks)[:, None]
    agree = torch.sign(G).sum(0).abs()
    mask = (agree >= hp.params["gma_threshold"] * W.shape[0]).float()
    grad = (p * G * mask).sum(0)
    return (p * W).sum(0) - hp.server_lr * grad


def naive_cgw(global_P, stacks, state, hp):
    W, D = stacks["params_KP"], stacks["full_grad_KP"]
    gram = D @ D.T
    sq = gram.diagonal()
    norm = sq.sqrt()
    m = gram.sum(1)
    c = (hp.params["cgw_alpha"] * stacks["full_loss_K"] / norm).min()
    x = c / (m / norm).pow(2).sum().sqrt() * m / sq
    return (naive_weights(stacks)[:, None] * W).sum(0) - (x[:, None] * D).sum(0)


def naive_feder(global_P, stacks, state, hp):
    W = stacks["params_KP"]
    er = stacks["eff_rank_KL"].clamp(min=1e-3)
    alpha = er / er.sum(0)
    table = torch.cat([torch.full((W.shape[0], 1), 1.0 / W.shape[0], device=W.device), alpha], 1)
    return (table[:, stacks["conv_group_P"] + 1] * W).sum(0)


def naive_fedmedian(global_P, stacks, state, hp):
    W = stacks["params_KP"]
    K = W.shape[0]
    ordered = W.sort(0).values
    return (ordered[(K - 1) // 2] + ordered[K // 2]) / 2


def naive_fedtrimmedavg(global_P, stacks, state, hp):
    W = stacks["params_KP"]
    K = W.shape[0]
    b = math.floor(hp.params["trim_beta"] * K + 1e-9)
    return W.sort(0).values[b:K - b].mean(0)


# rule -> (naive fn, [K, P] stacks read, [K, P]-sized float temporaries of the naive version)
RULES = {
    "fedavg": (naive_fedavg, 1, 1),
    "fedmom": (naive_fedmom, 1, 2),
    "fedcong": (naive_fedcong, 1, 5),
    "feder": (naive_feder, 1, 2),
    "fedgma": (naive_fedgma, 2, 4),
    "cgw": (naive_cgw, 2, 2),
    "fedmedian": (naive_fedmedian, 1, 3),          # sorted values + int64 indices
    "fedtrimmedavg": (naive_fedtrimmedavg, 1, 3),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="K = 4 and 32 only")
    parser.add_argument("--rules", default=",".join(RULES), help="comma-separated subset")
    parser.add_argument("--counts", default=None,
                        help="comma-separated client counts K (default 4,32,100; --quick: 4,32)")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated subset of {','.join(MODELS)} (default both)")
    parser.add_argument("--no-naive", action="store_true", help="skip the naive compositions")
    parser.add_argument("--no-torch-form", action="store_true",
                        help="skip timing the rules' torch-op form")
    parser.add_argument("--kernel", choices=("c", "triton"), default=None,
                        help="the fused form timed beside the torch ops: c (default on CPU) or "
                             "triton (default on CUDA; on CPU only under TRITON_INTERPRET=1)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes and one call per form, no naive forms: checks the code "
                             "path (e.g. the Triton one on CPU under the interpreter), measures "
                             "nothing")
    parser.add_argument("--march", default="native",
                        help="-march of the C kernels' build (e.g. x86-64-v3: the AVX2 code path on "
                             "an AVX-512 machine; 'baseline': the compiler's default)")
    parser.add_argument("--lanes", type=int, default=None,
                        help="lane count of the register-chunk kernels (FedGMA, FedCong) instead of "
                             "the instruction set's (16 AVX-512, 8 AVX2, 4 otherwise)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (the runtime pins run.num_threads, default 1)")
    parser.add_argument("--clock", choices=tuple(CLOCK), default=None,
                        help="wall: elapsed time; cpu: this process's CPU time (user + sys), which "
                             "does not count time the OS gave to other jobs. Default: cpu for one "
                             "CPU thread, wall otherwise")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global clock, SMOKE
    SMOKE = args.smoke
    clock_name = args.clock or ("cpu" if args.device == "cpu" and args.threads == 1 else "wall")
    clock = CLOCK[clock_name]
    device = torch.device(args.device)
    rules = [r for r in args.rules.split(",") if r]
    counts = (3,) if args.smoke else (4, 32) if args.quick else (4, 32, 100)
    if args.counts:
        counts = tuple(int(k) for k in args.counts.split(","))
    models = [m for m in args.models.split(",") if m] if args.models else None
    # a name that matches nothing was an empty table: refused in one line instead
    for kind, asked, valid in (("rule", rules, tuple(RULES)),
                               ("model", models or (), ("smoke",) if SMOKE else MODELS)):
        unknown = [name for name in asked if name not in valid]
        if unknown:
            parser.exit(2, f"bench/aggregate.py: unknown {kind}(s) {', '.join(unknown)}; valid: "
                           f"{', '.join(valid)}\n")
    start = time.perf_counter()

    bandwidth = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu, {torch.get_num_threads()} threads"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"device: {name}; torch {torch.__version__}; clock: {clock_name}; "
          f"load average at start {load:.1f}; THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')}")
    kernel = args.kernel or ("c" if device.type == "cpu" else "triton")
    if kernel == "triton":
        os.environ["FEDDDP_KERNELS"] = "triton"       # lib() says whether Triton runs here
        if kernels.lib(torch.zeros(1, device=device)) is None:
            print("Triton kernels: unavailable (they need CUDA and triton, or on CPU "
                  "TRITON_INTERPRET=1)")
            kernel = None
        chosen = {rule: kernel or "torch" for rule in rules}
    elif device.type == "cpu":
        print(f"cpu: {kernels.cpu_description()}")
        try:
            kernels._loaded = kernels.compile_library(None if args.march == "baseline" else args.march,
                                                      args.lanes)
            print(f"C kernels: -march={args.march}, {kernels._loaded.fd_lanes()}-lane vectors")
        except OSError as exc:
            print(f"C kernels: unavailable ({exc})")
        os.environ.pop("FEDDDP_KERNELS", None)
        chosen = {rule: kernels.forms()[rule][0] if kernels._loaded is not None else "torch"
                  for rule in rules}
    else:                                             # --kernel c: the C kernels are CPU-only
        kernel = None
        chosen = {rule: "torch" for rule in rules}
    # the fused form beside the torch ops; the default is the one the runtime chose
    forms = ([kernel] if kernel else []) + ([] if args.no_torch_form and kernel else ["torch"])
    print(f"form of the rules: {kernels.describe(device)}")
    os.environ.pop("FEDDDP_KERNELS", None)
    print(f"copy bandwidth ({'256 KiB' if SMOKE else '512 MiB'} tensor copy, read + write bytes): "
          f"{bandwidth / 1e9:.1f} GB/s\n")
    fused_name = "Triton" if kernel == "triton" else "C"
    print(f"| rule | K | P | stacks | form | ms/call | GB/s | ratio | {fused_name} ms | {fused_name} "
          "ratio | torch-op ms | torch-op ratio | naive ms | naive ratio | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    gen = torch.Generator(device=device).manual_seed(0)
    for model_name, num_params, group_P, num_layers in model_layouts():
        if models is not None and model_name not in models:
            continue
        for num_clients in counts:
            global_P = torch.randn(num_params, device=device, generator=gen)
            params_KP = torch.randn(num_clients, num_params, device=device, generator=gen)
            params_KP.mul_(0.01).add_(global_P)
            stacks = {
                "params_KP": params_KP,
                "num_samples_K": torch.randint(10, 100, (num_clients,), device=device, generator=gen).float(),
                "train_loss_K": torch.rand(num_clients, device=device, generator=gen),
                "full_loss_K": 0.5 + torch.rand(num_clients, device=device, generator=gen),
                "eff_rank_KL": 3 * torch.rand(num_clients, num_layers, device=device, generator=gen),
                "conv_group_P": group_P.to(device),    # for the naive FedER
                "conv_runs_R3": runs_R3(group_P).to(device),
            }
            for rule in rules:
                naive_fn, num_stacks, num_temps = RULES[rule]
                if num_stacks == 2 and "last_grad_KP" not in stacks:
                    grads_KP = torch.randn(num_clients, num_params, device=device, generator=gen)
                    stacks["last_grad_KP"] = stacks["full_grad_KP"] = grads_KP
                strategy = strategies.get(rule)
                state = strategy.init_state(global_P, HP)
                if "previous_P" in state:  # a velocity that is not zero
                    state["previous_P"].add_(torch.randn(num_params, device=device, generator=gen),
                                             alpha=0.01)
                read_bytes = num_stacks * num_clients * num_params * 4
                seconds = {}
                for _ in range(1 if SMOKE else 2):   # both forms twice, alternating: they share any drift
                    for form in forms:
                        os.environ["FEDDDP_KERNELS"] = form
                        best = timed(lambda: strategy.aggregate(global_P, stacks, state, HP), device)
                        seconds[form] = min(seconds.get(form, best), best)
                os.environ.pop("FEDDDP_KERNELS")
                form = chosen[rule] if chosen[rule] in seconds else forms[0]
                fused_s = seconds[form]
                fused_rate = read_bytes / fused_s

                def cells(f):
                    return (f"{seconds[f] * 1e3:.1f} | {read_bytes / seconds[f] / bandwidth:.2f}"
                            if f in seconds else "- | -")
                if args.no_naive or args.smoke:
                    naive = "- | - | -"
                elif num_temps * num_clients * num_params * 4 <= NAIVE_BUDGET:
                    naive_s = timed(lambda: naive_fn(global_P, stacks, state, HP), device)
                    naive = (f"{naive_s * 1e3:.1f} | {read_bytes / naive_s / bandwidth:.2f} | "
                             f"{naive_s / fused_s:.1f}x")
                else:
                    naive = "skipped (memory) | - | -"
                print(f"| {rule} | {num_clients} | {num_params:,} | {num_stacks} | {form} | "
                      f"{fused_s * 1e3:.1f} | {fused_rate / 1e9:.1f} | {fused_rate / bandwidth:.2f} | "
                      f"{cells(kernel)} | {cells('torch')} | {naive} |", flush=True)
            stacks = params_KP = None  # free the stacks before the next K
    print(f"\ntotal bench time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
