"""Which clients train in a round, which rank owns which client, and the seeds they use.

Everything here is a pure function of (seed, round, client id): every rank computes the same
sample without communicating, and a client's randomness does not depend on the rank that
trains it. That is what makes a run bitwise the same for any number of ranks.
"""

from __future__ import annotations

import torch

# Distinct streams so the sampler, a client's training and the data never share a seed.
_SAMPLE_STREAM = 0x5A17
_CLIENT_STREAM = 0xC11E


def _mix(*parts: int) -> int:
    """A 63-bit seed from a tuple of ints (splitmix64-style), stable across platforms."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
    return x & 0x7FFFFFFFFFFFFFFF


def owner(client_id: int, world_size: int) -> int:
    return client_id % world_size


def owned_clients(num_clients: int, rank: int, world_size: int) -> list[int]:
    return list(range(rank, num_clients, world_size))


def sample_clients(num_clients: int, num_sampled: int, seed: int, round_idx: int) -> list[int]:
    """K client ids, sorted ascending, drawn without replacement from a generator seeded by
    (seed, round)."""
    if num_sampled >= num_clients:
        return list(range(num_clients))
    gen = torch.Generator().manual_seed(_mix(_SAMPLE_STREAM, seed, round_idx))
    return sorted(torch.randperm(num_clients, generator=gen)[:num_sampled].tolist())


def client_seed(seed: int, round_idx: int, client_id: int) -> int:
    return _mix(_CLIENT_STREAM, seed, round_idx, client_id)


def layout_rows(sampled: list[int], world_size: int) -> tuple[int, list[int]]:
    """Rows per rank M (ranks with fewer sampled clients pad) and, for the gathered
    [world_size * M] rows, the row index of each sampled client in client-id order."""
    per_rank = [[c for c in sampled if owner(c, world_size) == r] for r in range(world_size)]
    rows_per_rank = max(1, max(len(p) for p in per_rank))
    row_of = {c: r * rows_per_rank + i for r, p in enumerate(per_rank) for i, c in enumerate(p)}
    return rows_per_rank, [row_of[c] for c in sampled]
