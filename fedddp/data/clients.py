"""A client's samples, a federation's data, and clients made on first use."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch


@dataclass
class ClientData:
    x: torch.Tensor  # [n, *input_shape] float32
    y: torch.Tensor  # [n] int64 labels (classification) or float32 targets (regression)

    def __len__(self) -> int:
        return self.y.shape[0]


@dataclass
class FederatedData:
    num_classes: int  # the model's outputs: classes, or 1 for a regression target
    input_shape: tuple[int, ...]
    num_samples: list[int]  # per client id, for all clients
    train: dict[int, ClientData]  # only the clients this rank owns
    test: ClientData  # the global test set (the round loop shards it over ranks)
    task: str = "classification"  # or "regression" (fedddp.tasks: loss and test metric)


class LazyClients(Mapping):
    """{client id: ClientData} whose tensors are made on first access and then kept: a rank that
    may train any client pays only for those it has trained (the uint8 source stays in RAM)."""

    def __init__(self, make: Callable[[int], ClientData], ids: Iterable[int]):
        self._make, self._ids, self._made = make, sorted(set(ids)), {}
        self._id_set = set(self._ids)

    def __getitem__(self, cid: int) -> ClientData:
        if cid not in self._made:
            if cid not in self._id_set:
                raise KeyError(cid)
            self._made[cid] = self._make(cid)
        return self._made[cid]

    def __iter__(self):
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, cid) -> bool:
        return cid in self._id_set

    def mapped(self, fn: Callable[[ClientData], ClientData]) -> "LazyClients":
        """The same clients with ``fn`` applied on first access (e.g. a move to the GPU)."""
        return LazyClients(lambda cid: fn(self._make(cid)), self._ids)
