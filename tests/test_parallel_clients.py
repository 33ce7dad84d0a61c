"""run.parallel_clients: clients trained side by side (fedddp.client.batched) against the
sequential reference (B = 1).

Tolerance: the batched kernels sum in another order than the per-client ones, so the two paths
agree to float32 rounding, not bit for bit. After 3 rounds the final models differ by at most
TOL times the largest weight (measured: at most about 1e-6 of it for every case here but two
whose trajectories amplify rounding, each with its own tolerance and measurement: AUGMENT_TOL
and RESNET_TOL; a wrong batch, learning rate, mask or optimizer state gives differences of 1e-3
and more).
Legend: B clients side by side, P flat elements.
"""

from __future__ import annotations

import pytest
import torch

from fedddp import checks, config
from fedddp.client import batched, batched_optim, parallel
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
        train_client(model, ctx, data, cfg, Recorded(), frozenset(), seed, out, work)
    fed = []
    trainer = batched.BatchedTrainer(model, layout, cfg, rules.get("plain"), frozenset(), CLASSIFICATION)
    gradients = trainer._gradients

    def recorded(stacks, x, y, mask, count, *rest):
        fed.append([x[j, :int(n)].clone() for j, n in enumerate(count.tolist())])
        return gradients(stacks, x, y, mask, count, *rest)

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


@pytest.mark.processes
@pytest.mark.e2e
def test_world_size_invariance_bitwise_for_fixed_b(tmp_path, two_ranks):
    """1 and 2 gloo ranks give the same final.pt bit for bit at parallel_clients = 3."""
    run_here(TWO_RANK_RUNS["fixed_b"] + [f"run.out_dir={tmp_path / 'one'}"], config=None)
    assert_same_state(final_state(tmp_path / "one"), final_state(two_ranks["fixed_b"]))


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


def test_batch_norm_without_flat_buffers_or_other_buffers_are_refused_when_built():
    """A BatchNorm model the name check does not know is batched when its statistics travel in
    the flat vector; without them (model.flat_buffers=false) the sequential path's statistics
    depend on the rank's previous client, and a buffer that is not BatchNorm's is not batched:
    both a config error naming the fix, not silently different statistics."""
    from torch import nn
    from fedddp.client import rules
    from fedddp.flat import FlatLayout
    from fedddp.models import Net
    from fedddp.tasks import CLASSIFICATION

    net = Net(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), nn.Linear(8, 2))
    cfg = checks.load(None, ["run.parallel_clients=4"])
    batched.BatchedTrainer(net, FlatLayout(net), cfg, rules.get("plain"), frozenset(), CLASSIFICATION)
    with pytest.raises(ConfigError, match="model.flat_buffers=true or run.parallel_clients=1"):
        batched.BatchedTrainer(net, FlatLayout(net, buffers=False), cfg, rules.get("plain"), frozenset(),
                               CLASSIFICATION)
    net.features.register_buffer("scale", torch.ones(1))
    with pytest.raises(ConfigError, match=r"not BatchNorm statistics \(features.scale\).*run.parallel_clients=1"):
        batched.BatchedTrainer(net, FlatLayout(net), cfg, rules.get("plain"), frozenset(), CLASSIFICATION)


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


# -- BatchNorm ------------------------------------------------------------------------------


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
BN_CASES = [["algorithm.name=fedavg"], ["train.momentum=0.9", "train.weight_decay=0.01"],
            ["train.optimizer=adam", "train.lr=0.01", "train.weight_decay=0.01"],
            ["algorithm.name=fedprox", "algorithm.prox_mu=0.5"], ["algorithm.name=scaffold"],
            ["algorithm.name=scaffold", "algorithm.scaffold_control=I"], ["algorithm.name=moon"],
            ["algorithm.name=fedsam"], ["algorithm.name=fedgam", "algorithm.gam_rho=0.1"],
            ["algorithm.name=fedsmoo"], ["algorithm.name=cgw"]]


@pytest.mark.parametrize("extra", BN_CASES, ids=[" ".join(e) for e in BN_CASES])
@pytest.mark.e2e
def test_batch_norm_model_equals_sequential(tmp_path, extra):
    """Each client's own running statistics (updated once a step from its own samples, the
    extra pass of SAM/GAM/FedSMOO leaving them, MOON's global and previous models in eval mode on
    theirs, SCAFFOLD option I's and CGW's passes per client) for SGD, momentum, Adam and the
    rules, over 3 rounds with clients of unequal sizes and partial batches. The global vector
    compared holds the averaged running statistics and step counts too."""
    assert_close(tmp_path, BN_CNN + extra)


@pytest.mark.e2e
def test_padding_left_in_batch_statistics_would_fail(tmp_path, monkeypatch):
    """Guards against padded samples entering BatchNorm's statistics: with the mask the
    BatchNorm layers see set to all ones (the loss still masked), the batched model moves away
    from the sequential one by far more than the tolerance."""
    sequential_P = final_P(tmp_path, 1, BN_CNN)
    monkeypatch.setattr(batched, "SPLIT_DEVICES", ())  # the padded form: steps of unequal widths padded
    forward = batched.BatchedTrainer._forward

    def padding_counted(self, net, params_T, buffers_T, x, mask, count, *args, **kwargs):
        ones = torch.ones_like(mask)
        return forward(self, net, params_T, buffers_T, x, ones, ones.sum(), *args, **kwargs)

    monkeypatch.setattr(batched.BatchedTrainer, "_forward", padding_counted)
    padded_P = final_P(tmp_path, 4, BN_CNN)
    assert (sequential_P - padded_P).abs().max().item() > 100 * TOL * sequential_P.abs().max().item()


@pytest.mark.e2e
def test_batch_norm_steps_split_by_width_on_cpu_compute_no_padding(tmp_path, monkeypatch):
    """On CPU a BatchNorm model's step whose batches differ in width runs one call per width:
    no forward ever sees a padded sample (every mask it gets is all ones), and the result equals
    the padded form's (the same computation in other shapes) to the tolerance. With the split
    off, the same run does pad (so the first check can fail)."""
    by_width, masks = batched.BatchedTrainer._by_width, []

    def recording(self, fn, args):
        def call(*args):  # each vmapped call's masks [L, S]: its clients' samples and padding
            masks.append(args[4])
            return fn(*args)
        return by_width(self, call, args)

    monkeypatch.setattr(batched.BatchedTrainer, "_by_width", recording)
    split_P = final_P(tmp_path / "split", 4, BN_CNN + ["algorithm.name=fedsam"])
    assert masks and all(bool((m == 1).all()) for m in masks)
    masks.clear()
    monkeypatch.setattr(batched, "SPLIT_DEVICES", ())
    padded_P = final_P(tmp_path / "padded", 4, BN_CNN + ["algorithm.name=fedsam"])
    assert any(not bool((m == 1).all()) for m in masks)
    scale = padded_P.abs().max().item()
    assert (split_P - padded_P).abs().max().item() <= TOL * scale


def test_each_client_keeps_its_own_running_statistics():
    """Per client, the report of a group trained side by side equals train_client's: parameters
    to the tolerance, running mean and variance too, num_batches_tracked exactly (its own step
    count, not the group's), for clients of 7, 23 and 40 samples (batch 10: 1, 3 and 4 steps)."""
    from fedddp.client import ClientContext, rules, train_client
    from fedddp.data import ClientData
    from fedddp.flat import FlatLayout
    from fedddp.tasks import CLASSIFICATION

    torch.manual_seed(0)
    model = BatchNormCNN((1, 6, 6), 3)
    layout = FlatLayout(model)
    global_P = layout.flatten(model).clone()
    cfg = checks.load(None, ["run.parallel_clients=3", "train.batch_size=10", "train.lr=0.1", "train.momentum=0.9"])
    rule = rules.get("plain")
    clients = [ClientData(torch.randn(n, 1, 6, 6), torch.randint(0, 3, (n,))) for n in (7, 23, 40)]

    def job(cid, data):
        ctx = ClientContext(cid, 1, global_P, layout, cfg.algorithm, task=CLASSIFICATION)
        return ctx, data, 100 + cid, 0, {"params_P": torch.zeros(layout.numel)}

    sequential = []
    for cid, data in enumerate(clients):
        layout.unflatten_into(global_P, model)
        ctx, data, seed, work, out = job(cid, data)
        train_client(model, ctx, data, cfg, rule, frozenset(), seed, out, work)
        sequential.append(out["params_P"])
    group = [job(cid, data) for cid, data in enumerate(clients)]
    batched.BatchedTrainer(model, layout, cfg, rule, frozenset(), CLASSIFICATION).train_group(group)
    for (*_, out), sequential_P, steps in zip(group, sequential, (1, 3, 4)):
        state, expected = layout.state_dict(out["params_P"]), layout.state_dict(sequential_P)
        for name, value in expected.items():
            if name.endswith("num_batches_tracked"):
                assert value.item() == state[name].item() == steps, name
            else:
                torch.testing.assert_close(state[name], value, rtol=0, atol=TOL * value.abs().max().item(),
                                           msg=name)


# ResNet-18 on 8 x 8 images amplifies float32 rounding (BatchNorm over few values per channel
# deep in the net): the sequential path itself, run with 2 intra-op threads instead of 1
# (run.num_threads=2), moves this test's model by 1.1e-5 of its scale (batched: 1.2e-5), too
# close to TOL for a margin across machines, so ResNet gets its own tolerance.
RESNET_TOL = 1e-4


@pytest.mark.e2e
def test_resnet18_equals_sequential(tmp_path):
    """torchvision's ResNet-18 (CIFAR stem; 20 BatchNorm layers, downsampling shortcuts) side by
    side, with momentum, over 2 rounds of 3 clients (42 to 117 samples, 2 local steps of batch 30:
    a partial batch of 12 beside full ones)."""
    overrides = BLOBS + ["model.name=resnet18", "run.clients_per_round=3", "train.local_steps=2", "train.lr=0.001",
                         "train.momentum=0.5"]
    sequential_P = final_P(tmp_path, 1, overrides, rounds=2)
    batched_P = final_P(tmp_path, 3, overrides, rounds=2)
    scale = sequential_P.abs().max().item()
    diff = (sequential_P - batched_P).abs().max().item()
    print(f"max |diff| {diff / scale:.2e} of the weights' scale")
    assert diff <= RESNET_TOL * scale


@pytest.mark.processes
@pytest.mark.e2e
def test_world_size_invariance_bitwise_with_batch_norm(tmp_path, two_ranks):
    """A BatchNorm model side by side (B = 3, a stateless rule): 1 and 2 gloo ranks give the
    same final.pt bit for bit, running statistics and step counts included."""
    run_here(TWO_RANK_RUNS["batch_norm"] + [f"run.out_dir={tmp_path / 'one'}"], config=None)
    assert_same_state(final_state(tmp_path / "one"), final_state(two_ranks["batch_norm"]))


@pytest.mark.parametrize("size", [1, 4])
@pytest.mark.e2e
def test_a_last_batch_of_one_sample_for_batch_norm_is_refused_before_training(tmp_path, size, capsys):
    """Guards against torch's ValueError traceback in the middle of a run: batch 21 leaves the
    43-sample client a last batch of one sample, whose BatchNorm1d sees one value per channel.
    Refused before round 1 with one line naming the key and the nearest batch size that works,
    exit 2, one after another and side by side; batch 20 (the suggestion) trains."""
    args = BN_CNN + ["run.rounds=1", f"run.parallel_clients={size}", "run.clients_per_round=12"]
    capsys.readouterr()
    status = run_here(args + ["train.batch_size=21", f"run.out_dir={tmp_path / 'bad'}"], config=None, check=False)
    err = capsys.readouterr().err  # a traceback would have raised out of main instead
    assert status == 2, err[-2000:]
    assert err.count("\n") == 1, err
    assert "train.batch_size: 21 leaves client(s) 10 (43 samples) a last batch of one sample" in err
    assert "set train.batch_size = 20" in err
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
    run_here(args + ["train.batch_size=20", f"run.out_dir={tmp_path / 'good'}"], config=None)


# -- Dropout and other random operations -------------------------------------------------


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
DROPOUT_CASES = [["algorithm.name=fedavg"], ["train.momentum=0.9", "train.weight_decay=0.01"],
                 ["train.optimizer=adam", "train.lr=0.01"], ["algorithm.name=fedsam"],
                 ["algorithm.name=scaffold", "algorithm.scaffold_control=I"], ["algorithm.name=moon"],
                 ["model.name=test_parallel_clients:dropout_batch_norm_mlp"]]


@pytest.mark.parametrize("extra", DROPOUT_CASES, ids=[" ".join(e) for e in DROPOUT_CASES])
@pytest.mark.e2e
def test_dropout_model_equals_sequential(tmp_path, extra):
    """Each client's dropout masks are drawn from (its seed, step, layer) in both paths, side by
    side outside vmap: the same masks for SAM's extra pass, per chunk for SCAFFOLD option I's
    start gradient, none for MOON's frozen models (eval mode), beside masked BatchNorm; over 3
    rounds with clients of unequal sizes and partial batches."""
    assert_close(tmp_path, DROPOUT + extra)


@pytest.mark.e2e
def test_dropout_masks_that_differ_would_fail(tmp_path, monkeypatch):
    """Guards against masks that are not the sequential path's: with each side-by-side client's
    masks drawn one step late, the model moves far beyond the tolerance. And dropout is on:
    the model differs from the one trained without it (p = 0)."""
    from fedddp.models import dropout

    sequential_P = final_P(tmp_path, 1, DROPOUT)
    masks = batched.BatchedTrainer._dropout_masks
    monkeypatch.setattr(batched.BatchedTrainer, "_dropout_masks", lambda self, keys, *args: masks(
        self, [(seed, step + 1) for seed, step in keys], *args))
    late_P = final_P(tmp_path, 4, DROPOUT)
    monkeypatch.setattr(dropout.SeededDropout, "forward", lambda self, x: x)
    off_P = final_P(tmp_path, 1, DROPOUT)
    for other_P in (late_P, off_P):
        assert (sequential_P - other_P).abs().max().item() > 100 * TOL * sequential_P.abs().max().item()


def test_dropout_masks_are_per_client_step_and_layer():
    """A layer's mask depends on (client seed, step, layer index) alone; p of the entries are
    zero and the rest 1 / (1 - p); eval mode and p = 0 leave the input as it is."""
    from fedddp.models import dropout

    masks = [dropout.mask(key, index, (400, 50), 0.3, "cpu") for key, index in
             [((7, 0), 0), ((7, 0), 0), ((7, 1), 0), ((8, 0), 0), ((7, 0), 1)]]
    assert torch.equal(masks[0], masks[1])
    assert all(not torch.equal(masks[0], other) for other in masks[2:])
    assert set(masks[0].unique().tolist()) == {0.0, torch.tensor(1 / 0.7).item()}
    assert abs((masks[0] == 0).float().mean().item() - 0.3) < 0.01
    layer = dropout.SeededDropout(0.3, 0)
    layer.key, x = (7, 0), torch.randn(400, 50)
    assert torch.equal(layer(x), x * masks[0])
    assert layer.eval()(x) is x and dropout.SeededDropout(0.0, 0)(x) is x


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


@pytest.mark.e2e
def test_other_random_operations_side_by_side_are_one_line_before_round_1(tmp_path, capsys):
    """A random operation that is not nn.Dropout's cannot be drawn per client under vmap:
    ``--check`` with run.parallel_clients > 1 tries one side-by-side step and says so in one line
    naming the module, exit 2 (the run refuses the same way before round 1); one after another,
    and a dropout model side by side, pass the check."""
    from fedddp.__main__ import main

    noisy = BLOBS + ["model.name=test_parallel_clients:noisy_mlp", f"run.out_dir={tmp_path / 'noisy'}"]
    assert main(["--check", *noisy, "run.parallel_clients=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "model.name = test_parallel_clients:noisy_mlp: its module features.2 (Noise) calls a random " \
           "operation" in err and "set run.parallel_clients=1" in err
    with pytest.raises(ConfigError, match=r"features.2 \(Noise\) calls a random operation"):
        final_P(tmp_path, 3, noisy)
    assert not (tmp_path / "B3" / "metrics.jsonl").exists()
    assert main(["--check", *noisy, "run.parallel_clients=1"]) == 0
    assert main(["--check", *DROPOUT, f"run.out_dir={tmp_path / 'dropout'}", "run.parallel_clients=3"]) == 0


def test_dropout_on_a_dimension_other_than_the_batch_is_refused_side_by_side():
    """Side-by-side masks are drawn per sample along the first dimension: a dropout layer whose
    input has the batch elsewhere is a config error naming it, not masks of the wrong shape."""
    from fedddp.client import rules
    from fedddp.models import dropout
    from fedddp.data import ClientData
    from fedddp.flat import FlatLayout
    from fedddp.models import Net
    from fedddp.tasks import CLASSIFICATION

    class Transpose(torch.nn.Module):
        def forward(self, x):
            return x.t()

    nn = torch.nn
    net = dropout.seeded(Net(nn.Sequential(nn.Linear(4, 8), Transpose(), nn.Dropout(0.5), Transpose()),
                             nn.Linear(8, 2)))
    cfg = checks.load(None, ["run.parallel_clients=4"])
    trainer = batched.BatchedTrainer(net, FlatLayout(net), cfg, rules.get("plain"), frozenset(), CLASSIFICATION)
    with pytest.raises(ConfigError, match=r"dropout layer features.2 sees inputs \[8, 1\], \[8, 2\].*"
                                          "run.parallel_clients=1"):
        trainer.try_step(ClientData(torch.randn(5, 4), torch.randint(0, 2, (5,))))


# -- run.parallel_clients = auto, and whether side by side pays on CPU (client/parallel.py) --------

def _timings(one_step, side_one, side_many, probe=8, one_call=0.0, side_call=0.0):
    return parallel.Timings(one_call, one_step, side_call, side_one, side_many, probe)


def test_auto_is_one_after_another_on_cpu():
    """auto on CPU is 1 without measuring: every result stays what it was when 1 was the default."""
    cfg = checks.load(None, [])
    assert cfg.run.parallel_clients == "auto" and config.Config().run.parallel_clients == "auto"
    words = parallel.resolve(cfg, Comm(SINGLE, "cpu"), None, None, None, [], None)
    assert cfg.run.parallel_clients == 1 and "run.parallel_clients=auto: 1 on CPU" in words
    resumed = checks.load(None, [])
    words = parallel.resolve(resumed, Comm(SINGLE, "cpu"), None, None, None, [], None, resumed=3)
    assert resumed.run.parallel_clients == 3 and "the checkpoint's B = 3" in words
    explicit = checks.load(None, ["run.parallel_clients=4"])
    assert parallel.resolve(explicit, Comm(SINGLE, "cpu"), None, None, None, [], None) == \
        "clients up to 4 side by side" and explicit.run.parallel_clients == 4


def test_predict_counts_the_clients_still_stepping():
    """Side by side, a step costs what the clients still stepping cost: uneven clients leave the
    longest one stepping alone at the price of a side-by-side step of one."""
    t = _timings(one_step=1.0, side_one=3.0, side_many=10.0, probe=8)  # 3 + 1 per extra client
    assert t.side_step_s(1) == 3.0 and t.side_step_s(8) == 10.0 and t.side_step_s(4) == 6.0
    assert parallel.predict(t, [10] * 8) == (80.0, 100.0)
    assert parallel.predict(t, [2, 10]) == (12.0, 2 * 4.0 + 8 * 3.0)
    with_calls = _timings(1.0, 3.0, 10.0, one_call=0.5, side_call=2.0)
    assert parallel.predict(with_calls, [1, 1]) == (3.0, 2.0 + 4.0)
    single = _timings(1.0, 3.0, 3.0, probe=1)  # a group of one timed: no line to draw
    assert parallel.predict(single, [5, 5]) == (10.0, 30.0)


def test_verdict_warns_when_one_after_another_is_faster():
    cheap_steps = _timings(one_step=1.0, side_one=1.5, side_many=2.5, probe=8)  # 8 clients' step: 2.5 s, not 8
    even, uneven = [[10] * 8, [10] * 8], [[1, 1, 1, 1, 1, 1, 1, 60]]
    slower, words = parallel.cpu_verdict(cheap_steps, even, "rounds 1-5")
    assert not slower and words.startswith("3.2x faster than one after another (rank 0's groups of rounds 1-5")
    slower, words = parallel.cpu_verdict(cheap_steps, uneven, "round 1")
    assert slower and words.startswith("WARNING: side by side is 1.4x slower than one after another on this CPU")
    assert "run.parallel_clients=1 is faster here" in words and "\n" not in words
    slower, words = parallel.cpu_verdict(_timings(1.0, 1.0, 8.0), even, "round 1")
    assert not slower and words.startswith("about as fast as one after another")


def test_batch_from_memory():
    gib = 2 ** 30
    # 80 GiB free, 1 GiB a client: 64 of 0.8 * 80 = 64 GiB fit; capped by the clients a rank trains
    assert parallel.batch_from_memory(80 * gib, gib, 0, 1000) == 64
    assert parallel.batch_from_memory(80 * gib, gib, 0, 50) == 50
    assert parallel.batch_from_memory(80 * gib, gib, 10 * gib, 1000) == 32  # 54 fit: a power of two
    assert parallel.batch_from_memory(2 * gib, gib, 0, 1000) == 1  # fewer than two fit
    assert parallel.batch_from_memory(80 * gib, 0, 0, 7) == 7
    cfg = checks.load(None, ["run.clients_per_round=10"])
    assert [parallel.clients_per_rank(cfg, r) for r in (1, 2, 3, 16)] == [10, 5, 4, 1]


@pytest.mark.e2e
def test_the_start_line_warns_when_the_measurement_says_one_after_another_is_faster(tmp_path, monkeypatch,
                                                                                      capsys):
    """B > 1 on CPU: the start line (one line) carries the verdict of the measurement, here
    given timings; the run's bits do not depend on it (a run without the line, so without the
    measurement, ends with the same model)."""
    given = {"slow": _timings(1e-4, 1e-3, 2e-3), "fast": _timings(1e-3, 1e-4, 2e-4)}
    finals = {}
    for name, timings in given.items():
        monkeypatch.setattr(parallel, "measure_cpu", lambda *args, t=timings, **kw: t)
        capsys.readouterr()
        out = tmp_path / name
        run_here(["run.rounds=2", "run.parallel_clients=3", f"run.out_dir={out}", "run.progress=true"])
        start = [line for line in capsys.readouterr().err.splitlines() if "rank(s) on cpu" in line]
        assert len(start) == 1
        if name == "slow":
            assert "; clients up to 3 side by side; WARNING: side by side is" in start[0], start[0]
            assert "run.parallel_clients=1 is faster here" in start[0]
        else:
            assert "side by side; " in start[0] and "x faster than one after another" in start[0]
            assert "WARNING" not in start[0]
        finals[name] = final_state(out)
    monkeypatch.undo()
    run_here(["run.rounds=2", "run.parallel_clients=3", f"run.out_dir={tmp_path / 'quiet'}"])
    assert_same_state(finals["slow"], final_state(tmp_path / "quiet"))


@pytest.mark.e2e
def test_the_measurement_changes_no_bit(tmp_path, capsys):
    """The real measurement (rank 0, on copies of the model, the global generator restored) before
    round 1: the same final model as a run that does not measure (run.progress=false), here
    with a Dropout model and uneven local work."""
    args = DROPOUT + ["run.rounds=2", "run.parallel_clients=3", "train.local_work_min=1", "train.local_epochs=2"]
    run_here(args + [f"run.out_dir={tmp_path / 'measured'}", "run.progress=true"])
    start = [line for line in capsys.readouterr().err.splitlines() if "rank(s) on cpu" in line]
    assert len(start) == 1 and "(rank 0's groups of rounds 1-2 predicted from one group timed both ways" in start[0]
    run_here(args + [f"run.out_dir={tmp_path / 'quiet'}"])
    assert_same_state(final_state(tmp_path / "measured"), final_state(tmp_path / "quiet"))


@pytest.mark.e2e
def test_auto_records_the_resolved_B_and_a_resume_keeps_the_checkpoints(tmp_path, capsys):
    """config.toml and the checkpoint's identity hold the B a run used; resuming with auto takes
    the checkpoint's B (on any machine, the same bits as the uninterrupted run), an explicit other
    B is refused, and a default (auto) run's config.toml says 1 on CPU."""
    import json

    fresh = tmp_path / "fresh"
    run_here(["run.rounds=1", f"run.out_dir={fresh}"])
    assert "parallel_clients = 1\n" in (fresh / "config.toml").read_text()
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    run_here(["run.rounds=3", "run.parallel_clients=3", f"run.out_dir={whole}"])
    run_here(["run.rounds=3", "run.parallel_clients=3", "run.stop_after=1", f"run.out_dir={stopped}"])
    manifest = json.loads((stopped / "checkpoints" / "round_000001" / "manifest.json").read_text())
    assert manifest["identity"]["run.parallel_clients"] == 3
    capsys.readouterr()
    assert run_here(["run.rounds=3", "run.parallel_clients=1", "run.resume=true", f"run.out_dir={stopped}"],
                    check=False) == 2
    assert "run.parallel_clients 3 -> 1" in capsys.readouterr().err
    run_here(["run.rounds=3", "run.resume=true", f"run.out_dir={stopped}", "run.progress=true"])  # auto
    assert "the checkpoint's B = 3" in capsys.readouterr().err
    assert "parallel_clients = 3\n" in (stopped / "config.toml").read_text()
    assert_same_state(final_state(whole), final_state(stopped))


def test_auto_on_cuda_decides_from_the_footprint_and_falls_back_to_one(monkeypatch):
    """The CUDA path's choice without a GPU: the measured footprint and the free memory given
    (cuda_footprint itself needs a GPU and is not tested here); what side by side cannot run
    makes auto 1, with the reason."""
    from types import SimpleNamespace

    from fedddp import tasks
    from fedddp.algorithms import build_model
    from fedddp.data import build
    from fedddp.flat import FlatLayout

    mib = 2 ** 20
    free = [100 * mib]
    monkeypatch.setattr(parallel, "cuda_footprint", lambda *args, **kwargs: (mib, mib))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 200 * mib))
    comm = SimpleNamespace(device=torch.device("cpu"), world_size=2, rank=0)

    def choice(overrides):
        cfg = checks.load(None, BLOBS + overrides)
        data = build(cfg, cfg.data.seed, list(range(cfg.data.num_clients)))
        model = build_model(cfg, data.input_shape, data.num_classes, data.task)
        return parallel._cuda_choice(cfg, comm, model, FlatLayout(model), data, range(cfg.data.num_clients),
                                     tasks.get(data.task))

    b, why = choice([])
    assert b == 3 and "at most 3 clients a rank a round" in why  # 6 a round on 2 ranks
    free[0] = 3 * mib
    assert choice([])[0] == 1
    free[0] = 100 * mib
    b, why = choice(["model.name=test_parallel_clients:noisy_mlp"])
    assert b == 1 and "its module features.2 (Noise) calls a random operation" in why, why


def test_auto_accepts_the_B_a_run_recorded():
    """A checkpoint's identity and a sweep's run folder hold the resolved B: a config that says auto
    is the same setting (no refusal on resume, no 'other settings' in a sweep), another B is not."""
    from fedddp import checkpoint

    saved = checkpoint.identity(checks.load(None, ["run.parallel_clients=4"]))
    assert checkpoint.identity_changes(saved, checkpoint.identity(checks.load(None, []))) == []
    assert checkpoint.identity_changes(saved, checkpoint.identity(checks.load(None, ["run.parallel_clients=2"]))) \
        == ["run.parallel_clients 4 -> 2"]
    assert config.same_setting("run.parallel_clients", 1, "auto")
    assert not config.same_setting("run.parallel_clients", 1, 2)
    assert not config.same_setting("run.rounds", 1, "auto")


def test_sweep_finds_a_run_of_auto_with_its_resolved_B_the_same(tmp_path):
    from fedddp.study import sweep

    (tmp_path / "config.toml").write_text(config.dumps(checks.load(None, ["run.parallel_clients=1"])))
    assert sweep.settings_mismatch(str(tmp_path), checks.load(None, [])) == []
    assert sweep.settings_mismatch(str(tmp_path), checks.load(None, ["run.parallel_clients=2"])) == \
        ["run.parallel_clients: 1 there, 2 here"]


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
                train_client(model, ctx, data, cfg, rule, frozenset(), client_seed, out, work)
                reports.append(out["params_P"])
            return reports

        group = [job(cid, global_P) for cid in range(3)]
        batched.BatchedTrainer(model, layout, cfg, rule, frozenset(), CLASSIFICATION).train_group(group)
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
