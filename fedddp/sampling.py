"""Which clients train in a round, which rank trains which client, and the seeds they use.

Everything here is a pure function of (seed, round, client id) and the clients' sample counts:
every rank computes the same sample and the same assignment without communicating, and a
client's randomness does not depend on the rank that trains it. That is what makes a run
bitwise the same for any number of ranks.
"""

from __future__ import annotations

import numpy as np
import torch

# Distinct streams so the sampler, a client's training and the data never share a seed.
_SAMPLE_STREAM = 0x5A17
_CLIENT_STREAM = 0xC11E
_POISSON_STREAM = 0x9015
_EVAL_COHORT_STREAM = 0xE7A1
_EVAL_CLIENT_STREAM = 0xE7A2
_HELD_OUT_STREAM = 0x4E1D


def _mix(*parts: int) -> int:
    """A 63-bit seed from a tuple of ints (splitmix64-style), stable across platforms."""
    return _mix_prefix(*parts) & 0x7FFFFFFFFFFFFFFF


def owner(client_id: int, world_size: int) -> int:
    return client_id % world_size


def owned_clients(num_clients: int, rank: int, world_size: int) -> range:
    """The client ids ``rank`` owns, ascending: a range, so a population of millions lists none."""
    return range(rank, num_clients, world_size)


def sample_clients(num_clients: int, num_sampled: int, seed: int, round_idx: int) -> list[int]:
    """Fixed-size sampling (run.sampling = fixed): K client ids, sorted ascending, drawn without
    replacement from a generator seeded by (seed, round)."""
    if num_sampled >= num_clients:
        return list(range(num_clients))
    gen = torch.Generator().manual_seed(_mix(_SAMPLE_STREAM, seed, round_idx))
    return sorted(torch.randperm(num_clients, generator=gen)[:num_sampled].tolist())


def sample_poisson(num_clients: int, rate: float, seed: int, round_idx: int) -> list[int]:
    """Poisson sampling: each client independently with probability ``rate`` (q), so the round's
    cohort has q N clients on average and may be empty. Client c is in when a uniform in [0, 1)
    drawn from (seed, round, c) alone is below q: no draw depends on another client or on the
    rank, so every rank computes the same cohort without communicating, for any world size."""
    if rate >= 1.0:
        return list(range(num_clients))
    cohort = []
    for begin in range(0, num_clients, POISSON_BLOCK):  # a block at a time: memory stays flat in N
        client_C = np.arange(begin, min(begin + POISSON_BLOCK, num_clients), dtype=np.uint64)
        cohort.extend((begin + np.flatnonzero(uniforms(client_C, _POISSON_STREAM, seed, round_idx) < rate)).tolist())
    return cohort


# Clients whose Poisson draws are computed at once (8 bytes each, a few arrays).
POISSON_BLOCK = 1 << 16


def uniforms(last_C: np.ndarray, *parts: int) -> np.ndarray:
    """``uniform(*parts, c)`` for each c of the uint64 array ``last_C``, bit for bit: ``_mix``
    in numpy's uint64 arithmetic (which wraps modulo 2**64, as ``_mix`` masks)."""
    x = _mix_prefix(*parts)
    with np.errstate(over="ignore"):
        x_C = (np.uint64(x) ^ last_C) * np.uint64(0xBF58476D1CE4E5B9)
        x_C = (x_C ^ (x_C >> np.uint64(31))) * np.uint64(0x94D049BB133111EB)
        x_C ^= x_C >> np.uint64(29)
    x_C &= np.uint64(0x7FFFFFFFFFFFFFFF)
    return (x_C >> np.uint64(10)).astype(np.float64) * 2.0 ** -53


def _mix_prefix(*parts: int) -> int:
    """splitmix64-style state after ``parts``, before ``_mix``'s final mask to 63 bits."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
    return x


def uniform(*parts: int) -> float:
    """A float64 in [0, 1) from the 63-bit hash of ``parts``: its top 53 bits, 2**-53 apart."""
    return (_mix(*parts) >> 10) * 2.0 ** -53


def client_seed(seed: int, round_idx: int, client_id: int) -> int:
    return _mix(_CLIENT_STREAM, seed, round_idx, client_id)


def eval_cohort(eligible: list[int], num: int, seed: int, round_idx: int) -> list[int]:
    """Client evaluation's cohort of a round (run.client_eval_clients): ``num`` of the
    ``eligible`` client ids (those with held-out samples; 0 or more than there are: all of them),
    sorted, drawn without replacement from (seed, round) on a stream of its own, so it neither
    follows nor moves the training sample, and is the same on every rank for any world size."""
    if num <= 0 or num >= len(eligible):
        return sorted(eligible)
    gen = torch.Generator().manual_seed(_mix(_EVAL_COHORT_STREAM, seed, round_idx))
    return sorted(eligible[i] for i in torch.randperm(len(eligible), generator=gen)[:num].tolist())


def eval_seed(seed: int, round_idx: int, client_id: int) -> int:
    """The seed of a client's personalization steps in client evaluation (run.client_eval_steps),
    apart from its training seed (``client_seed``)."""
    return _mix(_EVAL_CLIENT_STREAM, seed, round_idx, client_id)


def held_out_seed(data_seed: int, client_id: int) -> int:
    """The seed of the permutation that picks a client's held-out samples (data.client_test_fraction),
    from the data seed and the client id alone."""
    return _mix(_HELD_OUT_STREAM, data_seed, client_id)


def batch_size_of(num_samples: int, batch_size: int) -> int:
    """A client's minibatch size: train.batch_size, all its samples when that is <= 0 (full
    batch), and never more than it has."""
    return num_samples if batch_size <= 0 else min(batch_size, num_samples)


def expected_cost(num_samples: int, tc) -> int:
    """Samples a client's local training processes in a round (``tc``: the train config): the
    unit of work by which clients are balanced over ranks."""
    if tc.local_steps > 0:
        return tc.local_steps * batch_size_of(num_samples, tc.batch_size)
    return tc.local_epochs * num_samples


def assign_clients(sampled: list[int], cost_of, world_size: int, balanced: bool) -> list[list[int]]:
    """The sampled clients each rank trains this round, each rank's in client-id order.

    balanced: longest first onto the least-loaded rank (``cost_of(client id)``; ties go to the
    smaller client id, then the lower rank), so ranks finish together however uneven the
    clients are. Otherwise each client goes to its owner (``client_id % world_size``): for data
    sets built whole (``data.build.BUILT_WHOLE``), whose clients exist only on their owner."""
    if not balanced:
        return [[c for c in sampled if owner(c, world_size) == r] for r in range(world_size)]
    per_rank, load_R = [[] for _ in range(world_size)], [0] * world_size
    for cid in sorted(sampled, key=lambda c: (-cost_of(c), c)):
        r = min(range(world_size), key=lambda q: (load_R[q], q))
        per_rank[r].append(cid)
        load_R[r] += cost_of(cid)
    return [sorted(p) for p in per_rank]


def assign_groups(sampled: list[int], cost_of, world_size: int, balanced: bool,
                  size: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """``assign_clients`` for clients trained side by side in groups of up to ``size``
    (run.parallel_clients): per rank, its clients in client-id order and its groups.

    Groups are cut from clients ordered by cost, longest first (ties by client id), so a group
    holds clients of similar work and few steps run with part of the group done. balanced: the
    groups are cut from all sampled clients whatever the world size, and whole groups (cost:
    the sum of their clients') are assigned as ``assign_clients`` assigns clients, so every
    client trains in the same group, and to the same bits, on any number of ranks. Otherwise
    (only for data sets built whole, ``data.build.BUILT_WHOLE``, whose clients exist only on their
    owner) each rank cuts its own clients into groups, which then depend on the world size."""
    def cut(clients):
        ordered = sorted(clients, key=lambda c: (-cost_of(c), c))
        return [sorted(ordered[i:i + size]) for i in range(0, len(ordered), size)]

    if not balanced:
        per_rank = assign_clients(sampled, cost_of, world_size, balanced)
        return per_rank, [cut(p) for p in per_rank]
    groups = cut(sampled)
    per_rank_groups = assign_clients(list(range(len(groups))), lambda g: sum(map(cost_of, groups[g])),
                                     world_size, balanced)
    groups_R = [[groups[g] for g in gs] for gs in per_rank_groups]
    return [sorted(c for g in gs for c in g) for gs in groups_R], groups_R


def travelling(clients: list[int], per_rank: list[list[int]], world_size: int) -> list[tuple[int, int, int]]:
    """(client id, owner rank, training rank) of each of ``clients`` that a rank other than its
    owner trains this round (``per_rank``: the round's assignment), in client-id order: the order
    in which every rank sends and receives per-client state, so each blocking transfer's two ranks
    reach it having finished every earlier one they take part in, and none waits forever."""
    trainer_of = {c: r for r, p in enumerate(per_rank) for c in p}
    return [(c, owner(c, world_size), trainer_of[c]) for c in sorted(clients)
            if owner(c, world_size) != trainer_of[c]]


def layout_rows(sampled: list[int], world_size: int,
                per_rank: list[list[int]] | None = None) -> tuple[int, list[int]]:
    """Rows per rank M (ranks with fewer sampled clients pad) and, for the gathered
    [world_size * M] rows, the row index of each sampled client in client-id order.
    ``per_rank``: the round's assignment (``assign_clients``); by default ownership."""
    if per_rank is None:
        per_rank = assign_clients(sampled, None, world_size, balanced=False)
    rows_per_rank = max(1, max(len(p) for p in per_rank))
    row_of = {c: r * rows_per_rank + i for r, p in enumerate(per_rank) for i, c in enumerate(p)}
    return rows_per_rank, [row_of[c] for c in sampled]
