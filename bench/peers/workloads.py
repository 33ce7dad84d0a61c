"""The peer benchmarks' models and data, one definition for both frameworks.

bench/peers/pfl_cifar10.py imports this module as ``bench.peers.workloads`` and hands fedddp the
same objects by import path (docs/extending.md): ``model.name = "bench.peers.workloads:simple_cnn"``
and ``data.name = "bench.peers.workloads:cifar10_data"``. The data callables return the arrays
the script registered in ``ARRAYS`` (one process, a world of one), so fedddp and pfl train on the
very same arrays without writing a 600 MB file.

Two workloads:

- ``cifar10``: pfl-research's published CIFAR10 benchmark (benchmarks/image_classification,
  configs/baseline.yaml: dataset cifar10_iid, model simple_cnn). Images are channels-last
  [N, 32, 32, 3], as pfl's pickles hold them, standardised per channel with the training set's
  mean and std; the model turns them channels-first itself. Users are 50 consecutive images of
  a seeded permutation (pfl's ``make_iid_federated_dataset`` with a constant 50): 1000 users.
- ``femnist``: the shape of FLUTE's FEMNIST experiment (msrflute experiments/cv_cnn_femnist:
  FedML's CNN_DropOut, 10 clients a round, batch 20, client lr 0.1, server SGD lr 1.0). Images
  [N, 1, 28, 28] in [0, 1] (LEAF's pixels, 1 = white), 62 classes, one client per writer.

Without the real files each is drawn from a seed: class-dependent images (a per-class mean image
plus noise), so the training loss can fall and both frameworks' losses say something.

Legend: N samples, U users (clients), C classes.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import torch
import torch.nn as nn

# workload name -> the mapping its data callable returns (x_train, y_train, x_test, y_test,
# client_train, num_classes), set by the script before either framework runs
ARRAYS: dict[str, dict] = {}


def cifar10_data(root: str, seed: int) -> dict:
    """fedddp's data callable for the CIFAR10 workload: the registered arrays."""
    return ARRAYS["cifar10"]


def femnist_data(root: str, seed: int) -> dict:
    """fedddp's data callable for the FEMNIST workload: the registered arrays."""
    return ARRAYS["femnist"]


class ChannelsFirst(nn.Module):
    """[N, H, W, C] -> [N, C, H, W]: pfl's Transpose2D, the first layer of its simple_cnn."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 3, 1, 2)


def simple_cnn(input_shape: tuple, num_classes: int) -> nn.Module:
    """pfl's benchmark ``simple_cnn`` (benchmarks/model/pytorch/cnn.py) for channels-last input
    (H, W, C): two 3x3 convs (32, 64), 2x2 max-pool, Dropout(0.25), Linear(64 (H-4)/2 (W-4)/2 ->
    128), Dropout(0.5), Linear(128 -> C); Glorot-uniform weights as pfl sets them, PyTorch's
    default biases. 1,626,442 parameters for CIFAR10."""
    height, width, channels = input_shape
    flat = 64 * ((height - 4) // 2) * ((width - 4) // 2)
    model = nn.Sequential(
        ChannelsFirst(),
        nn.Conv2d(channels, 32, kernel_size=3), nn.ReLU(),
        nn.Conv2d(32, 64, kernel_size=3), nn.ReLU(),
        nn.MaxPool2d(2), nn.Dropout(0.25), nn.Flatten(),
        nn.Linear(flat, 128), nn.ReLU(), nn.Dropout(0.5),
        nn.Linear(128, num_classes))
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(module.weight)
    return model


def femnist_cnn(input_shape: tuple, num_classes: int) -> nn.Module:
    """FLUTE's FEMNIST model (FedML's CNN_DropOut) for [1, 28, 28] input: two 3x3 convs (32, 64),
    2x2 max-pool, Dropout(0.25), Linear(9216 -> 128), Dropout(0.5), Linear(128 -> 62); PyTorch's
    default initialisation. 1,206,590 parameters with 62 classes."""
    channels, height, width = input_shape
    flat = 64 * ((height - 4) // 2) * ((width - 4) // 2)
    return nn.Sequential(
        nn.Conv2d(channels, 32, kernel_size=3), nn.ReLU(),
        nn.Conv2d(32, 64, kernel_size=3), nn.ReLU(),
        nn.MaxPool2d(2), nn.Dropout(0.25), nn.Flatten(),
        nn.Linear(flat, 128), nn.ReLU(), nn.Dropout(0.5),
        nn.Linear(128, num_classes))


def _class_images(rng: np.random.Generator, labels_N: np.ndarray, means_C: np.ndarray, noise: float) -> np.ndarray:
    """Each sample its class's mean image plus Gaussian noise, float32, drawn in chunks."""
    out = np.empty((len(labels_N),) + means_C.shape[1:], dtype=np.float32)
    for start in range(0, len(labels_N), 8192):
        part = slice(start, start + 8192)
        out[part] = rng.standard_normal(out[part].shape, dtype=np.float32) * noise + means_C[labels_N[part]]
    return out


def cifar10_arrays(root: str, num_users: int, per_user: int, num_test: int, seed: int) -> tuple[dict, str]:
    """The CIFAR10 workload's mapping and a line saying where it came from.

    Real: ROOT/cifar-10-batches-py/ (the python batches: data_batch_1..5, test_batch), each row
    reshaped [3, 32, 32] -> channels-last [32, 32, 3] (pfl's download script reshapes the rows
    straight to [32, 32, 3], which scrambles the pixels; the cost is the same), standardised
    per channel by the training images' mean and std. Else synthetic arrays of the same shapes."""
    folder = os.path.join(root, "cifar-10-batches-py") if root else ""
    rng = np.random.default_rng(seed)
    num_train = num_users * per_user
    if folder and os.path.isdir(folder):
        def batches(names):
            images, labels = [], []
            for name in names:
                with open(os.path.join(folder, name), "rb") as fh:
                    blob = pickle.load(fh, encoding="bytes")
                images.append(np.asarray(blob[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
                labels.append(np.asarray(blob[b"labels"], dtype=np.int64))
            return np.concatenate(images).transpose(0, 2, 3, 1), np.concatenate(labels)

        x_train, y_train = batches([f"data_batch_{i}" for i in range(1, 6)])
        x_test, y_test = batches(["test_batch"])
        if num_train > len(y_train):
            raise SystemExit(f"pfl_cifar10: {num_users} users x {per_user} images need {num_train} training "
                             f"images; {folder} has {len(y_train)}")
        mean = x_train.mean(axis=(0, 1, 2), dtype=np.float64)
        std = x_train.std(axis=(0, 1, 2), dtype=np.float64)
        order = rng.permutation(len(y_train))[:num_train]
        x_train = ((x_train[order] - mean) / std).astype(np.float32)
        y_train = y_train[order]
        x_test = ((x_test[:num_test] - mean) / std).astype(np.float32)
        y_test = y_test[:num_test]
        source = f"real CIFAR10 from {folder} ({num_train} training images of 50000, {len(y_test)} test images)"
    else:
        means_C = rng.standard_normal((10, 32, 32, 3), dtype=np.float32) * 0.5
        y_train = rng.integers(0, 10, num_train)
        y_test = rng.integers(0, 10, num_test)
        x_train = _class_images(rng, y_train, means_C, 1.0)
        x_test = _class_images(rng, y_test, means_C, 1.0)
        where = f"no {folder}" if folder else "no --data-root"
        source = (f"synthetic CIFAR10-shaped arrays drawn from seed {seed} ({where}): {num_train} training and "
                  f"{num_test} test images [32, 32, 3], 10 classes, each its class's mean image (N(0, 0.25)) "
                  f"plus N(0, 1) noise")
    mapping = {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test,
               "client_train": np.repeat(np.arange(num_users, dtype=np.int64), per_user), "num_classes": 10}
    return mapping, source


def femnist_arrays(root: str, num_writers: int, min_size: int, max_size: int, num_test: int,
                   seed: int) -> tuple[dict, str]:
    """The FEMNIST workload's mapping and a line saying where it came from.

    Real: LEAF's JSON under ROOT/FEMNIST/train and ROOT/FEMNIST/test (docs/datasets.md), the
    first ``num_writers`` writers and their test samples, read with fedddp's own LEAF reader.
    Else synthetic: ``num_writers`` writers of min_size..max_size images each (uniform), 28x28
    grey in [0, 1], 62 classes."""
    folder = os.path.join(root, "FEMNIST") if root else ""
    if folder and os.path.isdir(os.path.join(folder, "train")):
        from fedddp.data import leaf

        index, xs, ys, owners = {}, [], [], []
        for path in leaf.json_files(os.path.join(folder, "train")):
            for writer, x, y in leaf.read_writers(path):
                if len(index) == num_writers:
                    break
                index[writer] = len(index)
                images, labels = leaf.to_arrays(path, writer, x, y)
                xs.append(images), ys.append(labels), owners.append(np.full(len(labels), index[writer]))
            if len(index) == num_writers:
                break
        tx, ty = [], []
        for path in leaf.json_files(os.path.join(folder, "test")):
            for writer, x, y in leaf.read_writers(path):
                if writer in index:
                    images, labels = leaf.to_arrays(path, writer, x, y)
                    tx.append(images), ty.append(labels)
        mapping = {"x_train": np.concatenate(xs), "y_train": np.concatenate(ys),
                   "x_test": np.concatenate(tx), "y_test": np.concatenate(ty),
                   "client_train": np.concatenate(owners), "num_classes": 62}
        sizes = np.bincount(mapping["client_train"])
        source = (f"real FEMNIST (LEAF JSON) from {folder}: the first {len(index)} writers, {sizes.min()}-"
                  f"{sizes.max()} images each, {len(mapping['y_test'])} test images")
        return mapping, source
    rng = np.random.default_rng(seed)
    sizes_U = rng.integers(min_size, max_size + 1, num_writers)
    means_C = rng.random((62, 1, 28, 28), dtype=np.float32)
    y_train = rng.integers(0, 62, int(sizes_U.sum()))
    y_test = rng.integers(0, 62, num_test)
    x_train = np.clip(_class_images(rng, y_train, means_C, 0.5), 0.0, 1.0)
    x_test = np.clip(_class_images(rng, y_test, means_C, 0.5), 0.0, 1.0)
    where = f"no {folder}/train" if folder else "no --data-root"
    source = (f"synthetic FEMNIST-shaped arrays drawn from seed {seed} ({where}): {num_writers} writers of "
              f"{min_size}-{max_size} images (uniform; {int(sizes_U.sum())} in all), {num_test} test images, "
              f"[1, 28, 28] in [0, 1], 62 classes, each its class's mean image plus N(0, 0.25) noise, clipped")
    mapping = {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test,
               "client_train": np.repeat(np.arange(num_writers, dtype=np.int64), sizes_U), "num_classes": 62}
    return mapping, source
