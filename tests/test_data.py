"""Data loading: IDX files written here in the real format, the holdout split, error messages,
the FedProx synthetic generator, the CIFAR augmentation, and the real MNIST test split if present."""

import gzip
import os
import struct

import numpy as np
import pytest
import torch

from fedddp.config import Config, DataConfig
from fedddp.data import build, idx, synthetic, vision
from fedddp.errors import DataError

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
REAL_MNIST = "/work/shared/data"


def write_idx(path, array, type_code=0x08, big_endian_dtype=">u1"):
    """An IDX file written from the format's definition (not by the code under test)."""
    payload = bytes([0, 0, type_code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload += np.asarray(array).astype(big_endian_dtype).tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as fh:
        fh.write(payload)


def numbered_images(num):
    """Images whose first two pixels encode their index, so a split can be traced to the file."""
    rng = np.random.default_rng(num)
    images = rng.integers(0, 256, size=(num, 28, 28), dtype=np.uint8)
    images[:, 0, 0], images[:, 0, 1] = np.arange(num) % 256, np.arange(num) // 256
    return images


def make_mnist(root, folder="MNIST", num_train=60, num_test=50, splits=("train", "t10k")):
    raw = root / folder / "raw"
    raw.mkdir(parents=True)
    made = {}
    for split, num in (("train", num_train), ("t10k", num_test)):
        if split not in splits:
            continue
        images, labels = numbered_images(num), np.arange(num) % 10
        write_idx(raw / f"{split}-images-idx3-ubyte.gz", images)
        write_idx(raw / f"{split}-labels-idx1-ubyte.gz", labels)
        made[split] = (images, labels)
    return made


def config(root, **data):
    return Config(data=DataConfig(root=str(root), **data))


def pixel_index(x_N1HW):
    """Recover the index encoded by numbered_images from normalised MNIST tensors."""
    pixels = torch.round((x_N1HW[:, 0, 0, :2] * MNIST_STD + MNIST_MEAN) * 255).long()
    return (pixels[:, 0] + 256 * pixels[:, 1]).numpy()


# --- IDX reader ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["a-idx3-ubyte", "a-idx3-ubyte.gz"])
def test_read_idx_roundtrip(tmp_path, name):
    images = numbered_images(7)
    write_idx(tmp_path / name, images)
    got = idx.read_idx(str(tmp_path / name))
    assert got.dtype == np.uint8 and got.shape == (7, 28, 28)
    np.testing.assert_array_equal(got, images)


def test_read_idx_big_endian_int32(tmp_path):
    values = np.array([[1, -2, 70000], [2**31 - 1, 0, -(2**31)]], dtype=np.int64)
    write_idx(tmp_path / "v.idx", values, type_code=0x0C, big_endian_dtype=">i4")
    got = idx.read_idx(str(tmp_path / "v.idx"))
    np.testing.assert_array_equal(got, values)
    assert got.dtype.isnative


def test_read_idx_corrupt_files_name_the_file(tmp_path):
    good = tmp_path / "good-idx1-ubyte"
    write_idx(good, np.arange(20, dtype=np.uint8))
    raw = good.read_bytes()
    cases = {"bad-magic": b"\x01\x02" + raw[2:], "bad-type": raw[:2] + b"\x07" + raw[3:],
             "truncated": raw[:-3], "trailing": raw + b"\x00", "empty": b""}
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(DataError, match=name):
            idx.read_idx(str(path))
    not_gzip = tmp_path / "junk-idx1-ubyte.gz"
    not_gzip.write_bytes(b"this is not gzip at all")
    with pytest.raises(DataError, match="junk-idx1-ubyte.gz"):
        idx.read_idx(str(not_gzip))
    cut_gzip = tmp_path / "cut-idx1-ubyte.gz"
    cut_gzip.write_bytes(gzip.compress(raw)[:-10])
    with pytest.raises(DataError, match="cut-idx1-ubyte.gz"):
        idx.read_idx(str(cut_gzip))


# --- MNIST through build ------------------------------------------------------------------------

def test_mnist_build_shapes_normalisation_and_order(tmp_path):
    made = make_mnist(tmp_path)
    fd = build(config(tmp_path, name="mnist", num_clients=5, partition="iid"), seed=0, owned_ids=[0, 1, 2, 3, 4])
    assert fd.num_classes == 10 and fd.input_shape == (1, 28, 28)
    assert sum(fd.num_samples) == 60 and sorted(fd.train) == [0, 1, 2, 3, 4]
    assert fd.test.x.shape == (50, 1, 28, 28) and fd.test.x.dtype == torch.float32
    assert fd.test.y.dtype == torch.int64
    test_images, test_labels = made["t10k"]
    expected = (torch.from_numpy(test_images[:, None].astype(np.float32)) / 255 - MNIST_MEAN) / MNIST_STD
    torch.testing.assert_close(fd.test.x, expected)
    np.testing.assert_array_equal(fd.test.y.numpy(), test_labels)
    # Each client's samples are the train file's rows, with their own labels, all used once.
    seen = np.concatenate([pixel_index(fd.train[k].x) for k in range(5)])
    np.testing.assert_array_equal(np.sort(seen), np.arange(60))
    for k in range(5):
        np.testing.assert_array_equal(fd.train[k].y.numpy(), pixel_index(fd.train[k].x) % 10)


def test_client_data_does_not_depend_on_owned_ids(tmp_path):
    make_mnist(tmp_path)
    cfg = config(tmp_path, name="mnist", num_clients=5, partition="dirichlet", dirichlet_alpha=0.5)
    alone = build(cfg, seed=1, owned_ids=[3])
    everyone = build(cfg, seed=1, owned_ids=list(range(5)))
    assert list(alone.train) == [3]
    assert alone.num_samples == everyone.num_samples
    assert torch.equal(alone.train[3].x, everyone.train[3].x)
    assert torch.equal(alone.train[3].y, everyone.train[3].y)


def test_holdout_carves_train_and_test_from_t10k(tmp_path):
    make_mnist(tmp_path, num_test=100, splits=("t10k",))
    cfg = config(tmp_path, name="mnist", num_clients=4, partition="iid", holdout_from_test=0.2)
    fd = build(cfg, seed=0, owned_ids=[0, 1, 2, 3])
    assert sum(fd.num_samples) == 80 and len(fd.test) == 20
    train_ids = np.concatenate([pixel_index(fd.train[k].x) for k in range(4)])
    test_ids = pixel_index(fd.test.x)
    np.testing.assert_array_equal(np.sort(np.concatenate([train_ids, test_ids])), np.arange(100))
    other = build(cfg, seed=1, owned_ids=[])
    assert not np.array_equal(pixel_index(other.test.x), test_ids)  # seeded by the data seed


def test_fashionmnist_uses_its_folder_and_statistics(tmp_path):
    made = make_mnist(tmp_path, folder="FashionMNIST")
    fd = build(config(tmp_path, name="fashionmnist", num_clients=2, partition="iid"), seed=0, owned_ids=[])
    expected = (torch.from_numpy(made["t10k"][0][:, None].astype(np.float32)) / 255 - 0.2860) / 0.3530
    torch.testing.assert_close(fd.test.x, expected)


def test_missing_mnist_names_folder_and_files(tmp_path):
    with pytest.raises(DataError) as info:
        build(config(tmp_path, name="mnist"), seed=0, owned_ids=[0])
    message = str(info.value)
    assert "\n" not in message
    assert os.path.join(str(tmp_path), "MNIST", "raw") in message
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        assert stem in message
    assert "data.root" in message and "FEDDDP_DATA" in message and "data.download=true" in message
    assert "holdout_from_test" not in message  # the test split is missing too: holdout would not help


def test_missing_train_split_suggests_holdout(tmp_path):
    make_mnist(tmp_path, splits=("t10k",))
    with pytest.raises(DataError, match=r"missing: train-images-idx3-ubyte, train-labels-idx1-ubyte .*"
                                        r"data\.holdout_from_test=0\.2"):
        build(config(tmp_path, name="mnist"), seed=0, owned_ids=[0])


def test_corrupt_mnist_file_names_the_file(tmp_path):
    make_mnist(tmp_path)
    bad = tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte.gz"
    bad.write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x32" + bytes(10)))  # 10 of 50 labels
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz"):
        build(config(tmp_path, name="mnist", num_clients=2, partition="iid"), seed=0, owned_ids=[0])


def test_float_labels_in_an_idx_file_are_refused(tmp_path):
    """An IDX label file of float type (0x0D) was cast to int64: NaN became a huge class and
    2.5 became class 2. Labels must be an integer type; images already must be uint8."""
    make_mnist(tmp_path)
    bad = tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte.gz"
    labels = (np.arange(50) % 10).astype(np.float32)
    labels[3] = np.nan
    write_idx(bad, labels, type_code=0x0D, big_endian_dtype=">f4")
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz: expected integer labels, got float32"):
        build(config(tmp_path, name="mnist", num_clients=2, partition="iid"), seed=0, owned_ids=[0])


@pytest.mark.parametrize("name,folder", [("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python")])
def test_missing_cifar_names_its_folder(tmp_path, name, folder):
    with pytest.raises(DataError) as info:
        build(config(tmp_path, name=name), seed=0, owned_ids=[0])
    assert os.path.join(str(tmp_path), folder) in str(info.value)
    assert "data.download=true" in str(info.value) and "\n" not in str(info.value)


# --- FedProx synthetic --------------------------------------------------------------------------

def test_synthetic_deterministic_and_seeded(tmp_path):
    cfg = config(tmp_path)
    a, b, c = build(cfg, 0, [0, 5]), build(cfg, 0, [0, 5]), build(cfg, 1, [0, 5])
    assert a.num_samples == b.num_samples
    assert torch.equal(a.train[5].x, b.train[5].x) and torch.equal(a.test.x, b.test.x)
    assert not torch.equal(a.test.x[:50], c.test.x[:50])


def test_synthetic_client_independent_of_owned_ids(tmp_path):
    cfg = config(tmp_path)
    alone, everyone = build(cfg, 0, [3]), build(cfg, 0, list(range(30)))
    assert list(alone.train) == [3] and len(everyone.train) == 30
    assert torch.equal(alone.train[3].x, everyone.train[3].x)
    assert torch.equal(alone.train[3].y, everyone.train[3].y)
    assert torch.equal(alone.test.x, everyone.test.x) and torch.equal(alone.test.y, everyone.test.y)


def test_synthetic_shapes_and_90_10_split(tmp_path):
    cfg = config(tmp_path)
    fd = build(cfg, 2, list(range(30)))
    assert fd.num_classes == 10 and fd.input_shape == (60,) and len(fd.num_samples) == 30
    totals = [len(synthetic.client_samples(2, k, 1.0, 1.0, 60, 10)[1]) for k in range(30)]
    assert min(totals) >= 50
    assert fd.num_samples == [int(0.9 * n) for n in totals]
    assert len(fd.test) == sum(n - int(0.9 * n) for n in totals)
    for k, client in fd.train.items():
        assert client.x.shape == (fd.num_samples[k], 60) and client.x.dtype == torch.float32
        assert client.y.dtype == torch.int64
        assert 0 <= client.y.min() and client.y.max() < 10
    # The first 90% of a client's draws are its training samples.
    x_ND, y_N = synthetic.client_samples(2, 4, 1.0, 1.0, 60, 10)
    assert torch.equal(fd.train[4].x, torch.from_numpy(x_ND[:fd.num_samples[4]]))


def test_synthetic_input_covariance_is_diag_j_pow_minus_1_2():
    # Within one client, x - v_k has variance j^-1.2; pooled clients add the spread of v_k, so
    # measure on the IID variant (v_k = 0 for every client).
    shared = synthetic.shared_model(0, 60, 10)
    pooled_ND = np.concatenate([synthetic.client_samples(0, k, 1.0, 1.0, 60, 10, shared)[0] for k in range(40)])
    var_D = pooled_ND.var(axis=0)
    expected_D = np.arange(1, 61) ** -1.2
    np.testing.assert_allclose(var_D, expected_D, rtol=0.15)


def test_synthetic_non_iid_clients_have_different_input_means(tmp_path):
    """beta = 1 spreads the client means v_k (std sqrt(2) per coordinate); the IID variant has v_k = 0."""
    def spread_of_client_means(iid):
        shared = synthetic.shared_model(0, 60, 10) if iid else None
        means = [synthetic.client_samples(0, k, 1.0, 1.0, 60, 10, shared)[0][:, 0].mean() for k in range(30)]
        return np.std(means)

    assert spread_of_client_means(iid=False) > 0.7
    assert spread_of_client_means(iid=True) < 0.3


def test_synthetic_iid_variant_shares_one_model(tmp_path):
    """With one shared (W, b), the same x gets the same label in every client; non-IID models differ."""
    fd_iid = build(config(tmp_path, synthetic_iid=True), 0, [0, 1])
    W_DC, b_C = synthetic.shared_model(0, 60, 10)
    for k in (0, 1):
        x = fd_iid.train[k].x.double().numpy()
        agree = (np.argmax(x @ W_DC + b_C, axis=1) == fd_iid.train[k].y.numpy()).mean()
        assert agree > 0.99  # float32 rounding of x may flip an exact tie, nothing more
    fd = build(config(tmp_path), 0, [0, 1])
    x = fd.train[1].x.double().numpy()
    assert (np.argmax(x @ W_DC + b_C, axis=1) == fd.train[1].y.numpy()).mean() < 0.9


# --- CIFAR augmentation -------------------------------------------------------------------------

def _matches_some_crop(out_CHW, x_CHW, pad=4, hole=16):
    """Slow reference: out equals some (offset, flip) window of the zero-padded image except on one
    hole x hole square (clipped) where it is zero."""
    C, H, W = x_CHW.shape
    padded = torch.nn.functional.pad(x_CHW, (pad, pad, pad, pad))
    for top in range(2 * pad + 1):
        for left in range(2 * pad + 1):
            window = padded[:, top:top + H, left:left + W]
            for candidate in (window, window.flip(2)):
                differs_HW = (out_CHW != candidate).any(0)
                if not (out_CHW[:, differs_HW] == 0).all():
                    continue
                rows, cols = torch.nonzero(differs_HW, as_tuple=True)
                if len(rows) and rows.max() - rows.min() < hole and cols.max() - cols.min() < hole:
                    return True
    return False


def test_augment_batch_is_crop_flip_cutout_and_seeded():
    B = 16
    x_BCHW = torch.arange(1, B * 3 * 32 * 32 + 1, dtype=torch.float32).view(B, 3, 32, 32)  # all nonzero
    out = vision.augment_batch(x_BCHW, torch.Generator().manual_seed(0))
    assert out.shape == x_BCHW.shape and out.dtype == x_BCHW.dtype
    for b in range(B):
        assert _matches_some_crop(out[b], x_BCHW[b]), b
    assert torch.equal(out, vision.augment_batch(x_BCHW, torch.Generator().manual_seed(0)))
    assert not torch.equal(out, vision.augment_batch(x_BCHW, torch.Generator().manual_seed(1)))
    # Samples in a batch get different draws: some flipped, some not.
    flipped = [bool((out[b, 0, 16, :].diff() < 0).sum() > (out[b, 0, 16, :].diff() > 0).sum()) for b in range(B)]
    assert 0 < sum(flipped) < B
    # Every sample loses at least part of a cutout square (at least 8 x 8 lies inside the image).
    assert all(((out[b] == 0).all(0)).sum() >= 16 for b in range(B))


# --- real MNIST test split ----------------------------------------------------------------------

@pytest.mark.skipif(not os.path.isdir(os.path.join(REAL_MNIST, "MNIST", "raw")), reason="no real MNIST here")
def test_real_mnist_t10k_with_holdout():
    cfg = config(REAL_MNIST, name="mnist", num_clients=10, partition="dirichlet", dirichlet_alpha=0.3,
                 holdout_from_test=0.2)
    fd = build(cfg, seed=0, owned_ids=[0])
    assert sum(fd.num_samples) == 8000 and len(fd.test) == 2000
    assert set(fd.test.y.tolist()) == set(range(10))
    assert fd.train[0].x.shape == (fd.num_samples[0], 1, 28, 28)
    assert abs(fd.test.x.mean().item()) < 0.05 and abs(fd.test.x.std().item() - 1) < 0.05


def test_to_tensor_in_place_gives_the_bits_of_three_fresh_tensors():
    """The image sets' standardisation runs in place on its one float copy: every pixel value
    of every channel comes out bit for bit as ((x / 255) - mean) / std computed out of place."""
    from fedddp.data.build import to_tensor

    pixels = np.arange(256, dtype=np.uint8)
    for mean_C, std_C in (*vision.STATS.values(), *idx.STATS.values()):
        images = np.broadcast_to(pixels[None, None, :, None], (2, len(mean_C), 256, 3)).copy()
        mean = torch.tensor(mean_C, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(std_C, dtype=torch.float32).view(1, -1, 1, 1)
        fresh = (torch.from_numpy(images.astype(np.float32)) / 255.0 - mean) / std
        assert torch.equal(to_tensor(images, mean_C, std_C).view(torch.int32), fresh.view(torch.int32))
