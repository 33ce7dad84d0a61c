"""FEMNIST in LEAF's JSON format (Caldas et al. 2018, github.com/TalwalkarLab/leaf): one client
per writer, 62 classes (digits, upper- and lower-case letters), 28 x 28 grey images.

Layout (what LEAF's ``data/femnist/preprocess.sh ... -t sample`` writes to ``data/train`` and
``data/test``, copied or linked under the data root)::

    ROOT/FEMNIST/train/*.json    each {"users": [...], "num_samples": [...],
    ROOT/FEMNIST/test/*.json           "user_data": {user: {"x": [[784 floats]], "y": [ints]}}}

Clients are the writers in file order: files sorted by name with digit runs compared as
numbers (``..._2.json`` before ``..._10.json``, LEAF's own numbering), writers in each file's
``users`` order. With ``data.num_clients`` = N the first N writers are the clients (files past
them are not read); the global test set is those writers' test samples, in client order.
Pixels are kept as LEAF stores them (floats in [0, 1], 1 = white paper), unstandardised, as
LEAF's reference models read them. IID FEMNIST is LEAF's ``-s iid`` preprocessing, still one
client per (synthetic) user.

Legend: N samples.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import torch

from .clients import ClientData, FederatedData
from ..errors import ConfigError, DataError

FOLDER = "FEMNIST"
NUM_CLASSES = 62
INPUT_SHAPE = (1, 28, 28)
_HOW_TO_GET = ("generate it with LEAF (github.com/TalwalkarLab/leaf: cd data/femnist && ./preprocess.sh "
               "-s niid --sf 1.0 -k 0 -t sample) and copy its data/train and data/test folders there, "
               "or set data.root or FEDDDP_DATA to the folder that holds FEMNIST/")


def _natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def json_files(folder: str) -> list[str]:
    """The split's *.json files in LEAF's order; DataError if there are none."""
    names = sorted((n for n in os.listdir(folder) if n.endswith(".json")), key=_natural_key) \
        if os.path.isdir(folder) else []
    if not names:
        raise DataError(f"{folder}: no FEMNIST *.json files (LEAF format, expected "
                        f"{FOLDER}/train/*.json and {FOLDER}/test/*.json); {_HOW_TO_GET}")
    return [os.path.join(folder, n) for n in names]


def read_writers(path: str):
    """One LEAF JSON file -> [(writer, x list, y list)] in its ``users`` order, checked."""
    try:
        with open(path) as fh:
            blob = json.load(fh)
        users, user_data, counts = blob["users"], blob["user_data"], blob.get("num_samples")
        writers = [(u, user_data[u]["x"], user_data[u]["y"]) for u in users]
    except (OSError, ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise DataError(f"{path}: not a LEAF JSON file ({type(exc).__name__}: {exc}); "
                        f"delete it and {_HOW_TO_GET}") from None
    for i, (u, x, y) in enumerate(writers):
        if len(x) != len(y) or (counts is not None and counts[i] != len(y)):
            raise DataError(f"{path}: writer {u} has {len(x)} images, {len(y)} labels and num_samples "
                            f"{None if counts is None else counts[i]}; delete it and {_HOW_TO_GET}")
    return writers


def to_arrays(path: str, writer: str, x, y) -> tuple[np.ndarray, np.ndarray]:
    """A writer's JSON lists -> (images_N1HW float32, labels_N int64), checked: shape, finite
    pixels (JSON admits NaN and Infinity), integral labels in range (a float label is refused,
    not truncated)."""
    try:
        images_N1HW = np.asarray(x, dtype=np.float32).reshape(len(y), *INPUT_SHAPE)
        labels_N = np.asarray(y, dtype=np.float64).reshape(len(y))
    except (ValueError, TypeError):
        raise DataError(f"{path}: writer {writer}'s images are not rows of 784 numbers with integer "
                        f"labels; delete it and {_HOW_TO_GET}") from None
    if not np.isfinite(images_N1HW).all():
        bad = int(np.flatnonzero(~np.isfinite(images_N1HW.reshape(len(y), -1)).all(axis=1))[0])
        raise DataError(f"{path}: writer {writer}'s image {bad} has non-finite pixels (NaN or infinity); "
                        f"the file is damaged, delete it and {_HOW_TO_GET}")
    if len(labels_N) and not (np.isfinite(labels_N) & (labels_N == np.round(labels_N))).all():
        bad = labels_N[~(np.isfinite(labels_N) & (labels_N == np.round(labels_N)))][0]
        raise DataError(f"{path}: writer {writer} has a label {bad:g} that is not an integer class; "
                        f"the file is not FEMNIST, {_HOW_TO_GET}")
    if len(labels_N) and (labels_N.min() < 0 or labels_N.max() >= NUM_CLASSES):
        raise DataError(f"{path}: writer {writer} has labels outside [0, {NUM_CLASSES}); the file is not "
                        f"FEMNIST, {_HOW_TO_GET}")
    return images_N1HW, labels_N.astype(np.int64)


def build(data_cfg, root: str, owned_ids: list[int]) -> FederatedData:
    """The first ``data.num_clients`` writers of ``ROOT/FEMNIST/train`` as clients; every rank
    reads their JSON (it needs all sample counts) but converts only its own writers' images."""
    folder = os.path.join(root, FOLDER)
    if not os.path.isdir(folder):
        raise DataError(f"{folder}: FEMNIST not found (LEAF JSON files expected in {FOLDER}/train and "
                        f"{FOLDER}/test); {_HOW_TO_GET}")
    train_files = json_files(os.path.join(folder, "train"))
    test_files = json_files(os.path.join(folder, "test"))
    num_clients, owned = data_cfg.num_clients, set(owned_ids)
    client_of: dict[str, int] = {}  # writer -> client id
    num_samples, train = [], {}
    for path in train_files:
        for writer, x, y in read_writers(path):
            if len(client_of) == num_clients:
                break
            if writer in client_of:
                raise DataError(f"{path}: writer {writer} appears twice in {FOLDER}/train; {_HOW_TO_GET}")
            if not y:  # an empty client would have nothing to train on
                raise DataError(f"{path}: writer {writer} has no training samples; {_HOW_TO_GET}")
            k = client_of[writer] = len(client_of)
            num_samples.append(len(y))
            if k in owned:
                train[k] = ClientData(*map(torch.from_numpy, to_arrays(path, writer, x, y)))
        if len(client_of) == num_clients:
            break
    if len(client_of) < num_clients:
        raise ConfigError(f"data.num_clients: {num_clients} clients but {folder}/train holds only "
                          f"{len(client_of)} FEMNIST writers; set data.num_clients to at most {len(client_of)}")

    tests: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for path in test_files:  # LEAF's test files hold the same writers, in any file order
        for writer, x, y in read_writers(path):
            if writer in client_of:
                tests[client_of[writer]] = to_arrays(path, writer, x, y)
        if len(tests) == num_clients:  # every client writer found: skip the rest
            break
    if not any(len(labels_N) for _, labels_N in tests.values()):
        raise DataError(f"{folder}/test: none of the {num_clients} client writers has test samples (a LEAF "
                        f"split by user, -t user?); {_HOW_TO_GET}")
    test_parts = [tests[k] for k in sorted(tests)]
    test = ClientData(torch.from_numpy(np.concatenate([p[0] for p in test_parts])),
                      torch.from_numpy(np.concatenate([p[1] for p in test_parts])))
    return FederatedData(num_classes=NUM_CLASSES, input_shape=INPUT_SHAPE, num_samples=num_samples,
                         train=train, test=test)
