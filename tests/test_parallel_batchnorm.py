"""run.parallel_clients with BatchNorm models: side by side against one after another (the
tolerance: tests/test_parallel_clients.py, whose BatchNormCNN and BLOBS these use), each client's
own running statistics, batch statistics without padding, the models refused, ResNet-18 with its
own tolerance, and a last batch of one sample. The world-size test: test_parallel_clients.py.
Legend: B clients side by side, P flat elements.
"""

from __future__ import annotations

import pytest
import torch

from fedddp import checks
from fedddp.client import LocalTraining, batched
from fedddp.errors import ConfigError

from fedrun import run_here
from test_parallel_clients import BLOBS, BN_CNN, TOL, BatchNormCNN, assert_close, final_P


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
    batched.BatchedTrainer(net, FlatLayout(net), LocalTraining.of(cfg), rules.get("plain"), frozenset(), CLASSIFICATION)
    with pytest.raises(ConfigError, match="model.flat_buffers=true or run.parallel_clients=1"):
        batched.BatchedTrainer(net, FlatLayout(net, buffers=False), LocalTraining.of(cfg), rules.get("plain"),
                               frozenset(), CLASSIFICATION)
    net.features.register_buffer("scale", torch.ones(1))
    with pytest.raises(ConfigError, match=r"not BatchNorm statistics \(features.scale\).*run.parallel_clients=1"):
        batched.BatchedTrainer(net, FlatLayout(net), LocalTraining.of(cfg), rules.get("plain"), frozenset(),
                               CLASSIFICATION)


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

    def recording(self, fn, args, shape):
        def call(*args):  # each vmapped call's masks [L, S]: its clients' samples and padding
            masks.append(args[4])
            return fn(*args)
        return by_width(self, call, args, shape)

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
        train_client(model, ctx, data, LocalTraining.of(cfg), rule, frozenset(), seed, out, work)
        sequential.append(out["params_P"])
    group = [job(cid, data) for cid, data in enumerate(clients)]
    batched.BatchedTrainer(model, layout, LocalTraining.of(cfg), rule, frozenset(), CLASSIFICATION).train_group(group)
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
