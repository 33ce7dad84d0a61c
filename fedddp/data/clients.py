"""A client's samples, a federation's data, and clients made on first use."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from ..sampling import held_out_seed


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
    # data.client_test_fraction > 0: each client's held-out samples (client evaluation), for the
    # clients of ``train``, and their counts for all clients; num_samples then counts training
    # samples only. None and [] without a held-out split.
    held_out: Mapping[int, ClientData] | None = None
    num_held_out: list[int] = field(default_factory=list)


class LazyClients(Mapping):
    """{client id: ClientData} whose tensors are made on first access and then kept: a rank that
    may train any client pays only for those it has trained (the uint8 source stays in RAM).
    ``keep=False`` makes a client afresh at each access and keeps nothing, for a source that
    reads a client cheaply (data.name = clients_dir), so memory does not grow with the clients
    trained. ``ids`` as a range stays a range: nothing is listed per client of a population."""

    def __init__(self, make: Callable[[int], ClientData], ids: Iterable[int], keep: bool = True):
        self._make, self._keep, self._made = make, keep, {}
        self._ids = ids if isinstance(ids, range) and ids.step > 0 else sorted(set(ids))
        self._id_set = self._ids if isinstance(self._ids, range) else set(self._ids)

    def __getitem__(self, cid: int) -> ClientData:
        if cid not in self._made:
            if cid not in self._id_set:
                raise KeyError(cid)
            if not self._keep:
                return self._make(cid)
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
        return LazyClients(lambda cid: fn(self._make(cid)), self._ids, self._keep)

    @property
    def ids(self):
        """The client ids, ascending (a range where given one)."""
        return self._ids


def held_out_count(n: int, fraction: float) -> int:
    """Samples held out of a client's n: fraction x n rounded to the nearest (halves up), at most
    n - 1, so every client keeps a training sample (a client of one sample holds none out)."""
    return max(0, min(n - 1, math.floor(fraction * n + 0.5)))


def held_out_positions(n: int, fraction: float, data_seed: int, client_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training positions, held-out positions) of a client's n samples, each ascending: the
    first ``held_out_count`` of a permutation drawn from (data seed, client id) alone, so every
    rank picks the same samples for any world size."""
    m = held_out_count(n, fraction)
    if m == 0:
        return torch.arange(n), torch.arange(0)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(held_out_seed(data_seed, client_id)))
    return order[m:].sort().values, order[:m].sort().values


def hold_out(data: FederatedData, fraction: float, data_seed: int) -> FederatedData:
    """``data`` with each client's held-out samples (data.client_test_fraction) taken out of its
    training samples: ``train`` and ``held_out`` made per client on first access from the
    client's samples as built (a client made lazily is made afresh for each part, so neither its
    whole tensors nor the other part stay in memory), ``num_samples`` the training counts and
    ``num_held_out`` the held-out ones. Training samples keep their order. ``fraction`` 0:
    ``data`` itself, unchanged."""
    if fraction <= 0:
        return data
    source, counts = data.train, list(data.num_samples)
    whole = source._make if isinstance(source, LazyClients) else source.__getitem__

    def part(which: int) -> Callable[[int], ClientData]:
        def make(cid: int) -> ClientData:
            full = whole(cid)
            index = held_out_positions(counts[cid], fraction, data_seed, cid)[which].to(full.y.device)
            return ClientData(full.x[index], full.y[index])
        return make

    ids, keep = (source.ids, source._keep) if isinstance(source, LazyClients) else (list(source), True)
    data.held_out = LazyClients(part(1), ids, keep)
    data.train = LazyClients(part(0), ids, keep)
    data.num_held_out = [held_out_count(n, fraction) for n in counts]
    data.num_samples = [n - m for n, m in zip(counts, data.num_held_out)]
    return data
