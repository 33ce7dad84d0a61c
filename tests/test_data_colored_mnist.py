"""Colored MNIST (FedGMA, seed 001) on MNIST IDX files written here: per-client colour/label
correlation within the configured flip range, the OOD test set's reversal, the 10-class palettes,
exactly two digits per client, determinism on any rank, and a short FedGMA run end to end."""

import os

import numpy as np
import pytest
import torch

from fedddp import checks, config
from fedddp.data import build, colored, partition
from fedddp.data.partition import holdout_split
from fedddp.data.idx import load
from fedrun import REPO, make_mnist_like, metrics, run_here, write_idx

FEDGMA_COLORED = os.path.join(REPO, "configs", "fedgma_colored_mnist.toml")
REAL_MNIST = "/work/shared/data"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Only the t10k split, as in the project's real MNIST folder. Pixel (0, 0) is 0 and pixel
    (0, 1) is 255 in every image, so a coloured image shows its background and foreground there."""
    root = tmp_path_factory.mktemp("mnist")
    rng = np.random.default_rng(5)
    images = rng.integers(0, 256, (3000, 28, 28))
    images[:, 0, 0], images[:, 0, 1] = 0, 255
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    write_idx(str(raw / "t10k-images-idx3-ubyte.gz"), images)
    write_idx(str(raw / "t10k-labels-idx1-ubyte.gz"), rng.integers(0, 10, 3000))
    return root


def cfg_for(root, *overrides):
    return checks.load(FEDGMA_COLORED, [f"data.root={root}", "data.holdout_from_test=0.4", *overrides])


def colours(x_N3HW):
    """(foreground [N, 3], background [N, 3]) read from the two marker pixels."""
    return x_N3HW[:, :, 0, 1], x_N3HW[:, :, 0, 0]


def digits_of(root, cfg):
    """The digits behind each client and the test set, from the same holdout the build uses."""
    _, test = load(str(root), "mnist", with_train=False)
    (_, train_digits), (_, test_digits) = holdout_split(test, cfg.data.holdout_from_test, cfg.data.seed)
    return train_digits, test_digits


def test_binary_colour_follows_label_within_each_clients_flip_rate(root):
    cfg = cfg_for(root, "data.partition=iid")
    fd = build(cfg, seed=0, owned_ids=list(range(10)))
    assert fd.num_classes == 2 and fd.input_shape == (3, 28, 28)
    flip_K = colored.flip_probabilities(10, 0.1, 0.2, seed=0)
    np.testing.assert_allclose(np.sort(flip_K), np.linspace(0.1, 0.2, 10))
    red, green = torch.tensor(colored.RED), torch.tensor(colored.GREEN)
    pooled = []
    for k in range(10):
        fg, bg = colours(fd.train[k].x)
        assert (bg == 0).all()  # binary: black background
        is_green = (fg == green).all(1)
        assert (is_green | (fg == red).all(1)).all()
        flipped = (is_green.long() != fd.train[k].y).float()
        n = len(flipped)
        # the client's own rate: within 4 binomial standard deviations of its p_k
        assert abs(flipped.mean().item() - flip_K[k]) < 4 * np.sqrt(flip_K[k] * (1 - flip_K[k]) / n), k
        pooled.append(flipped)
    assert 0.12 < torch.cat(pooled).mean().item() < 0.18  # 1,800 samples at mean rate 0.15
    # Labels: 0 for digits < 5 (the paper's Fig. 3).
    train_digits, _ = digits_of(root, cfg)
    parts = partition.iid(train_digits, 10, 0)
    for k in (0, 7):
        assert torch.equal(fd.train[k].y, torch.from_numpy((train_digits[parts[k]] >= 5).astype(np.int64)))


def test_binary_ood_test_set_reverses_colour_with_probability_0_9(root):
    cfg = cfg_for(root, "data.partition=iid")
    fd = build(cfg, seed=0, owned_ids=[])
    fg, _ = colours(fd.test.x)
    is_green = (fg == torch.tensor(colored.GREEN)).all(1)
    reversed_rate = (is_green.long() != fd.test.y).float().mean().item()
    assert len(fd.test) == 1200 and abs(reversed_rate - 0.9) < 0.03  # std 0.009
    _, test_digits = digits_of(root, cfg)
    assert torch.equal(fd.test.y, torch.from_numpy((test_digits >= 5).astype(np.int64)))


def test_multiclass_palettes(root):
    cfg = cfg_for(root, "data.colored_variant=multiclass", "data.partition=iid")
    fd = build(cfg, seed=0, owned_ids=[0, 1])
    assert fd.num_classes == 10 and fd.input_shape == (3, 28, 28)
    fg_palette, bg_palette = torch.from_numpy(colored.FOREGROUND_C23), torch.from_numpy(colored.BACKGROUND_C23)
    test_palette = torch.from_numpy(colored.TEST_COLOURS_103)
    all_train = torch.cat([fg_palette.view(-1, 3), bg_palette.view(-1, 3)])
    assert len(torch.unique(torch.cat([all_train, test_palette]), dim=0)) == 50  # all colours distinct
    for k in (0, 1):
        fg, bg = colours(fd.train[k].x)
        y = fd.train[k].y
        # Each image wears one of its own class's two foregrounds and two backgrounds ...
        assert ((fg[:, None] == fg_palette[y]).all(2)).any(1).all()
        assert ((bg[:, None] == bg_palette[y]).all(2)).any(1).all()
        # ... and, over a client, both of them.
        for c in y.unique()[:3]:
            picks = ((fg[y == c][:, None] == fg_palette[c]).all(2)).float().mean(0)
            assert (picks > 0).all()
    # OOD: both colours from the 10 test colours, never equal, independent of the class.
    fg, bg = colours(fd.test.x)
    fg_id = ((fg[:, None] == test_palette).all(2)).float().argmax(1)
    bg_id = ((bg[:, None] == test_palette).all(2)).float().argmax(1)
    assert ((fg[:, None] == test_palette).all(2)).any(1).all() and ((bg[:, None] == test_palette).all(2)).any(1).all()
    assert (fg_id != bg_id).all()
    assert len(torch.unique(fg_id)) == 10 and len(torch.unique(bg_id)) == 10
    assert (fg_id == fd.test.y).float().mean() < 0.2  # no class-colour correlation (about 0.1)
    # A pixel is fg * g + bg * (1 - g): a middle grey level mixes the two.
    x_file = load(str(root), "mnist", with_train=False)[1][0]
    _, (test_images, _) = holdout_split((x_file, np.zeros(len(x_file))), 0.4, 0)
    g = torch.from_numpy(test_images[:, 0, 5, 5].astype(np.float32)) / 255
    torch.testing.assert_close(fd.test.x[:, :, 5, 5], fg * g[:, None] + bg * (1 - g[:, None]))


def test_classes_partition_gives_exactly_two_digits_per_client(root):
    cfg = cfg_for(root)  # the config's own split: partition = classes, two per client
    train_digits, _ = digits_of(root, cfg)
    parts = partition.classes(train_digits, 10, 2, seed=0)
    assert all(len(np.unique(train_digits[p])) == 2 for p in parts)
    assert np.bincount(np.concatenate([np.unique(train_digits[p]) for p in parts])).tolist() == [2] * 10
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(train_digits)))
    fd = build(cfg, seed=0, owned_ids=[4])
    assert fd.num_samples == [len(p) for p in parts]
    for num_clients in (7, 20, 23):  # 7 and 23: the 2 K class slots do not spread evenly over 10 digits
        parts = partition.classes(train_digits, num_clients, 2, seed=3)
        assert all(len(np.unique(train_digits[p])) == 2 for p in parts)
        sizes = [len(p) for p in parts]
        if num_clients == 20:  # every digit held by 4 clients: about equal numbers of images
            assert max(sizes) < 1.4 * min(sizes)


@pytest.mark.parametrize("variant", ["binary", "multiclass"])
def test_deterministic_and_independent_of_the_owner(root, variant):
    cfg = cfg_for(root, f"data.colored_variant={variant}")
    alone, everyone, again = build(cfg, 0, [3]), build(cfg, 0, list(range(10))), build(cfg, 0, [3, 8])
    assert list(alone.train) == [3] and alone.num_samples == everyone.num_samples
    for other in (everyone, again):
        assert torch.equal(alone.train[3].x, other.train[3].x) and torch.equal(alone.train[3].y, other.train[3].y)
        assert torch.equal(alone.test.x, other.test.x) and torch.equal(alone.test.y, other.test.y)
    reseeded = build(cfg, 1, [3])
    assert not torch.equal(reseeded.test.x, alone.test.x)  # colours (and the holdout) follow the seed
    assert not np.array_equal(colored.flip_probabilities(10, 0.1, 0.2, 0), colored.flip_probabilities(10, 0.1, 0.2, 1))


def test_flip_range_is_validated():
    with pytest.raises(config.ConfigError, match="data.colored_flip_min: need 0 <= colored_flip_min"):
        checks.load(None, ["data.name=colored_mnist", "data.colored_flip_min=0.3", "data.colored_flip_max=0.2"])
    with pytest.raises(config.ConfigError, match=r"data.colored_test_flip: must be in \[0, 1\]"):
        checks.load(None, ["data.name=colored_mnist", "data.colored_test_flip=1.5"])


@pytest.mark.e2e
def test_fedgma_on_colored_mnist_end_to_end(tmp_path):
    make_mnist_like(str(tmp_path / "data"), num=500)
    out = tmp_path / "out"
    run_here([f"data.root={tmp_path / 'data'}", f"run.out_dir={out}", "run.rounds=2", "run.ckpt_every=0",
                "train.local_epochs=1", "model.name=mlp", "model.hidden=16"], config=FEDGMA_COLORED)
    rows = metrics(out)
    assert [r["round"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["test_loss"]) and 0 <= r["test_accuracy"] <= 1 for r in rows)


@pytest.mark.skipif(not os.path.isdir(os.path.join(REAL_MNIST, "MNIST", "raw")), reason="no real MNIST here")
def test_config_builds_on_the_real_mnist_test_split():
    cfg = checks.load(FEDGMA_COLORED, [f"data.root={REAL_MNIST}"])
    fd = build(cfg, seed=0, owned_ids=[0])
    assert sum(fd.num_samples) == 8000 and len(fd.test) == 2000 and fd.train[0].x.shape[1:] == (3, 28, 28)
