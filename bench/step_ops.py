"""Ops dispatched per side-by-side step, by kind: fedddp's step (``BatchedTrainer.train_group``)
against the plain step its math needs: the batch gathered from the clients' samples by an index,
``vmap(grad(loss))``, and the optimizer as ``torch._foreach_*`` over the stacks, on the same
model, clients and batches.

On a GPU each op dispatched is at least one kernel launch, and a step of many small clients is
bound by launches and host work, not arithmetic: the count is the figure that moves a GPU step,
and it is the same on CPU (counted there, so it needs no GPU). Counted with ``torch.profiler``:
top-level ``aten::`` ops (not those an op calls inside itself), views and allocations left out
(``UNCOUNTED``). A ``torch._foreach_*`` op counts once, as it launches on a GPU where its tensors
share shape, dtype and device (on CPU it runs a loop of per-tensor ops inside). fedddp's per-step count is the difference of two runs of the same group, one
with more steps than the other, over the difference in steps: what is paid once a group (stacks,
reports) cancels, and what is paid once a client's epoch (its sample permutation, a host-side
``randperm`` on a GPU run too) is spread over its steps.

    python bench/step_ops.py [--clients 10] [--cases sgd,momentum,adam,fedprox,scaffold,dropout,batchnorm]
                             [--device cpu|cuda] [--precision fp32|bf16] [--by-kind] [--compile [--replay-copies]]

``--compile``: run.compile=true, whose whole step (SGD, Adam: client/compiled.py's ``WholeStep``)
is one compiled call; the ops counted are those a step dispatches outside the compiled graph
(its batch, the rates, the live mask, the call; on CUDA one ``_foreach_copy_`` a dtype of what
the step hands the next out of the CUDA graph's pool, compiled.Persistent, which
``--replay-copies`` makes on CPU too; the casts column then counts those copies), the graph's own apart (``graph``: on CPU
inductor's extern kernels, convolutions and matrix products, on a GPU one CUDA graph replay).

fedddp's batch index is built once a group, on the host (its clients' permutations come from
their own CPU generators, ``randperm`` at each client's epoch), and moved to the device once:
those ops are counted apart (``host``), spread over the steps, and are no kernel launches on a
GPU but the final copies.

Cases: the seed CNN (1x28x28, 10 classes), batch 10, plain SGD unless named: ``momentum``
(SGD, momentum 0.9), ``adam``, ``fedprox`` (mu 0.01), ``scaffold``, ``dropout`` (a CNN with
nn.Dropout(0.5) before its last layer), ``batchnorm`` (a CNN with BatchNorm2d after its first
convolution, flat buffers). Prints a row per case: fedddp's ops a step, the plain step's, and
their ratio; ``--by-kind`` adds each one's count by op name. ``tests/test_step_ops.py`` pins
fedddp's counts (a count, never a time).

``--precision bf16``: fedddp's step with train.precision = bf16 (client/precision.py) against
the plain step plus the casts its math needs in bfloat16: each parameter and the batch cast to
bfloat16 once at the top of the loss, the logits back to float32 for the loss (BatchNorm: its
input to float32 and its output back, its weight and bias float32), each cast's backward one
more. The ``casts`` column counts the dtype conversions a step (``CASTS``), fedddp's and the
plain step's: fedddp casts every parameter of every client down in one ``_foreach_copy_`` and
their gradients up in another, so its casts do not grow with the model's tensors, and none runs
per convolution or linear call.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Ops that launch no computation: views, metadata, and allocations whose memory the next op writes
UNCOUNTED = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::as_strided", "aten::expand", "aten::select",
    "aten::slice", "aten::unsqueeze", "aten::squeeze", "aten::t", "aten::transpose", "aten::permute",
    "aten::alias", "aten::detach", "aten::lift_fresh", "aten::empty", "aten::empty_like", "aten::empty_strided",
    "aten::resize_", "aten::unbind", "aten::split", "aten::chunk", "aten::narrow", "aten::flatten",
    "aten::view_as", "aten::expand_as", "aten::contiguous", "aten::result_type", "aten::is_nonzero",
    "aten::_reshape_alias", "aten::set_", "aten::unflatten", "aten::numpy_T", "aten::movedim",
})
CASES = ("sgd", "momentum", "adam", "fedprox", "scaffold", "dropout", "batchnorm")
# a dtype conversion, as the profiler names it at top level (a foreach copy: every tensor of a list)
CASTS = ("aten::to", "aten::_to_copy", "aten::_foreach_copy_")
BATCH = 10
SAMPLES = 40  # a client's samples: 4 full batches an epoch


# fedddp's named range around a group's batch index, built once a group on the host (CPU
# tensors: the clients' own generators), its few results moved to the device once
HOST_SETUP = "fedddp::group_batches"
# the profiler's ranges around a torch.compile'd call: ops within them are the graph's
COMPILED_REGIONS = ("Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph")


def counted(fn) -> tuple[collections.Counter, collections.Counter]:
    """The top-level aten ops ``fn()`` dispatches by name, less ``UNCOUNTED``: those of the
    steps, and apart those within ``HOST_SETUP``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops, host, graph = collections.Counter(), collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.name.startswith("Torch-Compiled Region"):
            ops["compiled call"] += 1  # the call of the compiled step: one a step
        if event.name.startswith("aten::") and event.name not in UNCOUNTED:
            parent, in_setup, in_graph = event.cpu_parent, False, False
            while parent is not None and not parent.name.startswith("aten::"):
                in_setup |= parent.name == HOST_SETUP
                in_graph |= parent.name.startswith(COMPILED_REGIONS)
                parent = parent.cpu_parent
            if parent is None:
                (graph if in_graph else host if in_setup else ops)[event.name] += 1
    return ops, host, graph


def model_of(case: str, torch):
    """The seed CNN, or with nn.Dropout or BatchNorm2d added (``case``)."""
    from torch import nn

    from fedddp import models

    torch.manual_seed(0)
    return _with(case, nn) if case in ("dropout", "batchnorm") else models.cnn((1, 28, 28), 10)


def _with(case: str, nn):
    layers = [nn.Conv2d(1, 8, 5), nn.BatchNorm2d(8) if case == "batchnorm" else nn.Identity(), nn.ReLU(),
              nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 12 * 12, 32), nn.ReLU()]
    if case == "dropout":
        from fedddp.models.dropout import SeededDropout
        layers.append(SeededDropout(0.5, 0))
    return nn.Sequential(*layers, nn.Linear(32, 10))


def overrides_of(case: str, clients: int, precision: str = "fp32") -> list[str]:
    out = ["data.name=mnist", f"train.batch_size={BATCH}", "train.lr=0.01", "data.num_clients=1000",
           f"run.parallel_clients={clients}", "model.flat_buffers=true", f"train.precision={precision}"]
    return out + {"momentum": ["train.momentum=0.9"], "adam": ["train.optimizer=adam"],
                  "fedprox": ["algorithm.name=fedprox", "algorithm.params.prox_mu=0.01"],
                  "scaffold": ["algorithm.name=scaffold"]}.get(case, [])


def fedddp_step(case: str, clients: int, device, steps: int, precision: str = "fp32", compile_: bool = False):
    """A function that trains one group of ``clients`` side by side for ``steps`` steps (with
    run.compile where ``compile_``)."""
    import torch

    from fedddp import checks, strategies, tasks
    from fedddp.client import ClientContext, LocalTraining, rules
    from fedddp.client.batched import BatchedTrainer
    from fedddp.data import ClientData
    from fedddp.flat import FlatLayout
    from fedddp.registry import resolve

    cfg = checks.load(None, overrides_of(case, clients, precision) + [f"train.local_steps={steps}",
                                                                      f"run.compile={str(compile_).lower()}"])
    model = model_of(case, torch).to(device)
    layout = FlatLayout(model, buffers=True)
    global_P = layout.flatten(model).clone()
    local, server = resolve(cfg.algorithm)
    rule = rules.get(local)
    needs = strategies.ALWAYS | strategies.get(server).needs_for(cfg.algorithm)
    task = tasks.get("classification")
    trainer = BatchedTrainer(model, layout, LocalTraining.of(cfg), rule, needs, task)
    gen = torch.Generator().manual_seed(1)
    data = [ClientData(torch.randn(SAMPLES, 1, 28, 28, generator=gen).to(device),
                       torch.randint(0, 10, (SAMPLES,), generator=gen).to(device)) for _ in range(clients)]
    rows_KP = torch.zeros(clients, layout.numel, device=device)
    server_view = {"control_P": torch.full_like(global_P, 1e-3)}
    control_KP = torch.full((clients, layout.numel), 2e-3, device=device)

    def once():
        group = []
        for k, d in enumerate(data):
            # SCAFFOLD's controls: the server's c and the client's c_k, each nonzero as after a round
            ctx = ClientContext(k, 2, global_P, layout, cfg.algorithm, dict(server_view),
                                {"control_P": control_KP[k]}, task=task)
            group.append((ctx, d, 1000 + k, 0, {"params_P": rows_KP[k], "last_grad_P": rows_KP[k].clone(),
                                                "control_delta_P": rows_KP[k].clone()}))
        trainer.train_group(group)
    return once


def plain_step(case: str, clients: int, device, precision: str = "fp32"):
    """One step of the math alone: the batch gathered, vmap(grad(loss)), the local rule's
    direction (FedProx, SCAFFOLD) and the optimizer as _foreach ops; Dropout's masks drawn at
    once for all clients, BatchNorm's running statistics updated with one _foreach op. bf16:
    the casts its math needs, and no other (the module's docstring)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    if case in ("dropout", "batchnorm"):
        # _with's layers, with BatchNorm on the batch's statistics alone (their running update below)
        model = _with("sgd", nn)
        if case == "batchnorm":
            model[1] = nn.BatchNorm2d(8, track_running_stats=False)
    else:
        model = models_cnn(torch)
    model = model.to(device)
    names = [n for n, _ in model.named_parameters()]
    params_T = [p.detach().expand((clients,) + p.shape).clone() for p in model.parameters()]
    # the clients' samples in one tensor and a batch index: the step gathers its batches, as
    # any loop over real data does
    samples_x = torch.randn(clients * SAMPLES, 1, 28, 28, device=device)
    samples_y = torch.randint(0, 10, (clients * SAMPLES,), device=device)
    index = torch.randperm(clients * SAMPLES, device=device)[:clients * BATCH].view(clients, BATCH)
    running_T = [torch.zeros(clients, 8, device=device), torch.ones(clients, 8, device=device)]
    anchor_T = [p.clone() for p in params_T]
    correction_T = [torch.full_like(p, 1e-3) for p in params_T]

    low = torch.bfloat16 if precision == "bf16" else None

    def lowered(params, xb):  # bf16: each tensor cast once (BatchNorm's weight and bias stay float32)
        if low is None:
            return params, xb
        return [p if case == "batchnorm" and i in (2, 3) else p.to(low) for i, p in enumerate(params)], xb.to(low)

    def raised(out):  # bf16: the logits in float32 for the loss
        return out if low is None else out.float()

    def loss(params, xb, yb, mask):
        params, xb = lowered(params, xb)
        if case == "batchnorm":  # its batch statistics beside, for the running ones
            conv_w, conv_b, bn_w, bn_b, *rest = params
            h = F.conv2d(xb, conv_w, conv_b)
            h = h if low is None else h.float()
            var_C, mean_C = torch.var_mean(h.detach(), dim=(0, 2, 3), correction=1)
            h = F.batch_norm(h, None, None, bn_w, bn_b, True, 0.0, 1e-5)
            h = h if low is None else h.to(low)
            tail = model[2:]  # after the convolution and BatchNorm
            out = functional_call(tail, dict(zip([n for n, _ in tail.named_parameters()], rest)), (h,))
            return F.cross_entropy(raised(out), yb), (mean_C, var_C)
        if case != "dropout":
            return F.cross_entropy(raised(functional_call(model, dict(zip(names, params)), (xb,))), yb), ()
        hidden = functional_call(model[:-1], dict(zip(names, params[:-2])), (xb,))
        out = functional_call(model[-1], dict(zip(("weight", "bias"), params[-2:])), (hidden * mask,))
        return F.cross_entropy(raised(out), yb), ()
    grads = vmap(grad(loss, has_aux=True))
    momentum_T = [torch.zeros_like(p) for p in params_T]
    exp_avg_T = [torch.zeros_like(p) for p in params_T]
    exp_avg_sq_T = [torch.zeros_like(p) for p in params_T]

    def once():
        x, y = samples_x[index], samples_y[index]
        mask = (torch.rand(clients, BATCH, 32, device=device) < 0.5).to(low or torch.float32) / 0.5 \
            if case == "dropout" else x
        g_T, stats = grads(params_T, x, y, mask)
        if case == "batchnorm":  # the running statistics: one update of all of them
            torch._foreach_lerp_(running_T, list(stats), 0.1)
        if case == "fedprox":  # its direction g + mu (w - w_global)
            g_T = torch._foreach_add(g_T, torch._foreach_sub(params_T, anchor_T), alpha=0.01)
        elif case == "scaffold":  # g + c - c_k
            g_T = torch._foreach_add(g_T, correction_T)
        if case == "momentum":
            torch._foreach_mul_(momentum_T, 0.9)
            torch._foreach_add_(momentum_T, g_T)
            torch._foreach_add_(params_T, momentum_T, alpha=-0.01)
        elif case == "adam":
            torch._foreach_lerp_(exp_avg_T, g_T, 0.1)
            torch._foreach_mul_(exp_avg_sq_T, 0.999)
            torch._foreach_addcmul_(exp_avg_sq_T, g_T, g_T, 0.001)
            denom = torch._foreach_sqrt(exp_avg_sq_T)
            torch._foreach_add_(denom, 1e-8)
            torch._foreach_addcdiv_(params_T, exp_avg_T, denom, -0.01)
        else:
            torch._foreach_add_(params_T, g_T, alpha=-0.01)
    return once


def models_cnn(torch):
    from fedddp import models

    torch.manual_seed(0)
    return models.cnn((1, 28, 28), 10)


def measure(case: str, clients: int, device_name: str, precision: str = "fp32", compile_: bool = False) -> dict:
    """fedddp's ops a step by kind (``fedddp_ops``; with ``compile_`` those outside the compiled
    graph, the graph's in ``graph_ops``), its host set-up's, and the plain step's."""
    import torch

    sys.path.insert(0, REPO)
    device = torch.device(device_name)
    short, long = 2, 6
    runs = {steps: fedddp_step(case, clients, device, steps, precision, compile_) for steps in (short, long)}
    for once in runs.values():
        once()  # warm-up: first calls set up what they cache
    counts = {steps: counted(once) for steps, once in runs.items()}

    def per_step(which: int) -> collections.Counter:
        more, fewer = counts[long][which], counts[short][which]
        return collections.Counter({k: (more[k] - fewer[k]) / (long - short) for k in more | fewer
                                    if more[k] != fewer[k]})
    plain = plain_step(case, clients, device, precision)
    plain()
    plain_ops = counted(plain)[0]
    ours, host, graph, base = per_step(0), per_step(1), per_step(2), sum(plain_ops.values())
    return {"case": case, "fedddp": sum(ours.values()), "host": sum(host.values()), "plain": base,
            "ratio": sum(ours.values()) / base, "fedddp_ops": ours, "host_ops": host, "plain_ops": plain_ops,
            "casts": sum(ours[k] for k in CASTS), "plain_casts": sum(plain_ops[k] for k in CASTS),
            "graph": sum(graph.values()), "graph_ops": graph}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                        help="train.precision of fedddp's step; the plain step gets the casts bf16 needs")
    parser.add_argument("--by-kind", action="store_true")
    parser.add_argument("--compile", action="store_true", help="run.compile=true: the ops a step dispatches "
                        "outside its compiled graph (the graph's own apart)")
    parser.add_argument("--replay-copies", action="store_true", help="with --compile: the copies of a step's "
                        "outputs a CUDA graph's replay needs (compiled.Persistent), made on any device, so "
                        "the CUDA path's ops are counted on CPU")
    args = parser.parse_args(argv)
    if args.replay_copies:
        sys.path.insert(0, REPO)
        from fedddp.client import batched

        batched.replay_outputs_freed = lambda device: True
    print(f"ops a side-by-side step, {args.clients} clients, batch {BATCH}, on {args.device}, {args.precision}"
          + (", run.compile (fedddp: ops outside the compiled graph, the call included; graph: within it)"
             if args.compile else ""))
    print("fedddp: ops in its steps, a step; host: ops of its batch index built once a group on the host "
          "(per step); plain: the math alone; casts: fedddp's dtype conversions a step (the plain step's)")
    print(f"{'case':<10} {'fedddp':>8} {'plain':>6} {'ratio':>6} {'host':>6} {'casts':>11} {'graph':>6}")
    for case in args.cases.split(","):
        row = measure(case, args.clients, args.device, args.precision, args.compile)
        casts = f"{row['casts']:g} ({row['plain_casts']:g})"
        print(f"{case:<10} {row['fedddp']:>8.1f} {row['plain']:>6} {row['ratio']:>6.2f} {row['host']:>6.1f} "
              f"{casts:>11} {row['graph']:>6.1f}", flush=True)
        if args.by_kind:
            for label, ops in (("fedddp", row["fedddp_ops"]), ("host", row["host_ops"]), ("graph", row["graph_ops"]),
                               ("plain", row["plain_ops"])):
                print(f"  {label}: " + ", ".join(f"{k.removeprefix('aten::')} {v:g}" for k, v in ops.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
