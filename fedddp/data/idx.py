"""MNIST and FashionMNIST read straight from their IDX files (torchvision folder layout).

Why not ``torchvision.datasets.MNIST``: it refuses a folder that lacks the train split, and the
project's real MNIST copy (``../shared/data/MNIST/raw``) holds only the t10k split. Reading the
IDX files ourselves lets ``data.holdout_from_test`` carve train and test from t10k alone.
torchvision is still used to *download* (``data.download=true``): it fills ``ROOT/MNIST/raw``
with the very files read here.

IDX format: 2 zero bytes, a type code, the number of dims; then each dim as a big-endian uint32;
then the values, big-endian, row-major. Legend: N images, H x W pixels.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib

import numpy as np

from ..errors import DataError

# IDX type code -> numpy dtype (big-endian as stored).
_IDX_DTYPES = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"),
               0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}

FOLDERS = {"mnist": "MNIST", "fashionmnist": "FashionMNIST"}
# Per-channel mean and std of the 60,000 training images (pixels in [0, 1]).
STATS = {"mnist": ((0.1307,), (0.3081,)), "fashionmnist": ((0.2860,), (0.3530,))}
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def read_idx(path: str) -> np.ndarray:
    """One IDX file (plain, or gzip if the name ends in .gz) -> array in native byte order.
    A bad header or a size that does not match the header raises DataError naming the file."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError, zlib.error) as exc:  # BadGzipFile is an OSError
        raise DataError(f"{path}: cannot read IDX file ({exc}); delete it and fetch it again") from None

    def corrupt(why: str) -> DataError:
        return DataError(f"{path}: corrupt IDX file ({why}); delete it and fetch it again")

    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES or raw[3] == 0:
        raise corrupt(f"bad magic number {raw[:4].hex() or 'empty'}")
    dtype, num_dims = _IDX_DTYPES[raw[2]], raw[3]
    header = 4 + 4 * num_dims
    if len(raw) < header:
        raise corrupt("truncated header")
    dims = struct.unpack(f">{num_dims}I", raw[4:header])
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise corrupt(f"{len(raw) - header} data bytes, header {list(dims)} says {expected}")
    array = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return array.astype(dtype.newbyteorder("="), copy=False)


def _find(folder: str, stem: str) -> str | None:
    """The plain file if present (faster), else its .gz, else None."""
    for name in (stem, stem + ".gz"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def _download(root: str, name: str) -> None:
    import torchvision  # late: only a download needs it

    cls = {"mnist": torchvision.datasets.MNIST, "fashionmnist": torchvision.datasets.FashionMNIST}[name]
    try:
        cls(root, train=True, download=True)  # fetches all four files into ROOT/<Folder>/raw
    except Exception as exc:  # network errors come in many types; all mean the same to the user
        raise DataError(f"{os.path.join(root, FOLDERS[name], 'raw')}: download of {FOLDERS[name]} "
                        f"failed ({exc}); fetch the files by hand or check the internet connection") from None


def load(root: str, name: str, with_train: bool, download: bool = False):
    """``ROOT/MNIST/raw`` (or ``FashionMNIST``) -> (train, test), each ``(images_NCHW uint8,
    labels_N int64)``; train is None when ``with_train`` is False (only t10k is then needed)."""
    folder = os.path.join(root, FOLDERS[name], "raw")
    splits = ("train", "test") if with_train else ("test",)
    expected = [stem for split in splits for stem in FILES[split]]
    missing = [stem for stem in expected if _find(folder, stem) is None]
    if missing and download:
        _download(root, name)
        missing = [stem for stem in expected if _find(folder, stem) is None]
    if missing:
        only_train_missing = all(stem.startswith("train") for stem in missing)
        hint = (", or data.holdout_from_test=0.2 to split train and test from the t10k files alone"
                if only_train_missing else "")
        raise DataError(f"{folder}: {FOLDERS[name]} files missing: {', '.join(missing)} "
                        f"(expected {', '.join(expected)}, each plain or .gz); set data.root or "
                        f"FEDDDP_DATA to the folder that holds {FOLDERS[name]}/raw, or "
                        f"data.download=true (needs internet){hint}")
    out = []
    for split in ("train", "test"):
        if split not in splits:
            out.append(None)
            continue
        images_path, labels_path = (_find(folder, stem) for stem in FILES[split])
        images_NHW, labels_N = read_idx(images_path), read_idx(labels_path)
        if images_NHW.ndim != 3 or images_NHW.dtype != np.uint8:
            raise DataError(f"{images_path}: expected uint8 images [N, H, W], got "
                            f"{images_NHW.dtype} {list(images_NHW.shape)}; delete it and fetch it again")
        if labels_N.dtype.kind not in "iu":  # a float type code would be truncated into classes
            raise DataError(f"{labels_path}: expected integer labels, got {labels_N.dtype}; delete it "
                            "and fetch it again")
        if labels_N.ndim != 1 or len(labels_N) != len(images_NHW):
            raise DataError(f"{labels_path}: expected {len(images_NHW)} labels to match "
                            f"{images_path}, got shape {list(labels_N.shape)}; delete it and fetch it again")
        out.append((images_NHW[:, None], labels_N.astype(np.int64)))
    return out[0], out[1]
