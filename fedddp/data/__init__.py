"""Federated data: each client's training samples (loaded only on the rank that owns it) and a
global test set.

``build(cfg, seed, owned_ids)`` returns a ``FederatedData`` whose ``train`` holds tensors only for
``owned_ids``; ``num_samples`` is known for every client (it comes from the partition, which every
rank computes from labels alone). Samples are held as tensors (x float32, normalised; y int64
class labels, or float32 targets for a regression task) so that local training indexes minibatches
directly, without a DataLoader. ``task`` names the loss and test metric (fedddp.tasks).
"""

from __future__ import annotations

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


from .build import build  # noqa: E402,F401
