"""Which rank trains which client: balanced by expected cost (every local rule: per-client state
travels, tests/test_state_travels.py), by ownership only for data sets built whole; clients'
tensors made on the rank that trains them."""

from __future__ import annotations

import itertools

import pytest

from fedddp import sampling
from fedddp.config import TrainConfig
from fedddp.data import build
from test_data import config, make_mnist


def test_balanced_assignment_beats_ownership_on_uneven_clients():
    """Guards the straggler: by client_id % world_size the two big clients land on one rank,
    which then trains twice as long as the other."""
    cost = {0: 100, 1: 10, 2: 100, 3: 10, 4: 10, 5: 10}
    sampled = sorted(cost)
    load = lambda per_rank: [sum(cost[c] for c in p) for p in per_rank]  # noqa: E731
    assert load(sampling.assign_clients(sampled, cost.get, 2, balanced=False)) == [210, 30]
    per_rank = sampling.assign_clients(sampled, cost.get, 2, balanced=True)
    assert load(per_rank) == [120, 120]
    assert per_rank == [[0, 1, 4], [2, 3, 5]]  # longest first, ties by client id then rank


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_balanced_assignment_is_a_partition_within_lpt_bound(world_size):
    cost = {c: (c * 7919) % 97 + 1 for c in range(0, 40, 3)}
    sampled = sorted(cost)
    per_rank = sampling.assign_clients(sampled, cost.get, world_size, balanced=True)
    assert len(per_rank) == world_size
    assert sorted(itertools.chain(*per_rank)) == sampled and all(p == sorted(p) for p in per_rank)
    loads = [sum(cost[c] for c in p) for p in per_rank]
    # longest-processing-time first: the busiest rank is within 4/3 of the ideal
    assert max(loads) <= 4 / 3 * max(sum(loads) / world_size, max(cost.values()))
    assert per_rank == sampling.assign_clients(list(sampled), dict(cost).get, world_size, balanced=True)


def test_rows_stay_in_client_id_order_whatever_the_assignment():
    """The gathered rows are reordered by client id, so the server's sums run in the same
    order for any assignment (world-size invariance)."""
    sampled, per_rank = [1, 2, 4, 7, 8], [[4], [1, 2, 8], [7]]
    rows_per_rank, order = sampling.layout_rows(sampled, 3, per_rank)
    assert rows_per_rank == 3
    # rank 0 rows 0-2 hold [4], rank 1 rows 3-5 hold [1, 2, 8], rank 2 rows 6-8 hold [7]
    assert order == [3, 4, 0, 6, 5]


def test_expected_cost_counts_samples_processed():
    epochs = TrainConfig(local_epochs=3, local_steps=0, batch_size=10)
    steps = TrainConfig(local_epochs=1, local_steps=5, batch_size=10)
    assert sampling.expected_cost(42, epochs) == 126
    assert sampling.expected_cost(42, steps) == 50 and sampling.expected_cost(4, steps) == 20


def test_client_tensors_are_made_on_first_use_only(tmp_path):
    """A rank that may train any client must not hold every client's float tensors."""
    make_mnist(tmp_path)
    cfg = config(tmp_path, name="mnist", num_clients=5, partition="iid")
    fd = build(cfg, seed=0, owned_ids=list(range(5)))
    assert sorted(fd.train) == [0, 1, 2, 3, 4] and 3 in fd.train and 5 not in fd.train
    assert fd.train._made == {}
    first = fd.train[3]
    assert list(fd.train._made) == [3] and fd.train[3] is first
    with pytest.raises(KeyError):
        build(cfg, seed=0, owned_ids=[0]).train[3]
