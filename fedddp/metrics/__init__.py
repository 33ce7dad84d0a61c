"""Metrics computed from models: effective rank of conv layers (FedER)."""

from .effective_rank import effective_ranks_L, entropy, evbmf, layer_effective_rank  # noqa: F401
