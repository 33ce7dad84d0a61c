"""AdamP and RMSGD for clients side by side (fedddp.client.batched_optim) against the packages
the sequential path uses (adamp.AdamP, rmsgd.RMSGD), per client.

Unit tolerance: the stacked updates are the packages' arithmetic over a client dimension, so a
step differs from the per-client one only where a batched reduction (AdamP's norms and cosine
similarities) sums in another order: after the steps below parameters agree to ATOL + RTOL |p|
(float32; measured for AdamP: at most 1.2e-7), RMSGD's rates (float64, from EVBMF of the
slightly different tensors) to RATE_RTOL. A wrong branch, rate or momentum moves parameters by
1e-3 and more (AdamP without its projection: 5e-3 after one step). End to end: the tolerance of
tests/test_parallel_clients.py (TOL of the largest weight).
Legend: L clients stacked, T parameter tensors of a client.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from adamp import AdamP
from rmsgd import RMSGD

from fedddp.client import batched_optim
from fedddp.client.batched_optim import StackedOptimizer

from fedrun import make_mnist_like
from test_parallel_clients import TOL, final_P

ATOL, RTOL, RATE_RTOL = 1e-6, 1e-5, 1e-5
# a conv layer, its bias, a second conv layer, a linear layer and its bias (RMSGD's metrics read
# the conv layers; the others take the rate before them)
SHAPES = [(4, 3, 3, 3), (4,), (6, 4, 3, 3), (5, 24), (5,)]


class Tc:
    """The train.* fields the stacked optimizers read."""

    def __init__(self, optimizer, weight_decay=0.0, momentum=0.0, rmsgd_beta=0.8):
        self.optimizer, self.weight_decay, self.momentum, self.rmsgd_beta = optimizer, weight_decay, momentum, rmsgd_beta


def adamp_branch(p: torch.Tensor, g: torch.Tensor) -> str:
    """Which projection adamp.AdamP takes for one client's tensor: channel, layer or none."""
    if p.dim() < 2:
        return "none"
    for name, rows in (("channel", p.shape[0]), ("layer", 1)):
        cosine = F.cosine_similarity(g.reshape(rows, -1), p.reshape(rows, -1), dim=1, eps=1e-8).abs()
        if cosine.max() < 0.1 / math.sqrt(p.numel() // rows):
            return name
    return "none"


def branch_gradient(kind: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A gradient for one client's tensor ``p`` that sends AdamP down the branch ``kind``:
    orthogonal to every channel of p (channel view), one of +-p_c / |p_c|^2 per channel with the
    signs cancelling over the layer (an odd last channel: zero) (layer view only), or random (none)."""
    g = torch.randn(p.shape, generator=gen)
    if kind == "channel":
        p_C, g_C = p.reshape(p.shape[0], -1), g.reshape(p.shape[0], -1)
        g_C = g_C - p_C * ((g_C * p_C).sum(1, keepdim=True) / (p_C * p_C).sum(1, keepdim=True))
        return g_C.reshape(p.shape)
    if kind == "layer":
        p_C = p.reshape(p.shape[0], -1)
        signs_C = torch.tensor([(-1.0) ** c for c in range(p.shape[0])])
        if p.shape[0] % 2:
            signs_C[-1] = 0.0  # an odd channel out: no gradient, so the signs still cancel
        return (signs_C[:, None] * p_C / (p_C * p_C).sum(1, keepdim=True)).reshape(p.shape)
    return g


@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["no_decay", "decay"])
@pytest.mark.parametrize("lr_L", [[0.01] * 3, [0.01, 0.03, 0.02]], ids=["shared_lr", "own_lr"])
def test_stacked_adamp_is_the_package_per_client(weight_decay, lr_L):
    """Three clients stacked, whose gradients send AdamP's projection down a different branch
    each (client 0: channel view, 1: layer view, 2: none) for every multi-dimensional tensor,
    over five steps: each client's tensors equal adamp.AdamP applied to them alone, so the
    branch, the projection and the decayed wd_ratio are chosen per client."""
    gen = torch.Generator().manual_seed(0)
    kinds_L = ["channel", "layer", "none"]
    start_LT = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in kinds_L]
    packages_L = []
    for start_T, lr in zip(start_LT, lr_L):
        params = [t.clone().requires_grad_(True) for t in start_T]
        packages_L.append((params, AdamP(params, lr=lr, betas=(0.9, 0.999), delta=0.1, wd_ratio=0.1,
                                         weight_decay=weight_decay)))
    stacks = {"params": [torch.stack(ts) for ts in zip(*start_LT)]}
    optimizer = StackedOptimizer(Tc("adamp", weight_decay), stacks, lr_L)
    for t in range(1, 6):
        grads_LT = []
        for kind, (params, package) in zip(kinds_L, packages_L):
            grads_T = [branch_gradient(kind, p.detach(), gen) for p in params]
            for p, g in zip(params, grads_T):
                if p.dim() > 1:
                    assert adamp_branch(p.detach(), g) == kind, "the case does not take its branch"
                p.grad = g.clone()
            package.step()
            grads_LT.append(grads_T)
        optimizer.step(stacks, [torch.stack(gs) for gs in zip(*grads_LT)], lr_L, t, [0, 1, 2])
        for b, (params, _) in enumerate(packages_L):
            for stacked, p in zip(stacks["params"], params):
                torch.testing.assert_close(stacked[b], p.detach(), rtol=RTOL, atol=ATOL)


def test_adamp_comparison_fails_without_the_projection(monkeypatch):
    """The unit comparison sees the projection: with it left out the stacked step of a client on
    the channel branch is off by far more than the tolerance."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(SHAPES[0], generator=gen)
    g = branch_gradient("channel", p, gen)
    param = p.clone().requires_grad_(True)
    param.grad = g.clone()
    AdamP([param], lr=0.01, betas=(0.9, 0.999), delta=0.1, wd_ratio=0.1, weight_decay=0.1).step()
    monkeypatch.setattr(batched_optim, "_adamp_projection", lambda p, g, perturb: (perturb, None))
    stacks = {"params": [p[None].clone()]}
    StackedOptimizer(Tc("adamp", 0.1), stacks, [0.01]).step(stacks, [g[None]], [0.01], 1, [0])
    assert (stacks["params"][0][0] - param.detach()).abs().max() > 100 * (ATOL + RTOL * p.abs().max())


def low_rank(shape, gen: torch.Generator) -> torch.Tensor:
    """Rank 2 plus noise over the first dimension: EVBMF finds no signal in pure noise (its
    knowledge gain is 0 and RMSGD's rates would stay at the initial rate)."""
    if len(shape) < 2:
        return torch.randn(shape, generator=gen)
    rest = math.prod(shape[1:])
    factors = torch.randn(shape[0], 2, generator=gen) @ torch.randn(2, rest, generator=gen)
    return (factors + 0.1 * torch.randn(shape[0], rest, generator=gen)).reshape(shape)


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 5e-3)], ids=["plain", "momentum_decay"])
def test_stacked_rmsgd_is_the_package_per_client(momentum, weight_decay):
    """Two clients stacked with 3 and 4 steps per epoch (their epoch boundaries differ), three
    epochs each; the shorter one leaves the stacks when done, as in train_group. Each client's
    rates after every epoch_step equal rmsgd.RMSGD's on that client alone, and its tensors the
    package's steps, so the rates are applied per client and tensor and the momentum follows its
    client out of the stacks."""
    gen = torch.Generator().manual_seed(1)
    per_epoch_B, epochs, lr = [3, 4], 3, 0.05
    steps_B = [n * epochs for n in per_epoch_B]
    start_BT = [[low_rank(s, gen) for s in SHAPES] for _ in per_epoch_B]
    grads_BST = [[[0.2 * torch.randn(s, generator=gen) for s in SHAPES] for _ in range(n)] for n in steps_B]
    tc = Tc("rmsgd", weight_decay, momentum)

    packages_B = []
    for start_T, grads_ST, per_epoch in zip(start_BT, grads_BST, per_epoch_B):
        params = [torch.nn.Parameter(t.clone()) for t in start_T]
        package = RMSGD(params, lr=lr, beta=tc.rmsgd_beta, momentum=momentum, weight_decay=weight_decay)
        rates = []
        for step, grads_T in enumerate(grads_ST):
            if step and step % per_epoch == 0:
                package.epoch_step()
                rates.append(package.lr_vector.copy())
            for p, g in zip(params, grads_T):
                p.grad = g.clone()
            package.step()
        packages_B.append((params, rates))
    # the first epoch_step sets every rate to (1 + beta) lr; from the second on they follow each
    # conv layer's metrics, so the two conv layers' rates differ
    assert packages_B[0][1][-1][0] != packages_B[0][1][-1][2], "the rates never came from the metrics"

    stacks = {"params": [torch.stack(ts) for ts in zip(*start_BT)]}
    optimizer = StackedOptimizer(tc, stacks, [lr, lr])
    live, rates_B = [0, 1], [[], []]
    for step in range(max(steps_B)):
        for j, b in enumerate(live):
            if step and step % per_epoch_B[b] == 0:
                optimizer.epoch_start(b, [p[j] for p in stacks["params"]])
                rates_B[b].append(optimizer.rmsgd_B[b].lr_vector.copy())
        grads_T = [torch.stack(gs) for gs in zip(*[grads_BST[b][step] for b in live])]
        optimizer.step(stacks, grads_T, [lr] * len(live), step + 1, live)
        done = [j for j, b in enumerate(live) if steps_B[b] == step + 1]
        for j in done:
            for stacked, p in zip(stacks["params"], packages_B[live[j]][0]):
                torch.testing.assert_close(stacked[j], p.detach(), rtol=RTOL, atol=ATOL)
        keep = [j for j in range(len(live)) if j not in done]
        index = torch.tensor(keep, dtype=torch.long)
        stacks = {key: [t.index_select(0, index) for t in value] for key, value in stacks.items()}
        live = [live[j] for j in keep]
    for b, (_, rates) in enumerate(packages_B):
        assert len(rates_B[b]) == len(rates) == epochs - 1
        for mine, theirs in zip(rates_B[b], rates):
            np.testing.assert_allclose(mine, theirs, rtol=RATE_RTOL)


# -- end to end: batched against sequential, seed 002's CNN on images ---------------------------

@pytest.fixture(scope="module")
def mnist_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("mnist")
    make_mnist_like(str(root), num=400)
    return root


def cnn_overrides(root) -> list[str]:
    """6 clients of 21 to 41 samples (Dirichlet split), batch 16: every client ends an epoch on a
    partial batch, and epochs of 2 or 3 steps put the clients of a group at different epoch
    boundaries; two local epochs."""
    return ["data.name=mnist", f"data.root={root}", "data.holdout_from_test=0.5", "data.num_clients=6",
            "run.clients_per_round=5", "model.name=cnn", "train.batch_size=16", "train.local_epochs=2",
            "run.eval_every=100", "run.progress=false"]


def assert_close_cnn(tmp_path, overrides: list[str], rounds: int = 2) -> torch.Tensor:
    sequential_P = final_P(tmp_path, 1, overrides, rounds=rounds)
    batched_P = final_P(tmp_path, 3, overrides, rounds=rounds)
    scale = sequential_P.abs().max().item()
    diff = (sequential_P - batched_P).abs().max().item()
    print(f"max |diff| {diff / scale:.2e} of the weights' scale")
    assert diff <= TOL * scale, f"max |diff| {diff:.3g}, {diff / scale:.3g} of the weights' scale"
    return sequential_P


# AdamP's rate is small because of what Adam-type steps do with rounding (docs/architecture.md,
# "Clients side by side"): a gradient element below eps (1e-8) moves its weight by lr g / eps,
# so the two paths' absolute rounding of ~1e-10 in it becomes a step difference of ~1e-2 lr.
# Measured (python tests/test_batched_optim.py 2 OVERRIDES): 2.6e-6 of the largest weight at
# lr 5e-5, 1.1e-5 at 1e-4, 2.6e-4 at 3e-3 (Adam: 1.7e-2, its L2 decay inside the gradient), against
# TOL 2e-5; SGD and RMSGD at lr 0.05 with momentum: 2e-7.
ADAMP = ["train.optimizer=adamp", "train.lr=5e-5", "train.weight_decay=0.01"]
# Three local epochs: RMSGD's first epoch_step sets every rate to (1 + beta) lr whatever the
# model; the second sets each conv layer's from its metrics (here 0.03 for the first conv layer,
# 0.03 to 0.067 for the second, per client). The rate avoids trajectories on which a ReLU unit
# sits at its kink, where either path's rounding switches its gradient on or off: at lr 0.05
# the paths differ by 3.2e-4 of the largest weight with the rates equal to the last bit, and
# plain SGD at lr 0.07 (no momentum) by 1.9e-2; at 0.03: 2.3e-7.
RMSGD_ = ["train.optimizer=rmsgd", "train.lr=0.03", "train.momentum=0.9", "train.weight_decay=1e-3",
          "train.local_epochs=3"]
CASES = [("fedavg", ADAMP), ("fedavg", RMSGD_), ("feder", ADAMP), ("feder", RMSGD_)]


@pytest.mark.parametrize("name,extra", CASES, ids=[f"{n} {e[0]}" for n, e in CASES])
@pytest.mark.e2e
def test_adamp_and_rmsgd_side_by_side_equal_sequential(tmp_path, mnist_root, name, extra):
    """AdamP (weight decay) and RMSGD (momentum, weight decay, rates from the conv layers' metrics
    at each client's own epoch boundaries), with FedAvg and with FedER (its effective ranks from the batched models),
    three clients side by side against one after another."""
    assert_close_cnn(tmp_path, cnn_overrides(mnist_root) + [f"algorithm.name={name}", *extra])


@pytest.mark.e2e
def test_rmsgd_comparison_fails_with_frozen_rates(tmp_path, mnist_root, monkeypatch):
    """The end-to-end comparison sees RMSGD's adapted rates: a batched path that never called
    epoch_step (its rates stuck at the initial learning rate) is off by more than 10 times TOL."""
    overrides = cnn_overrides(mnist_root) + RMSGD_
    sequential_P = final_P(tmp_path, 1, overrides, rounds=2)
    monkeypatch.setattr(StackedOptimizer, "epoch_start", lambda self, b, params_T: None)
    frozen_P = final_P(tmp_path, 3, overrides, rounds=2)
    assert (sequential_P - frozen_P).abs().max().item() > 10 * TOL * sequential_P.abs().max().item()


if __name__ == "__main__":
    # python tests/test_batched_optim.py ROUNDS [KEY=VALUE ...]: the largest difference between the
    # two paths (B = 3 against 1) on the end-to-end tests' CNN setup, relative to the largest weight
    import pathlib
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        make_mnist_like(folder, num=400)
        overrides = cnn_overrides(folder) + sys.argv[2:]
        sequential_P = final_P(pathlib.Path(folder), 1, overrides, rounds=int(sys.argv[1]))
        batched_P = final_P(pathlib.Path(folder), 3, overrides, rounds=int(sys.argv[1]))
        print(f"max |diff| {((sequential_P - batched_P).abs().max() / sequential_P.abs().max()).item():.2e} "
              "of the largest weight")
