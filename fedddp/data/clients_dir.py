"""data.name = "clients_dir": a population on disk (the folder data.path), a client's samples
read from the files when it trains, so a population of millions of clients runs in memory that
grows with the clients a round trains, not with the population's samples.

The folder (docs/datasets.md, "A population on disk"; ``write`` and ``create`` make it):

  meta.json     {"format": "fedddp-clients-dir", "version": 1, "num_clients": N,
                 "task": "classification" | "regression", "num_classes": C}
  offsets.npy   [N + 1] int64: client k's samples are rows offsets[k] .. offsets[k + 1] - 1
  x.npy         [S, *shape] numbers: every client's training samples, client 0's first
  y.npy         [S] int class labels in [0, C) or float regression targets
  x_test.npy    [T, *shape] the global test set (read whole)
  y_test.npy    [T]

The arrays are ``numpy.save`` files in C order. A client's rows are read with ``os.pread``
from their byte offset, so reading a client reads only its rows and maps nothing: memory holds
the offsets (8 bytes a client) and the clients being trained. Samples become float32 as they
are (normalise them when you write them), labels int64, targets float32: the same tensors as
data.name = tensors with the same samples and client_train (data.partition = natural), so the
two give the same bits. data.partition is ignored: the folder's clients are the clients.

Every problem with the folder is one line naming the file: DataError (exit 3), or ConfigError
(exit 2) where a config key must change (data.num_clients, data.holdout_from_test).

Legend: N clients, S training samples, T test samples.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from .clients import ClientData, FederatedData, LazyClients
from ..errors import ConfigError, DataError
from ..tasks import TASKS

FORMAT, VERSION = "fedddp-clients-dir", 1
META, OFFSETS, X, Y, X_TEST, Y_TEST = "meta.json", "offsets.npy", "x.npy", "y.npy", "x_test.npy", "y_test.npy"
# rows a check reads at once: the folder is checked in pieces, never held whole
CHECK_ROWS = 1 << 20


class RowFile:
    """One .npy file's rows read by byte offset (``os.pread``): its dtype and row shape from the
    header, nothing mapped and nothing kept but the open descriptor."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                major, _ = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read_header(f)
                self.start = f.tell()
        except FileNotFoundError:
            raise DataError(f"{path}: no such file (a clients_dir folder holds {META}, {OFFSETS}, {X}, {Y}, "
                            f"{X_TEST}, {Y_TEST}; docs/datasets.md)") from None
        except (OSError, ValueError) as exc:
            raise DataError(f"{path}: not a file written by numpy.save ({exc})") from None
        if fortran and len(shape) > 1:
            raise DataError(f"{path}: stored in Fortran order; write it in C order (numpy.save of "
                            "numpy.ascontiguousarray)")
        if dtype.kind not in "fiub" or dtype.hasobject:
            raise DataError(f"{path}: must hold numbers, got dtype {dtype}")
        if not shape:
            raise DataError(f"{path}: must be an array of rows, got a single value")
        self.shape, self.dtype = tuple(shape), dtype
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        if os.path.getsize(path) < self.start + shape[0] * self.row_bytes:
            raise DataError(f"{path}: shorter than its header's shape {list(shape)}; the file is cut, write it again")
        self._fd = os.open(path, os.O_RDONLY)

    def rows(self, begin: int, end: int) -> np.ndarray:
        """Rows begin .. end - 1, read from the file into an array of their own."""
        count = (end - begin) * self.row_bytes
        out = np.empty((end - begin, *self.shape[1:]), dtype=self.dtype)
        got = os.preadv(self._fd, [memoryview(out.reshape(-1).view(np.uint8))], self.start + begin * self.row_bytes) \
            if count else 0
        if got != count:
            raise DataError(f"{self.path}: rows {begin} .. {end - 1} could not be read (the file changed)")
        return out

    def pieces(self):
        """The whole array in pieces of CHECK_ROWS rows, one piece in memory at a time."""
        for begin in range(0, self.shape[0], CHECK_ROWS):
            yield self.rows(begin, min(begin + CHECK_ROWS, self.shape[0]))

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


def build(data_cfg, owned_ids) -> FederatedData:
    """The folder data.path's population: counts for every client from the offsets, a client's
    tensors read when it trains and not kept (the next use reads them again)."""
    folder = data_cfg.path
    if not os.path.isdir(folder):
        raise DataError(f"data.path: {folder!r} is not a folder (data.name = clients_dir reads a folder written "
                        f"by fedddp.data.clients_dir.write; docs/datasets.md)")
    if data_cfg.holdout_from_test > 0:
        raise ConfigError("data.holdout_from_test: a clients_dir folder brings its own test set; set "
                          "data.holdout_from_test = 0 (data.client_test_fraction holds out of each client)")
    meta = _meta(os.path.join(folder, META))
    offsets_K1 = _offsets(os.path.join(folder, OFFSETS), meta["num_clients"], data_cfg.num_clients)
    x, y = RowFile(os.path.join(folder, X)), RowFile(os.path.join(folder, Y))
    x_test, y_test = RowFile(os.path.join(folder, X_TEST)), RowFile(os.path.join(folder, Y_TEST))
    for xs, ys in ((x, y), (x_test, y_test)):
        if len(ys.shape) != 1 or ys.shape[0] != xs.shape[0]:
            raise DataError(f"{ys.path}: must be [{xs.shape[0]}] (one per row of {os.path.basename(xs.path)}), "
                            f"got shape {list(ys.shape)}")
    if x.shape[1:] != x_test.shape[1:]:
        raise DataError(f"{x_test.path}: samples of shape {list(x_test.shape[1:])}, but {X} holds samples of "
                        f"shape {list(x.shape[1:])}; they must match")
    if int(offsets_K1[-1]) != x.shape[0]:
        raise DataError(f"{os.path.join(folder, OFFSETS)}: ends at row {int(offsets_K1[-1])} but {X} has "
                        f"{x.shape[0]} rows; they must match")
    for ys in (y, y_test):
        _check_targets(ys, meta["task"], meta["num_classes"])
    for xs in (x, x_test):
        _check_finite(xs)
    label_dtype = np.int64 if meta["task"] == "classification" else np.float32

    def client(k: int) -> ClientData:
        begin, end = int(offsets_K1[k]), int(offsets_K1[k + 1])
        return ClientData(torch.from_numpy(x.rows(begin, end).astype(np.float32, copy=False)),
                          torch.from_numpy(y.rows(begin, end).astype(label_dtype, copy=False)))

    test = ClientData(torch.from_numpy(x_test.rows(0, x_test.shape[0]).astype(np.float32, copy=False)),
                      torch.from_numpy(y_test.rows(0, y_test.shape[0]).astype(label_dtype, copy=False)))
    return FederatedData(num_classes=meta["num_classes"], input_shape=tuple(x.shape[1:]),
                         num_samples=np.diff(offsets_K1).tolist(), train=LazyClients(client, owned_ids, keep=False),
                         test=test, task=meta["task"])


def _meta(path: str) -> dict:
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file; a clients_dir folder starts with it (docs/datasets.md)") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        got = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else type(meta).__name__
        raise DataError(f"{path}: must say \"format\": \"{FORMAT}\", \"version\": {VERSION}; got {got}")
    task, num_classes, num_clients = meta.get("task"), meta.get("num_classes"), meta.get("num_clients")
    if task not in TASKS:
        raise DataError(f"{path}: task is {task!r}; it must be one of {', '.join(TASKS)}")
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise DataError(f"{path}: num_clients must be a positive integer, got {num_clients!r}")
    if task == "regression":
        if num_classes not in (None, 1):
            raise DataError(f"{path}: num_classes is for classification; a regression task has one output "
                            "(drop num_classes or set it to 1)")
        meta["num_classes"] = 1
    elif isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise DataError(f"{path}: num_classes must be a positive integer, got {num_classes!r}")
    return meta


def _offsets(path: str, num_clients: int, configured: int) -> np.ndarray:
    """offsets.npy, checked: N + 1 ascending row numbers from 0, no client empty."""
    offsets = RowFile(path)
    if offsets.dtype.kind not in "iu" or len(offsets.shape) != 1 or offsets.shape[0] != num_clients + 1:
        raise DataError(f"{path}: must be [{num_clients + 1}] integers (meta.json's num_clients + 1), got shape "
                        f"{list(offsets.shape)} of dtype {offsets.dtype}")
    if configured != num_clients:
        raise ConfigError(f"data.num_clients: the folder of {path} holds {num_clients} clients; set "
                          f"data.num_clients = {num_clients}")
    offsets_K1 = offsets.rows(0, num_clients + 1).astype(np.int64)
    counts_K = np.diff(offsets_K1)
    if offsets_K1[0] != 0 or (counts_K <= 0).any():
        empty = np.flatnonzero(counts_K <= 0)
        raise DataError(f"{path}: must rise from 0, every client holding a sample; " +
                        (f"starts at {int(offsets_K1[0])}" if offsets_K1[0] != 0 else
                         f"client(s) {', '.join(map(str, empty[:5]))}{' ...' if len(empty) > 5 else ''} hold none"))
    return offsets_K1


def _check_targets(ys: RowFile, task: str, num_classes: int) -> None:
    """Labels: integers in [0, num_classes); targets: finite floats. Read in pieces."""
    if task == "classification":
        if ys.dtype.kind not in "iu":
            raise DataError(f"{ys.path}: must be integer class labels for a classification task, got dtype "
                            f"{ys.dtype} (or write task = \"regression\" in {META})")
        for piece in ys.pieces():
            if len(piece) and (int(piece.min()) < 0 or int(piece.max()) >= num_classes):
                raise DataError(f"{ys.path}: labels in [{int(piece.min())}, {int(piece.max())}], outside "
                                f"[0, {num_classes}) ({META}'s num_classes = {num_classes})")
    elif ys.dtype.kind != "f":
        raise DataError(f"{ys.path}: must be float targets for a regression task, got dtype {ys.dtype}")
    else:
        _check_finite(ys)


def _check_finite(xs: RowFile) -> None:
    """Float samples have no NaN or infinity as float32 (integer ones cannot). Read in pieces."""
    if xs.dtype.kind != "f":
        return
    for piece in xs.pieces():
        if not np.isfinite(piece.astype(np.float32, copy=False)).all():
            raise DataError(f"{xs.path}: holds non-finite value(s) (NaN or infinity) as float32")


def create(folder: str, counts_K, sample_shape, x_dtype, y_dtype, x_test, y_test,
           num_classes: int | None = None) -> tuple[np.memmap, np.memmap]:
    """A clients_dir folder for clients of ``counts_K`` samples each (client 0's rows first):
    writes meta.json, offsets.npy and the test set, and returns x.npy and y.npy opened for
    writing ([S, *sample_shape], [S]), to be filled in pieces. Float ``y_dtype``: a regression
    task; integer: classification with ``num_classes`` classes."""
    counts_K = np.asarray(counts_K, dtype=np.int64)
    task = "regression" if np.dtype(y_dtype).kind == "f" else "classification"
    if task == "classification" and num_classes is None:
        raise ValueError("num_classes: give the number of classes of a classification task")
    os.makedirs(folder, exist_ok=True)
    offsets_K1 = np.concatenate([[0], np.cumsum(counts_K)]).astype(np.int64)
    np.save(os.path.join(folder, OFFSETS), offsets_K1)
    np.save(os.path.join(folder, X_TEST), np.ascontiguousarray(x_test))
    np.save(os.path.join(folder, Y_TEST), np.ascontiguousarray(y_test))
    total, open_memmap = int(offsets_K1[-1]), np.lib.format.open_memmap
    x = open_memmap(os.path.join(folder, X), mode="w+", dtype=x_dtype, shape=(total, *sample_shape))
    y = open_memmap(os.path.join(folder, Y), mode="w+", dtype=y_dtype, shape=(total,))
    meta = {"format": FORMAT, "version": VERSION, "num_clients": len(counts_K), "task": task,
            "num_classes": 1 if task == "regression" else int(num_classes)}
    with open(os.path.join(folder, META), "w") as f:
        json.dump(meta, f, indent=1)
    return x, y


def write(folder: str, x_train, y_train, client_train, x_test, y_test, num_classes: int | None = None) -> None:
    """A clients_dir folder from arrays (numpy or torch) as data.name = tensors takes them: each
    training sample's client id in ``client_train`` (clients 0 .. max, none empty), a client's
    samples kept in their order. ``num_classes``: by default the largest label + 1."""
    arrays = [a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
              for a in (x_train, y_train, client_train, x_test, y_test)]
    x_train, y_train, client_train, x_test, y_test = arrays
    order_N = np.argsort(client_train, kind="stable")
    counts_K = np.bincount(client_train)
    if num_classes is None and y_train.dtype.kind in "iu":
        num_classes = int(max(y_train.max(), y_test.max())) + 1
    x, y = create(folder, counts_K, x_train.shape[1:], x_train.dtype, y_train.dtype, x_test, y_test, num_classes)
    x[:] = x_train[order_N]
    y[:] = y_train[order_N]
    x.flush()
    y.flush()
