"""Files written atomically: to a temporary name, flushed to disk, then renamed (atomic on
POSIX), so a crash or a full disk never leaves a half-written file under the real name."""

from __future__ import annotations

import contextlib
import os
import zlib

import torch


class _CrcWriter:
    """The file object torch.save writes to: counts and checksums the bytes on their way."""

    def __init__(self, fh):
        self.fh, self.size, self.crc32 = fh, 0, 0

    def write(self, data) -> int:
        self.crc32 = zlib.crc32(data, self.crc32)
        self.size += memoryview(data).nbytes
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def atomic_save(obj, path: str) -> dict:
    """torch.save to ``path`` atomically; returns the file's manifest entry {size, crc32}."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            out = _CrcWriter(fh)
            torch.save(obj, out)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a partial file only takes space (on a full disk)
            os.remove(tmp)
        raise
    return {"size": out.size, "crc32": out.crc32}


def atomic_write_text(text: str, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
