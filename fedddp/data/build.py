"""``build(cfg, seed, owned_ids)``: the data set named by ``cfg.data``, split over clients; ``seed``
is the data seed (``data.seed``), never the run seed, so a run seed changes only training.
Each data set's builder registers under its name (``registry.builds``; the names are declared
in ``registry.DATA_SETS``, which config.py reads); a module:attr data.name is a data callable.
``owned_ids``: the client ids this rank may train, any sized iterable (a range for a population
of millions, so nothing per client is listed).
With data.client_test_fraction > 0 each client's held-out samples (client evaluation) are taken
out of its training samples, seeded by (data seed, client id).

Every rank reads the label arrays and computes the same partition (seeded, pure), so it knows
every client's sample count; it turns a client's images into float tensors only when the client
first trains on it (``LazyClients``), and only for ``owned_ids``, plus the global test set.
Normalisation is elementwise, so a client's tensors are bitwise the same whichever rank builds
them.

Legend: N images, C channels, H x W pixels.
"""

from __future__ import annotations

import numpy as np
import torch

from . import clients_dir, cmapss, colored, idx, leaf, partition, synthetic, tensors, vision
from .clients import ClientData, FederatedData, LazyClients, hold_out
from .. import plugins
from ..config import DataConfig
from ..errors import ConfigError, DataError
from ..registry import DATA_SETS, builds

# Data sets whose loaders make every requested client's float tensors when they build: asked for
# every client, each rank would hold the whole training set as float32 (FEMNIST: every writer's
# images), so their clients train on their owner rank. The others make a client on first use
# (the image sets, LazyClients) or are small (synthetic, CMAPSS): any rank may train any client.
BUILT_WHOLE = frozenset({"femnist", "colored_mnist"})


def build(cfg, seed: int, owned_ids) -> FederatedData:
    """The data set, split over clients; with data.client_test_fraction > 0 each client's
    held-out samples (client evaluation) taken out of its training samples (``clients.hold_out``),
    seeded by ``seed`` and the client id alone."""
    return hold_out(_build(cfg.data, cfg.data_root(), seed, owned_ids),
                    getattr(cfg.data, "client_test_fraction", 0.0), seed)


def _build(data: DataConfig, root: str, seed: int, owned_ids) -> FederatedData:
    """The data set of the data section, its files under ``root``; each builder reads those two."""
    if seed < 0:  # numpy's SeedSequence takes only non-negative entropy
        raise ConfigError(f"data.seed: must be >= 0, got {seed}")
    assert not len(owned_ids) or 0 <= min(owned_ids) <= max(owned_ids) < data.num_clients, data.num_clients
    if plugins.is_path(data.name):  # called alike on every rank: the same arrays, the same partition
        with plugins.calling("data.name", f"{data.name}(root, seed)"):
            mapping = plugins.get(data.name, "data.name")(root, seed)
        return tensors.build(mapping, f"data.name: {data.name}(root, seed)", data, seed, owned_ids)
    builder = DATA_SETS.get(data.name)
    if builder is None:
        valid = DataConfig.__dataclass_fields__["name"].metadata["choices"]
        raise ConfigError(f"data.name: unknown data set {data.name!r} (valid: {', '.join(valid)})")
    return builder(data, root, seed, owned_ids)


@builds("synthetic")
def _synthetic(data: DataConfig, root: str, seed: int, owned_ids) -> FederatedData:
    return synthetic.build(data, seed, owned_ids)


@builds("cmapss")
def _cmapss(data: DataConfig, root: str, seed: int, owned_ids) -> FederatedData:
    return cmapss.build(data, root, owned_ids)


@builds("femnist")
def _femnist(data: DataConfig, root: str, seed: int, owned_ids) -> FederatedData:
    return leaf.build(data, root, owned_ids)


@builds("tensors")
def _tensors(data: DataConfig, root: str, seed: int, owned_ids) -> FederatedData:
    return tensors.build(tensors.read(data.path), f"data.path: {data.path}", data, seed, owned_ids)


@builds("clients_dir")
def _clients_dir(data: DataConfig, root: str, seed: int, owned_ids) -> FederatedData:
    return clients_dir.build(data, owned_ids)


@builds("mnist")
@builds("fashionmnist")
@builds("cifar10")
@builds("cifar100")
@builds("colored_mnist")
def _images(data: DataConfig, root: str, seed: int, owned_ids) -> FederatedData:
    """The image sets: IDX (MNIST, Fashion-MNIST; colored MNIST paints MNIST digits) or
    torchvision's CIFAR files, partitioned over the clients by data.partition."""
    if not 0.0 <= data.holdout_from_test < 1.0:
        raise ConfigError(f"data.holdout_from_test: must be in [0, 1), got {data.holdout_from_test}")
    holdout = data.holdout_from_test > 0
    source = "mnist" if data.name == "colored_mnist" else data.name  # colored MNIST paints MNIST digits
    if source in idx.FOLDERS:
        train, test = idx.load(root, source, with_train=not holdout, download=data.download)
        (mean_C, std_C), num_classes = idx.STATS[source], 10
    else:
        train, test = vision.load(root, data.name, download=data.download)
        (mean_C, std_C), num_classes = vision.STATS[data.name], vision.NUM_CLASSES[data.name]
    if holdout:
        train, test = partition.holdout_split(test, data.holdout_from_test, seed)
    for _, labels in (train, test):
        if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
            raise DataError(f"{root}: {data.name} labels outside [0, {num_classes}); the files are not "
                            f"{data.name}, fetch them again")

    images_NCHW, labels_N = train
    parts = partition.split(labels_N, data, seed)
    if data.name == "colored_mnist":  # partitioned by digit, whatever label the variant predicts
        return colored.build(data, seed, train, test, parts, owned_ids)
    train_data = LazyClients(lambda k: ClientData(to_tensor(images_NCHW[parts[k]], mean_C, std_C),
                                                  torch.from_numpy(labels_N[parts[k]])), owned_ids)
    return FederatedData(num_classes=num_classes, input_shape=tuple(images_NCHW.shape[1:]),
                         num_samples=[len(p) for p in parts], train=train_data,
                         test=ClientData(to_tensor(test[0], mean_C, std_C), torch.from_numpy(test[1])))


def to_tensor(images_NCHW: np.ndarray, mean_C, std_C) -> torch.Tensor:
    """uint8 [N, C, H, W] -> float32, pixels in [0, 1] then standardised per channel: the
    operations of ((x / 255) - mean) / std, in place on the one float copy (the same bits as
    three fresh tensors, without two more passes over fresh memory: 123 MB for CIFAR's test set)."""
    x = torch.from_numpy(images_NCHW.astype(np.float32))  # astype copies: the IDX buffer is read-only
    mean = torch.tensor(mean_C, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(std_C, dtype=torch.float32).view(1, -1, 1, 1)
    return x.div_(255.0).sub_(mean).div_(std)
