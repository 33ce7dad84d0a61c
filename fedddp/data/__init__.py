"""Federated data: each client's training samples (loaded only on the rank that owns it) and a
global test set.

``build(cfg, seed, owned_ids)`` returns a ``FederatedData`` whose ``train`` holds tensors only for
``owned_ids``; ``num_samples`` is known for every client (it comes from the partition, which every
rank computes from labels alone). Samples are held as tensors (x float32, normalised; y int64
class labels, or float32 targets for a regression task) so that local training indexes minibatches
directly, without a DataLoader. ``task`` names the loss and test metric (fedddp.tasks).
"""

from __future__ import annotations

from .clients import ClientData, FederatedData, LazyClients  # noqa: F401
from .build import build  # noqa: F401

__all__ = ["ClientData", "FederatedData", "LazyClients", "build"]
