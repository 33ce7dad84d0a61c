"""Per-client persistent state (SCAFFOLD's c_k, MOON's previous model, FedSMOO's duals).

Legend: P flat elements, R rows (this rank's owned clients).

A client's state lives on its owner rank only, and only once the client has trained: a rank
pays for the clients it owns that have state, never for the others. When another rank trains the
client, the state travels there for the round and back (``fetch``, ``send_home``); the owner's store
stays its home. Two stores with the same dict-like interface, chosen by ``run.client_state``:

  memory  a dict {client id: {name: tensor}} on the run's device.
  mmap    one file per state name under ``out_dir/client_state/rank{r}/``, a row per owned
          client (sparse: untouched rows take neither disk nor RAM). A read maps the client's
          row, copies it out and unmaps it; a write maps, copies in and unmaps, so the process's
          resident memory holds only the client being trained, whatever the number of clients.

Both are what ``checkpoint.save`` captures (``items()``: plain {name: tensor} dicts; for mmap,
tensors that are read-only views of the files, read as the shard is written) and what resume
restores (``restore``). The mmap files are scratch: every run (fresh or resumed) starts them
empty and fills them from the checkpoint, so a crash can never leave a newer state behind.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator, MutableMapping

import numpy as np
import torch


def open_store(kind: str, owned: list[int], folder: str, device: torch.device):
    """The store ``run.client_state`` names, for the clients this rank owns."""
    if kind == "mmap":
        return MmapStore(folder, owned, device)
    assert kind == "memory", kind  # config validation names the choices
    return MemoryStore()


def fetch(comm, store, moves: list[tuple[int, int, int]]) -> dict[int, dict[str, torch.Tensor]]:
    """Before local training: for each (client, owner, trainer) of ``moves`` (``sampling.travelling``,
    the same list on every rank), the owner sends the client's state (empty if it never trained) and
    the trainer receives it. Returns {client id: state} of the clients this rank trains for another
    owner: held for this round only, ``send_home`` gives them back."""
    visiting = {}
    for cid, home, trainer in moves:
        if comm.rank == home:
            comm.send_tensors(dict(store.client(cid)), trainer)
        elif comm.rank == trainer:
            visiting[cid] = comm.recv_tensors(home)
    return visiting


def send_home(comm, store, moves: list[tuple[int, int, int]], visiting: dict[int, dict]) -> None:
    """After local training, the same transfers the other way: each trainer sends the state its
    rule left (and drops it), each owner makes it the client's state in its store."""
    for cid, home, trainer in moves:
        if comm.rank == trainer:
            comm.send_tensors(visiting.pop(cid), home)
        elif comm.rank == home:
            store.replace(cid, comm.recv_tensors(trainer))


class MemoryStore:
    """Client states as tensors in RAM (or on the run's device)."""

    def __init__(self):
        self._states: dict[int, dict[str, torch.Tensor]] = {}

    def client(self, cid: int) -> dict[str, torch.Tensor]:
        """The mutable state of client ``cid`` (empty until its rule writes something)."""
        return self._states.setdefault(int(cid), {})

    def items(self):
        return [(c, s) for c, s in self._states.items() if s]

    def replace(self, cid: int, state: dict[str, torch.Tensor]) -> None:
        """Client ``cid``'s state becomes exactly ``state`` (it came back from another rank)."""
        self._states[int(cid)] = dict(state)

    def restore(self, saved: dict[int, dict[str, torch.Tensor]]) -> None:
        for cid, state in saved.items():
            self.client(cid).update(state)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self._states.values() for t in s.values())

    def close(self) -> None:
        pass


class _Column:
    """One state name: a file of R rows of ``shape`` each, and which rows were written."""

    def __init__(self, path: str, num_rows: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.path, self.shape, self.dtype = path, shape, dtype
        self.np_dtype = torch.empty((), dtype=dtype).numpy().dtype
        self.row_bytes = math.prod(shape) * self.np_dtype.itemsize
        self.written: set[int] = set()
        with open(path, "wb") as fh:  # sparse: no block is allocated until a row is written
            fh.truncate(max(1, num_rows * self.row_bytes))

    def _map(self, row: int, mode: str) -> np.memmap:
        return np.memmap(self.path, dtype=self.np_dtype, mode=mode, offset=row * self.row_bytes,
                         shape=self.shape)

    def read(self, row: int) -> torch.Tensor:
        mapped = self._map(row, "r")
        value = torch.from_numpy(np.array(mapped))
        del mapped  # the last reference: unmapped now, so its pages leave this process's RSS
        return value

    def write(self, row: int, value: torch.Tensor) -> None:
        mapped = self._map(row, "r+")
        mapped[...] = value.detach().to("cpu", self.dtype).numpy()
        del mapped  # unmapped: the dirty pages go to the page cache, not this process's RSS
        self.written.add(row)

    def view(self, row: int) -> torch.Tensor:
        """A read-only (copy-on-write) view of a row, for writing checkpoints without holding
        every client's state in RAM at once."""
        return torch.from_numpy(self._map(row, "c"))


class _MmapClient(MutableMapping):
    def __init__(self, store: "MmapStore", row: int):
        self._store, self._row = store, row

    def __getitem__(self, name: str) -> torch.Tensor:
        column = self._store.columns.get(name)
        if column is None or self._row not in column.written:
            raise KeyError(name)
        return column.read(self._row).to(self._store.device)

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        column = self._store.column(name, tuple(value.shape), value.dtype)
        if tuple(value.shape) != column.shape or value.dtype != column.dtype:
            raise ValueError(f"client state {name!r}: every client must keep the same shape and dtype "
                             f"({column.shape}, {column.dtype}), got ({tuple(value.shape)}, {value.dtype})")
        column.write(self._row, value)

    def __delitem__(self, name: str) -> None:
        column = self._store.columns.get(name)
        if column is None or self._row not in column.written:
            raise KeyError(name)
        column.written.discard(self._row)

    def __contains__(self, name) -> bool:  # without reading the row
        column = self._store.columns.get(name)
        return column is not None and self._row in column.written

    def __iter__(self) -> Iterator[str]:
        return iter([n for n, c in self._store.columns.items() if self._row in c.written])

    def __len__(self) -> int:
        return sum(self._row in c.written for c in self._store.columns.values())


class MmapStore:
    """Client states in memory-mapped files, one row per owned client."""

    def __init__(self, folder: str, owned: list[int], device: torch.device):
        self.folder, self.device = folder, device
        self.row_of = {int(c): i for i, c in enumerate(owned)}
        self.columns: dict[str, _Column] = {}
        shutil.rmtree(folder, ignore_errors=True)  # scratch: never trust a previous run's rows
        os.makedirs(folder, exist_ok=True)

    def column(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> _Column:
        if name not in self.columns:
            path = os.path.join(self.folder, f"{name}.bin")
            self.columns[name] = _Column(path, len(self.row_of), shape, dtype)
        return self.columns[name]

    def client(self, cid: int) -> _MmapClient:
        if int(cid) not in self.row_of:
            raise KeyError(f"client {cid} is not owned by this rank")
        return _MmapClient(self, self.row_of[int(cid)])

    def items(self):
        out = []
        for cid, row in self.row_of.items():
            state = {n: c.view(row) for n, c in self.columns.items() if row in c.written}
            if state:
                out.append((cid, state))
        return out

    def replace(self, cid: int, state: dict[str, torch.Tensor]) -> None:
        """Client ``cid``'s state becomes exactly ``state`` (it came back from another rank)."""
        view = self.client(cid)
        for name in [n for n in view if n not in state]:
            del view[name]
        for name, value in state.items():
            view[name] = value

    def restore(self, saved: dict[int, dict[str, torch.Tensor]]) -> None:
        for cid, state in saved.items():
            view = self.client(cid)
            for name, value in state.items():
                view[name] = value

    def nbytes(self) -> int:
        """Bytes of state written (on disk, not in RAM)."""
        return sum(len(c.written) * c.row_bytes for c in self.columns.values())

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.folder))  # out_dir/client_state, once every rank's is gone
        except OSError:
            pass
