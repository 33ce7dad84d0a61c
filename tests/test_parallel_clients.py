"""run.parallel_clients: clients trained side by side (fedddp.client.batched) against the
sequential reference (B = 1).

Tolerance: the batched kernels sum in another order than the per-client ones, so the two paths
agree to float32 rounding, not bit for bit. After 3 rounds the final models differ by at most
TOL times the largest weight (measured: at most about 1e-6 of it for every case here but two
whose trajectories amplify rounding, each with its own tolerance and measurement: AUGMENT_TOL
and RESNET_TOL (test_parallel_batchnorm.py); a wrong batch, learning rate, mask or optimizer state
gives differences of 1e-3 and more).

Here: the plain models, the rules and optimizers, the plugin models and helpers the other files
import, and every world size (one torchrun). BatchNorm: test_parallel_batchnorm.py; dropout and
other random operations: test_parallel_dropout.py; run.parallel_clients = auto:
test_parallel_auto.py.
Legend: B clients side by side, P flat elements.
"""

from __future__ import annotations

import pytest
import torch

from fedddp import checks
from fedddp.client import LocalTraining, batched, batched_optim, parallel
from fedddp.comm import Comm
from fedddp.env import ProcessEnv
from fedddp.errors import ConfigError
from fedddp.round import run
from fedddp.sampling import assign_groups

from fedrun import QUICKSTART, assert_same_state, final_state, is_selected, make_mnist_like, run_fedddp_each
from fedrun import run_here, selected
from test_data_cmapss import make_cmapss

SINGLE = ProcessEnv(0, 1, 0, "127.0.0.1", 0, "single")
TOL = 2e-5
# 8 synthetic clients of unequal sizes (55 to 2,199 samples, power law): with batch 50 every
# one ends an epoch on a partial batch, and their step counts differ (2 to 44 per epoch), so
# clients of a group finish at different steps.
SYNTHETIC = ["data.num_clients=8", "run.clients_per_round=6", "train.batch_size=50", "train.lr=0.05",
             "run.eval_every=100", "run.progress=false", "train.local_epochs=2"]


def final_P(tmp_path, parallel: int, overrides: list[str], rounds: int = 3) -> torch.Tensor:
    out = tmp_path / f"B{parallel}"
    cfg = checks.load(None, overrides + [f"run.rounds={rounds}", f"run.out_dir={out}", "run.overwrite=true",
                                         f"run.parallel_clients={parallel}"])
    return run(cfg, Comm(SINGLE, "cpu"))["global_P"]


def assert_close(tmp_path, overrides: list[str], parallel: int = 4, tol: float = TOL) -> torch.Tensor:
    sequential_P = final_P(tmp_path, 1, overrides)
    batched_P = final_P(tmp_path, parallel, overrides)
    scale = sequential_P.abs().max().item()
    diff = (sequential_P - batched_P).abs().max().item()
    print(f"max |diff| {diff / scale:.2e} of the weights' scale")
    assert diff <= tol * scale, f"max |diff| {diff:.3g}, {diff / scale:.3g} of the weights' scale"
    return sequential_P


@pytest.mark.e2e
def test_the_comparison_can_fail(tmp_path):
    """The tolerance is far below what training changes: one round more moves the model by more
    than 100 times it, so a batched path that lost or repeated steps would not pass."""
    overrides = SYNTHETIC + ["model.name=logistic"]
    three_P = assert_close(tmp_path, overrides)
    two_P = final_P(tmp_path, 1, overrides, rounds=2)
    assert (three_P - two_P).abs().max().item() > 100 * TOL * three_P.abs().max().item()


RULES = [("fedavg", []), ("fedprox", ["algorithm.prox_mu=0.5"]), ("scaffold", []),
         ("scaffold", ["algorithm.scaffold_control=I"]), ("scaffold", ["run.client_state=mmap"]),
         ("fednova", ["train.momentum=0.5"]),
         ("moon", ["algorithm.moon_proj_dim=8"]), ("moon", ["algorithm.moon_proj_dim=0"]),
         ("fedsam", []), ("fedgam", ["algorithm.gam_rho=0.1"]), ("fedgam_cv", ["algorithm.gam_rho=0.1"]),
         ("fedsmoo", []), ("fedgma", []), ("cgw", [])]


@pytest.mark.parametrize("name,extra", RULES, ids=[" ".join([n] + e) for n, e in RULES])
@pytest.mark.e2e
def test_every_batched_rule_equals_sequential(tmp_path, name, extra):
    """Each local rule's batched direction and state (SCAFFOLD's c_k, FedSMOO's duals, MOON's
    previous model and its contrastive term from round 2 on, with and without a projection head), the
    last-step gradients of FedGMA, FedNova's step counts and CGW's full-batch gradients, on an
    MLP with clients of unequal sizes and partial batches."""
    assert_close(tmp_path, SYNTHETIC + ["model.name=mlp", "model.hidden=16", f"algorithm.name={name}", *extra])


OPTIMIZERS = [["train.optimizer=sgd"], ["train.optimizer=sgd", "train.momentum=0.9", "train.weight_decay=0.01"],
              ["train.momentum=0.9", "train.nesterov=true", "train.weight_decay=0.01"],
              ["train.optimizer=adam", "train.lr=0.01", "train.weight_decay=0.01"],
              ["train.lr_schedule=steplr", "train.lr_schedule_unit=epoch", "train.lr_step_size=1",
               "train.momentum=0.5"]]


@pytest.mark.parametrize("extra", OPTIMIZERS, ids=[" ".join(e) for e in OPTIMIZERS])
@pytest.mark.e2e
def test_optimizers_and_schedules_equal_sequential(tmp_path, extra):
    """SGD (momentum, weight decay), Adam, and a learning rate that changes between local epochs:
    each client's own epoch clock, so clients of a group step at different rates."""
    assert_close(tmp_path, SYNTHETIC + ["model.name=logistic", *extra])


@pytest.mark.e2e
def test_deadline_stragglers_leave_their_group(tmp_path):
    """A client past run.deadline_steps (the 2,199-sample one: 88 steps) does not train and
    takes no place in its group; the others of its group train as they would sequentially."""
    assert_close(tmp_path, SYNTHETIC + ["model.name=logistic", "run.deadline_steps=30"])


@pytest.mark.e2e
def test_uneven_local_work_freezes_finished_clients(tmp_path):
    """A client that has done its drawn local epochs keeps its parameters and momentum while the
    rest of its group goes on (stepping it with a zero gradient would still move it through
    momentum and weight decay)."""
    assert_close(tmp_path, SYNTHETIC + ["model.name=logistic", "train.local_epochs=3", "train.local_work_min=1",
                                        "train.momentum=0.9", "train.weight_decay=0.05"])


@pytest.fixture(scope="module")
def mnist_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("mnist")
    make_mnist_like(str(root), num=400)
    return root


# With augmentation this CNN's trajectory passes a ReLU kink in round 2 (one unit of the fully
# connected layer, 426, switches on or off), so float32 rounding moves the sequential path itself
# by 6.2e-5 of the weights' scale: with its start weights moved by one ulp (each up or down at
# random, 5 draws) it ends 6.16e-5 to 6.17e-5 away from itself, as far as side by side is
# (6.17e-5; 3.8e-6 from the moved runs), with torch 2.14.1. Augmentation draws that differ move
# the model by 1.7e-2 and more (one draw out of place per client: 1.7e-2; mirrored batches:
# 1.9e-2), and each path feeds the model the same augmented batches bit for bit, client by client
# and step by step. Hence 3e-4: 5x the path's own sensitivity, 50x below a wrong draw.
# `python tests/test_parallel_clients.py augment` measures both.
AUGMENT_TOL = 3e-4
CNN_CASES = [(["algorithm.name=feder"], TOL), (["data.augment=true"], AUGMENT_TOL)]


def cnn_overrides(root) -> list[str]:
    return ["data.name=mnist", f"data.root={root}", "data.holdout_from_test=0.5", "data.num_clients=6",
            "run.clients_per_round=5", "model.name=cnn", "train.batch_size=16", "train.lr=0.05",
            "run.eval_every=100", "run.progress=false"]


@pytest.mark.parametrize("extra,tol", CNN_CASES, ids=["feder", "augment"])
@pytest.mark.e2e
def test_cnn_equals_sequential(tmp_path, mnist_root, extra, tol):
    """Seed 002's CNN on images: with FedER's effective ranks computed from the batched models,
    and with augmentation, whose draws interleave with each client's shuffling."""
    assert_close(tmp_path, cnn_overrides(mnist_root) + extra, parallel=3, tol=tol)


def test_augmented_batches_are_the_sequential_paths():
    """Each client's model input, step by step, is the same augmented batch bit for bit in both
    paths (crop, flip and cutout drawn after each epoch's permutation from the client's own
    generator): the augment case above differs by rounding only. Clients of 7, 23 and 40 images
    (batch 10, one epoch: 1, 3 and 4 steps), so clients leave the group at different steps."""
    from fedddp.client import ClientContext, rules, train_client
    from fedddp.data import ClientData
    from fedddp.flat import FlatLayout
    from fedddp.models import cnn
    from fedddp.tasks import CLASSIFICATION

    torch.manual_seed(0)
    model = cnn((1, 28, 28), 10)
    layout = FlatLayout(model)
    global_P = layout.flatten(model).clone()
    cfg = checks.load(None, ["run.parallel_clients=3", "train.batch_size=10", "data.augment=true"])
    clients = [ClientData(torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))) for n in (7, 23, 40)]
    steps = (1, 3, 4)

    def job(cid, data):
        ctx = ClientContext(cid, 1, global_P, layout, cfg.algorithm, task=CLASSIFICATION)
        return ctx, data, 100 + cid, 0, {"params_P": torch.zeros(layout.numel)}

    class Recorded(rules.LocalRule):
        def gradient(self, model, x, y, ctx):
            sequential[-1].append(x.clone())
            return super().gradient(model, x, y, ctx)

    sequential = []
    for cid, data in enumerate(clients):
        layout.unflatten_into(global_P, model)
        sequential.append([])
        ctx, data, seed, work, out = job(cid, data)
        train_client(model, ctx, data, LocalTraining.of(cfg), Recorded(), frozenset(), seed, out, work)
    fed = []
    trainer = batched.BatchedTrainer(model, layout, LocalTraining.of(cfg), rules.get("plain"), frozenset(),
                                     CLASSIFICATION)
    gradients = trainer._gradients

    def recorded(stacks, batch, shape):
        x, y, mask, count, drops = batch
        fed.append([x[j, :int(n)].clone() for j, n in enumerate(count.tolist())])
        return gradients(stacks, batch, shape)

    trainer._gradients = recorded
    trainer.train_group([job(cid, data) for cid, data in enumerate(clients)])
    assert [len(batches) for batches in sequential] == list(steps)
    for step, batches in enumerate(fed):
        live = [b for b in range(3) if steps[b] > step]
        assert len(batches) == len(live)
        for b, x in zip(live, batches):
            assert torch.equal(x, sequential[b][step]), (b, step)


@pytest.mark.e2e
def test_ffnn_regressor_equals_sequential(tmp_path):
    make_cmapss(tmp_path)
    assert_close(tmp_path, ["data.name=cmapss", f"data.root={tmp_path}", "data.num_clients=4",
                            "run.clients_per_round=4", "model.name=ffnn", "train.batch_size=16",
                            "train.lr=0.1", "run.eval_every=100", "run.progress=false"])


@pytest.mark.e2e
def test_resume_continues_exactly_side_by_side(tmp_path):
    """Nothing of the batched path outlives a round (stacks and optimizer states are per round),
    so stopping after round 2 and resuming ends with the uninterrupted run's model, bit for bit;
    SCAFFOLD's c_k comes back from the checkpoint."""
    overrides = SYNTHETIC + ["model.name=logistic", "algorithm.name=scaffold", "run.ckpt_every=1"]
    whole_P = final_P(tmp_path / "whole", 4, overrides)
    final_P(tmp_path / "parts", 4, overrides + ["run.stop_after=2"])
    cfg = checks.load(None, overrides + ["run.rounds=3", f"run.out_dir={tmp_path / 'parts' / 'B4'}",
                                         "run.resume=true", "run.parallel_clients=4"])
    assert torch.equal(run(cfg, Comm(SINGLE, "cpu"))["global_P"], whole_P)


def test_groups_do_not_depend_on_the_world_size():
    """The bits of a batched client depend on its group, so the groups must be the same for any
    number of ranks; only their assignment to ranks may change."""
    sampled, cost = [1, 3, 4, 7, 8, 9, 12, 15, 20, 21], {c: 10 + (c * 7) % 13 for c in range(30)}
    # cut longest first, ties by id: 9 (21), 7 (20), 20 (20) | 3 (18), 1 (17), 12 (16) | 8, 21, 4 | 15
    expected = [(1, 3, 12), (4, 8, 21), (7, 9, 20), (15,)]
    for world_size in (1, 2, 3, 4):
        per_rank, groups_R = assign_groups(sampled, cost.__getitem__, world_size, True, 3)
        assert sorted(tuple(g) for gs in groups_R for g in gs) == expected
        assert sorted(c for p in per_rank for c in p) == sampled
        assert all(p == sorted(p) for p in per_rank)


@pytest.mark.parametrize("overrides,words", [
    (["model.name=resnet18", "data.name=cifar10", "model.flat_buffers=false"], "model.flat_buffers=true"),
    (["run.parallel_clients=0"], "must be >= 1")])
def test_what_is_not_batched_is_a_config_error_naming_the_fix(overrides, words):
    with pytest.raises(ConfigError) as err:
        checks.load(None, ["run.parallel_clients=4"] + overrides)
    assert words in str(err.value)
    assert "run.parallel_clients" in str(err.value)


@pytest.mark.parametrize("optimizer", ["adamp", "rmsgd"])
def test_adamp_and_rmsgd_are_batched(optimizer):
    """AdamP and RMSGD have stacked forms (fedddp.client.batched_optim), so side by side accepts
    them (tests/test_batched_optim.py compares them with the packages)."""
    checks.load(None, ["run.parallel_clients=4", f"train.optimizer={optimizer}"])


def test_nesterov_update_is_torch_sgd():
    """The functional SGD step against torch.optim.SGD with momentum, weight decay and Nesterov,
    for two clients stacked, over three steps."""
    torch.manual_seed(0)
    w_B2 = torch.randn(2, 5)
    grads = [torch.randn(2, 5) for _ in range(3)]

    class Tc:
        momentum, weight_decay, nesterov = 0.9, 0.01, True

    params_T, momentum_T = [w_B2.clone()], None
    for g in grads:
        params_T, momentum_T = batched_optim._sgd(params_T, [g], momentum_T, Tc, [0.1, 0.1])
    for b in range(2):
        p = w_B2[b].clone().requires_grad_(True)
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
        for g in grads:
            p.grad = g[b].clone()
            opt.step()
        torch.testing.assert_close(params_T[0][b], p.detach(), rtol=0, atol=1e-6)


# -- Plugin models, by model.name = test_parallel_clients:NAME (also test_parallel_batchnorm.py's,
# test_parallel_dropout.py's, test_precision.py's and test_warmup.py's) ----------------------------


class BatchNormCNN(torch.nn.Module):
    """A plugin model (test_parallel_clients:BatchNormCNN) with a BatchNorm2d after a conv and a
    BatchNorm1d with momentum None (torch's cumulative average) after a linear layer. The layers
    before them have no bias, as in ResNet: a bias that BatchNorm cancels has a zero gradient up
    to rounding, which Adam would turn into full-size steps of noise."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        channels, height, width = input_shape
        nn = torch.nn
        self.features = nn.Sequential(
            nn.Conv2d(channels, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(8 * (height // 2) * (width // 2), 16, bias=False),
            nn.BatchNorm1d(16, momentum=None), nn.ReLU())
        self.head = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.head(self.features(x))


# examples/my_plugin.py's 8 x 8 images: 12 clients of 16 to 139 samples (Dirichlet split); with
# batch 30 every client but the 16-sample one ends an epoch on a partial batch of 11 to 27.
BLOBS = ["data.name=examples.my_plugin:blobs", "data.num_clients=12", "run.clients_per_round=6",
         "train.batch_size=30", "train.lr=0.05", "run.eval_every=100", "run.progress=false"]
BN_CNN = BLOBS + ["model.name=test_parallel_clients:BatchNormCNN"]


def dropout_mlp(input_shape, num_classes, batch_norm: bool = False):
    """A plugin model (test_parallel_clients:dropout_mlp): nn.Dropout on the inputs and after each
    hidden layer (p 0.2, 0.5, 0.3), head(features(x)) for MOON; with ``batch_norm`` a
    BatchNorm1d after the first layer (which then has no bias, as in ResNet)."""
    from fedddp.models import Net

    nn = torch.nn
    first = [nn.Linear(int(torch.tensor(input_shape).prod()), 32, bias=not batch_norm)]
    first += [nn.BatchNorm1d(32)] if batch_norm else []
    return Net(nn.Sequential(nn.Flatten(), nn.Dropout(0.2), *first, nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 16),
                             nn.ReLU(), nn.Dropout(0.3)), nn.Linear(16, num_classes))


def dropout_batch_norm_mlp(input_shape, num_classes):
    return dropout_mlp(input_shape, num_classes, batch_norm=True)


class Noise(torch.nn.Module):
    """Gaussian noise in training: a random operation that is not nn.Dropout."""

    def forward(self, x):
        return x + 0.1 * torch.randn_like(x) if self.training else x


def noisy_mlp(input_shape, num_classes):
    from fedddp.models import Net

    nn = torch.nn
    return Net(nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), 16), Noise(), nn.ReLU()),
               nn.Linear(16, num_classes))


DROPOUT = BLOBS + ["model.name=test_parallel_clients:dropout_mlp"]


# -- Every world size: 1 and 2 gloo ranks bit for bit, the runs under one torchrun (two_ranks) --


@pytest.mark.processes
@pytest.mark.e2e
def test_world_size_invariance_bitwise_for_fixed_b(tmp_path, two_ranks):
    """1 and 2 gloo ranks give the same final.pt bit for bit at parallel_clients = 3."""
    run_here(TWO_RANK_RUNS["fixed_b"] + [f"run.out_dir={tmp_path / 'one'}"], config=None)
    assert_same_state(final_state(tmp_path / "one"), final_state(two_ranks["fixed_b"]))


@pytest.mark.processes
@pytest.mark.e2e
def test_world_size_invariance_bitwise_with_batch_norm(tmp_path, two_ranks):
    """A BatchNorm model side by side (B = 3, a stateless rule): 1 and 2 gloo ranks give the
    same final.pt bit for bit, running statistics and step counts included."""
    run_here(TWO_RANK_RUNS["batch_norm"] + [f"run.out_dir={tmp_path / 'one'}"], config=None)
    assert_same_state(final_state(tmp_path / "one"), final_state(two_ranks["batch_norm"]))


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.processes
@pytest.mark.e2e
def test_world_size_invariance_bitwise_with_dropout(tmp_path, size, two_ranks):
    """A dropout model one after another and side by side: 1 and 2 gloo ranks give the same
    final.pt bit for bit (masks depend on the client, never on the rank or group)."""
    run_here(TWO_RANK_RUNS[f"dropout_B{size}"] + [f"run.out_dir={tmp_path / 'one'}"], config=None)
    assert_same_state(final_state(tmp_path / "one"), final_state(two_ranks[f"dropout_B{size}"]))


# The world-size tests' runs (config file first where they have one); their 2-rank runs share one
# torchrun (two_ranks), each in a process group of its own.
TWO_RANK_RUNS = {
    "fixed_b": [QUICKSTART, "model.name=mlp", "model.hidden=16", "run.rounds=2", "run.parallel_clients=3",
                "data.num_clients=12", "run.clients_per_round=6", "train.batch_size=50", "train.local_work_min=1",
                "train.local_epochs=2"],
    "batch_norm": [QUICKSTART, *BN_CNN, "run.rounds=2", "run.parallel_clients=3", "train.local_work_min=1",
                   "train.local_epochs=2"],
    **{f"dropout_B{size}": [*DROPOUT, "run.rounds=2", f"run.parallel_clients={size}", "train.local_work_min=1",
                            "train.local_epochs=2"] for size in (1, 3)},
}


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory) -> dict:
    """{key of TWO_RANK_RUNS: out_dir} of the selected world-size tests' runs on 2 gloo ranks,
    under one torchrun (the plugin models load from this folder, the driver's)."""
    keys = [key for key, test in (("fixed_b", "test_world_size_invariance_bitwise_for_fixed_b"),
                                  ("batch_norm", "test_world_size_invariance_bitwise_with_batch_norm"))
            if is_selected(request, test)]
    keys += [f"dropout_B{size}" for size in selected(request, "test_world_size_invariance_bitwise_with_dropout", "size")]
    root = tmp_path_factory.mktemp("two_ranks")
    outs = {key: root / key for key in keys}
    if keys:
        run_fedddp_each([TWO_RANK_RUNS[key] + [f"run.out_dir={outs[key]}"] for key in keys], nproc=2, config=None)
    return outs


# -- The measurements behind AUGMENT_TOL and the Adam figures (this file's __main__) ------------


class OneUlpCNN(torch.nn.Module):
    """Seed 002's CNN (the same initial weights as model.name = cnn) with every weight then moved
    by one ulp, up or down at random from ``OneUlpCNN.draw``: the sequential path's own
    sensitivity to float32 rounding, measured by how far this moves its result."""

    draw = 0

    def __new__(cls, input_shape, num_classes):
        from fedddp.models import cnn

        net = cnn(input_shape, num_classes)
        gen = torch.Generator().manual_seed(cls.draw)
        with torch.no_grad():
            for p in net.parameters():
                up = torch.randint(0, 2, p.shape, generator=gen).bool()
                p.copy_(torch.nextafter(p, torch.where(up, torch.inf, -torch.inf)))
        return net


def _measure_augment(draws: int = 5) -> None:
    """The augment case: side by side against one after another, and the sequential path against
    itself with its start weights moved by one ulp (``draws`` draws), of the weights' scale."""
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        make_mnist_like(folder, num=400)
        overrides, tmp = cnn_overrides(folder) + ["data.augment=true"], pathlib.Path(folder)
        sequential_P = final_P(tmp, 1, overrides)
        scale = sequential_P.abs().max().item()
        print(f"side by side (B = 3): {(final_P(tmp, 3, overrides) - sequential_P).abs().max() / scale:.2e}")
        from test_parallel_clients import OneUlpCNN as plugin  # the class model.name imports (not __main__'s)

        for draw in range(draws):
            plugin.draw = draw
            moved_P = final_P(tmp, 1, overrides + ["model.name=test_parallel_clients:OneUlpCNN"])
            print(f"sequential, start weights moved by 1 ulp (draw {draw}): "
                  f"{(moved_P - sequential_P).abs().max() / scale:.2e}")


def _measure_adam_zero_gradient(seeds: int = 20, lr: float = 1e-3) -> None:
    """One Adam step (no weight decay) of a Linear -> BatchNorm1d -> ReLU -> Linear model, whose
    first bias has a true gradient of exactly 0 (BatchNorm subtracts the batch mean): side by side
    (B = 3: clients of 7, 23 and 40 samples, full batch) against one after another, and the
    sequential path against itself with its start weights moved by one ulp, as |diff| / lr."""
    from fedddp.client import ClientContext, rules, train_client
    from fedddp.data import ClientData
    from fedddp.flat import FlatLayout
    from fedddp.models import Net
    from fedddp.tasks import CLASSIFICATION

    cfg = checks.load(None, ["run.parallel_clients=3", "train.batch_size=0", "train.optimizer=adam",
                             f"train.lr={lr}", "train.local_steps=1"])
    rule, nn = rules.get("plain"), torch.nn
    bias, other, itself = [], [], []
    for seed in range(seeds):
        torch.manual_seed(seed)
        model = Net(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()), nn.Linear(16, 3))
        layout = FlatLayout(model)
        entry = next(e for e in layout.entries if e.name == "features.0.bias")
        global_P = layout.flatten(model).clone()
        moved_P = torch.nextafter(global_P, torch.where(torch.rand(global_P.shape) < 0.5, torch.inf, -torch.inf))
        clients = [ClientData(torch.randn(n, 8), torch.randint(0, 3, (n,))) for n in (7, 23, 40)]

        def job(cid, start_P):
            ctx = ClientContext(cid, 1, start_P, layout, cfg.algorithm, task=CLASSIFICATION)
            return ctx, clients[cid], 100 + cid, 0, {"params_P": torch.zeros(layout.numel)}

        def sequential(start_P):
            reports = []
            for cid in range(3):
                layout.unflatten_into(start_P, model)
                ctx, data, client_seed, work, out = job(cid, start_P)
                train_client(model, ctx, data, LocalTraining.of(cfg), rule, frozenset(), client_seed, out, work)
                reports.append(out["params_P"])
            return reports

        group = [job(cid, global_P) for cid in range(3)]
        trainer = batched.BatchedTrainer(model, layout, LocalTraining.of(cfg), rule, frozenset(), CLASSIFICATION)
        trainer.train_group(group)
        for (*_, out), seq_P, moved in zip(group, sequential(global_P), sequential(moved_P)):
            diff_P = (out["params_P"] - seq_P).abs() / lr
            in_bias = torch.zeros_like(diff_P, dtype=torch.bool)
            in_bias[entry.offset:entry.offset + entry.numel] = True
            bias.append(diff_P[in_bias].max().item())
            other.append(diff_P[~in_bias].max().item())
            itself.append(((moved - seq_P).abs() / lr)[in_bias].max().item())
    bias.sort()
    print(f"{len(bias)} clients, one Adam step at lr {lr}: the bias before BatchNorm differs by up to "
          f"{bias[-1]:.2f} lr (median {bias[len(bias) // 2]:.2f}); every other element by up to {max(other):.1e} lr; "
          f"the sequential path moved by 1 ulp of its start weights: up to {max(itself):.2f} lr")


if __name__ == "__main__":
    # python tests/test_parallel_clients.py augment | adam-zero-gradient: the measurements behind
    # AUGMENT_TOL and docs/architecture.md's figures for Adam on a bias before BatchNorm
    import sys

    {"augment": _measure_augment, "adam-zero-gradient": _measure_adam_zero_gradient}[sys.argv[1]]()
