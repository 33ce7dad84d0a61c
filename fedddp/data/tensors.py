"""A data set as a mapping of arrays: ``data.name = "tensors"`` (the arrays in the file
``data.path``) or ``data.name = "module:attr"`` (your callable (root, seed) -> the mapping).

  x_train       [N, *shape]  numbers (made float32 as they are: normalise them yourself)
  y_train       [N]          int class labels in [0, num_classes), or float regression targets
  x_test        [T, *shape]
  y_test        [T]
  client_train  [N]          optional: each training sample's client id, 0 .. num_clients - 1
                             (the natural clients of data.partition = natural)
  task          optional: "classification" or "regression" (default: from y_train's dtype)
  num_classes   optional: classification only (default: the largest label + 1)

Numpy arrays or torch tensors. A file is an ``.npz`` (``numpy.savez``) or a ``.pt`` holding a
dict (``torch.save``; read with ``weights_only=True``). Every check is one line naming the key:
DataError (exit 3) for the arrays, ConfigError (exit 2) where a config key must change.
Then the usual path: data.holdout_from_test carves train and test from the test arrays, a
partitioner (or client_train) splits the training samples, and a client's tensors are made
when it first trains (LazyClients), bitwise the same on every rank.

Legend: N training samples, T test samples.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import torch

from .clients import ClientData, FederatedData, LazyClients
from . import partition
from ..errors import ConfigError, DataError
from ..tasks import TASKS

REQUIRED = ("x_train", "y_train", "x_test", "y_test")
OPTIONAL = ("client_train", "task", "num_classes")
BY_LABEL = ("dirichlet", "shards", "classes")  # partitioners that read class labels


def read(path: str) -> dict:
    """The mapping stored in an .npz or .pt file."""
    where = f"data.path: {path}"
    if not os.path.isfile(path):
        raise DataError(f"{where}: no such file (data.path is read from the working directory "
                        f"{os.getcwd()})")
    try:
        if path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as npz:
                return {key: npz[key] for key in npz.files}
        mapping = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the reader says of a bad file is one line
        kind = "numpy.savez" if path.endswith(".npz") else "torch.save of a dict of tensors"
        raise DataError(f"{where}: cannot read it as a file written by {kind} ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    return mapping


def build(mapping, where: str, data_cfg, seed: int, owned_ids: list[int]) -> FederatedData:
    """The checked arrays, holdout split and partition -> FederatedData; ``where`` names the
    source in every error line."""
    arrays = _checked(mapping, where)
    task, num_classes = arrays["task"], arrays["num_classes"]
    x_train, y_train, x_test, y_test = (arrays[k] for k in REQUIRED)
    natural = data_cfg.partition == "natural"
    if data_cfg.holdout_from_test > 0:
        if natural:
            raise ConfigError("data.holdout_from_test: the natural clients (client_train) are of the training "
                              "arrays, which a holdout split replaces; set data.holdout_from_test = 0 or "
                              "another data.partition")
        (x_train, y_train), (x_test, y_test) = partition.holdout_split((x_test, y_test), data_cfg.holdout_from_test, seed)
    if natural:
        parts = _natural(arrays.get("client_train"), data_cfg.num_clients, where)
    else:
        if task == "regression" and data_cfg.partition in BY_LABEL:
            raise ConfigError(f"data.partition: {data_cfg.partition} splits by class label and {where} holds "
                              "regression targets; use iid (or natural with client_train)")
        parts = partition.split(y_train, data_cfg, seed)

    def client(k: int) -> ClientData:
        return ClientData(torch.from_numpy(rows(x_train, parts[k])), torch.from_numpy(rows(y_train, parts[k])))

    return FederatedData(num_classes=num_classes, input_shape=tuple(x_train.shape[1:]),
                         num_samples=[len(p) for p in parts], train=LazyClients(client, owned_ids),
                         test=ClientData(torch.from_numpy(x_test), torch.from_numpy(y_test)), task=task)


def rows(array: np.ndarray, part: np.ndarray) -> np.ndarray:
    """The rows ``part`` (ascending, distinct indices) of ``array``: a view where they are one
    run of consecutive rows, as natural clients are in arrays ordered by client (pfl's CIFAR10
    users: no copy of a user's images, and no second copy of the training set once every
    client has trained), a copy otherwise. A client's tensors are only read."""
    if len(part) and part[-1] - part[0] + 1 == len(part):
        return array[part[0]:part[-1] + 1]
    return array[part]


def all_finite(array: np.ndarray) -> bool:
    """Whether every value of a float array is finite, without the array-sized boolean mask of
    ``np.isfinite`` (150 MB for pfl's CIFAR10 arrays, most of the check's time in fresh pages):
    a sum is finite only if every term is (a NaN or an infinity makes it NaN or infinite), so a
    finite sum answers at once; a sum that is not (finite values may overflow) is settled
    value by value."""
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow or inf - inf is an answer, not a warning
        finite_sum = bool(np.isfinite(array.sum()))
    return finite_sum or bool(np.isfinite(array).all())


def _array(value, key: str, where: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return value
    raise DataError(f"{where}: {key} is a {type(value).__name__}; give a numpy array or a torch tensor")


def _scalar(value, key: str, where: str):
    """A 0-d array (how .npz stores a string or number) or a plain value -> the Python value."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        if value.ndim != 0:
            raise DataError(f"{where}: {key} must be a single value, got an array of shape {list(value.shape)}")
        value = value.item()
    return value


def _checked(mapping, where: str) -> dict:
    """The arrays as float32 inputs and int64 labels / float32 targets, with task and
    num_classes resolved; every problem is a DataError naming the key."""
    if not isinstance(mapping, Mapping):
        raise DataError(f"{where}: gave a {type(mapping).__name__}; it must be a mapping with keys "
                        f"{', '.join(REQUIRED)} (docs/extending.md)")
    missing = [k for k in REQUIRED if k not in mapping]
    unknown = sorted(str(k) for k in mapping if k not in REQUIRED + OPTIONAL)
    if missing or unknown:
        what = (f"has no {', '.join(missing)}" if missing else "") + ("; " if missing and unknown else "") + \
               (f"has unknown key(s) {', '.join(unknown)}" if unknown else "")
        raise DataError(f"{where}: {what} (keys: {', '.join(REQUIRED)}, optional {', '.join(OPTIONAL)})")
    out = {k: _array(mapping[k], k, where) for k in REQUIRED}
    for split in ("train", "test"):
        x, y = out[f"x_{split}"], out[f"y_{split}"]
        if x.ndim < 2 or len(x) == 0:
            raise DataError(f"{where}: x_{split} must be [samples, *features] with at least one sample, got "
                            f"shape {list(x.shape)}")
        if y.shape != (len(x),):
            raise DataError(f"{where}: y_{split} must be [{len(x)}] (one per x_{split} sample), got shape "
                            f"{list(y.shape)}")
        if x.dtype.kind not in "fiub":
            raise DataError(f"{where}: x_{split} must hold numbers, got dtype {x.dtype}")
    if out["x_train"].shape[1:] != out["x_test"].shape[1:]:
        raise DataError(f"{where}: x_train samples have shape {list(out['x_train'].shape[1:])} but x_test samples "
                        f"{list(out['x_test'].shape[1:])}; they must match")
    for key in ("x_train", "x_test"):
        out[key] = np.ascontiguousarray(out[key], dtype=np.float32)
        if not all_finite(out[key]):
            raise DataError(f"{where}: {key} has {int((~np.isfinite(out[key])).sum())} non-finite value(s) "
                            "(NaN or infinity) as float32")
    task = _scalar(mapping.get("task", "classification" if out["y_train"].dtype.kind in "iu" else "regression"),
                   "task", where)
    if task not in TASKS:
        raise DataError(f"{where}: task is {task!r}; it must be one of {', '.join(TASKS)}")
    labels = task == "classification"
    for key in ("y_train", "y_test"):
        y = out[key]
        if labels and y.dtype.kind not in "iu":
            raise DataError(f"{where}: {key} must be integer class labels for a classification task, got dtype "
                            f"{y.dtype} (or set task = \"regression\")")
        if not labels and y.dtype.kind != "f":
            raise DataError(f"{where}: {key} must be float targets for a regression task, got dtype {y.dtype}")
        out[key] = np.ascontiguousarray(y, dtype=np.int64 if labels else np.float32)
        if not labels and not all_finite(out[key]):
            raise DataError(f"{where}: {key} has {int((~np.isfinite(out[key])).sum())} non-finite target(s)")
    if labels:
        largest = int(max(out["y_train"].max(), out["y_test"].max()))
        num_classes = _scalar(mapping.get("num_classes", largest + 1), "num_classes", where)
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise DataError(f"{where}: num_classes must be a positive integer, got {num_classes!r}")
        for key in ("y_train", "y_test"):
            low, high = int(out[key].min()), int(out[key].max())
            if low < 0 or high >= num_classes:
                raise DataError(f"{where}: {key} has labels in [{low}, {high}], outside [0, {num_classes}) "
                                f"(num_classes = {num_classes})")
    else:
        if "num_classes" in mapping and _scalar(mapping["num_classes"], "num_classes", where) != 1:
            raise DataError(f"{where}: num_classes is for classification; a regression task has one output "
                            "(drop num_classes or set it to 1)")
        num_classes = 1
    out.update(task=task, num_classes=num_classes)
    if "client_train" in mapping:
        ids = _array(mapping["client_train"], "client_train", where)
        if ids.shape != (len(out["x_train"]),) or ids.dtype.kind not in "iu":
            raise DataError(f"{where}: client_train must be [{len(out['x_train'])}] integer client ids (one per "
                            f"training sample), got shape {list(ids.shape)} of dtype {ids.dtype}")
        out["client_train"] = ids.astype(np.int64)
    return out


def _natural(client_N: np.ndarray | None, num_clients: int, where: str) -> list[np.ndarray]:
    """client_train -> each client's sorted sample indices; clients 0 .. num_clients - 1, none empty."""
    if client_N is None:
        raise ConfigError(f"data.partition: natural needs each training sample's client id, and {where} has no "
                          "client_train; add it or use iid, dirichlet, shards or classes")
    low, high = int(client_N.min()), int(client_N.max())
    if low < 0 or high >= num_clients:
        raise ConfigError(f"data.num_clients: {where}'s client_train has ids {low} to {high} but data.num_clients "
                          f"= {num_clients}; set data.num_clients = {high + 1} (ids run from 0)")
    counts_K = np.bincount(client_N, minlength=num_clients)
    if (counts_K == 0).any():
        empty = np.flatnonzero(counts_K == 0)
        raise DataError(f"{where}: client_train names no sample for client(s) {', '.join(map(str, empty[:5]))}"
                        f"{' ...' if len(empty) > 5 else ''}; client ids must run 0 .. {num_clients - 1} with "
                        "every client holding a sample")
    order_N = np.argsort(client_N, kind="stable").astype(np.int64)
    return np.split(order_N, np.cumsum(counts_K)[:-1])
