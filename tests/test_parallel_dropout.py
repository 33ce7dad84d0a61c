"""run.parallel_clients with dropout and other random operations: side by side against one after
another (the tolerance: tests/test_parallel_clients.py, whose dropout_mlp, noisy_mlp, BLOBS and
DROPOUT these use), masks per client, step and layer, and what cannot be drawn per client refused.
The world-size test: test_parallel_clients.py.
Legend: B clients side by side, P flat elements.
"""

from __future__ import annotations

import pytest
import torch

from fedddp import checks
from fedddp.client import LocalTraining, batched
from fedddp.errors import ConfigError

from test_parallel_clients import BLOBS, DROPOUT, TOL, assert_close, final_P


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
def test_dropout_masks_drawn_a_step_at_a_time_equal_sequential_too(tmp_path, monkeypatch):
    """A group whose masks for all steps would pass GROUP_DROPOUT_BYTES draws each step's own."""
    monkeypatch.setattr(batched, "GROUP_DROPOUT_BYTES", 0)
    assert_close(tmp_path, DROPOUT)


@pytest.mark.e2e
def test_dropout_masks_that_differ_would_fail(tmp_path, monkeypatch):
    """Guards against masks that are not the sequential path's: with each side-by-side client's
    masks drawn one step late, the model moves far beyond the tolerance. And dropout is on:
    the model differs from the one trained without it (p = 0)."""
    from fedddp.models import dropout

    sequential_P = final_P(tmp_path, 1, DROPOUT)
    with monkeypatch.context() as late:  # the group's masks, all steps drawn at once
        init = batched._GroupBatches.__init__

        def late_init(self, *args):
            init(self, *args)
            self.pairs_M = [(b, step + 1) for b, step in self.pairs_M]
        late.setattr(batched._GroupBatches, "__init__", late_init)
        late_group_P = final_P(tmp_path / "group", 4, DROPOUT)
    masks = batched.BatchedTrainer._dropout_masks  # a step's own masks
    monkeypatch.setattr(batched, "GROUP_DROPOUT_BYTES", 0)
    monkeypatch.setattr(batched.BatchedTrainer, "_dropout_masks", lambda self, keys, *args: masks(
        self, [(seed, step + 1) for seed, step in keys], *args))
    late_P = final_P(tmp_path, 4, DROPOUT)
    monkeypatch.setattr(dropout.SeededDropout, "forward", lambda self, x: x)
    off_P = final_P(tmp_path, 1, DROPOUT)
    for other_P in (late_group_P, late_P, off_P):
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
    trainer = batched.BatchedTrainer(net, FlatLayout(net), LocalTraining.of(cfg), rules.get("plain"), frozenset(),
                                     CLASSIFICATION)
    with pytest.raises(ConfigError, match=r"dropout layer features.2 sees inputs \[8, 1\], \[8, 2\].*"
                                          "run.parallel_clients=1"):
        trainer.try_step(ClientData(torch.randn(5, 4), torch.randint(0, 2, (5,))))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_draws_keep_1_minus_p_independently_across_clients_steps_and_elements(p):
    """The counter-based draw: over 100 (client, step) keys of 20,000 elements, each key's kept
    fraction within 5 standard deviations of 1 - p, and two keys' masks, or neighbouring
    elements, agree as independent draws do (keep^2 + p^2); a batched draw equals the
    one-key draws row for row."""
    from fedddp.models import dropout

    keys, keep, n = [(seed, step) for seed in range(20) for step in range(5)], 1 - p, 20_000
    kept = dropout.masks(dropout.keys_C2(keys, 3, "cpu"), n, p) > 0
    sd = (keep * p / n) ** 0.5
    assert (kept.float().mean(1) - keep).abs().max().item() < 5 * sd
    agree = keep ** 2 + p ** 2
    pairs = (kept[:-1] == kept[1:]).float().mean(1)  # key i against key i + 1
    assert (pairs - agree).abs().max().item() < 5 * (agree * (1 - agree) / n) ** 0.5
    neighbours = (kept[:, 1:] == kept[:, :-1]).float().mean().item()
    assert abs(neighbours - agree) < 5 * (agree * (1 - agree) / (100 * n)) ** 0.5
    assert torch.equal(dropout.masks(dropout.keys_C2(keys[:3], 3, "cpu"), n, p)[2],
                       dropout.mask(keys[2], 3, (n,), p, "cpu"))
