"""Partitioners: exact cover, non-empty clients, seeded determinism, and the skew each one promises."""

import numpy as np
import pytest

from fedddp.data import partition
from fedddp.errors import ConfigError

NUM_CLASSES = 10


@pytest.fixture
def labels_N():
    """3,000 labels with unequal class sizes (a real data set is never exactly balanced)."""
    weights_C = np.linspace(1, 2, NUM_CLASSES)
    return np.random.default_rng(123).choice(NUM_CLASSES, size=3000, p=weights_C / weights_C.sum())


SPLITTERS = {
    "iid": lambda labels, seed: partition.iid(labels, 20, seed),
    "dirichlet_0.1": lambda labels, seed: partition.dirichlet(labels, 20, 0.1, seed),
    "dirichlet_1": lambda labels, seed: partition.dirichlet(labels, 20, 1.0, seed),
    "shards": lambda labels, seed: partition.shards(labels, 20, 2, seed),
    "classes": lambda labels, seed: partition.classes(labels, 20, 2, seed),
}


@pytest.mark.parametrize("name", SPLITTERS)
def test_every_sample_exactly_once_and_no_client_empty(labels_N, name):
    parts = SPLITTERS[name](labels_N, 0)
    assert len(parts) == 20
    for part in parts:
        assert part.dtype == np.int64
        assert len(part) > 0
        assert np.all(np.diff(part) > 0)  # sorted, no repeats within a client
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels_N)))


@pytest.mark.parametrize("name", SPLITTERS)
def test_seeded(labels_N, name):
    first, again, other = (SPLITTERS[name](labels_N, seed) for seed in (7, 7, 8))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def _mean_tv_distance(labels_N, parts):
    """Mean over clients of the total-variation distance between the client's label distribution
    and the global one: 0 for a perfectly IID split, up to 1 for disjoint labels."""
    global_C = np.bincount(labels_N, minlength=NUM_CLASSES) / len(labels_N)
    tvs = [0.5 * np.abs(np.bincount(labels_N[p], minlength=NUM_CLASSES) / len(p) - global_C).sum() for p in parts]
    return float(np.mean(tvs))


def test_dirichlet_skew_grows_as_alpha_falls(labels_N):
    tv = {alpha: np.mean([_mean_tv_distance(labels_N, partition.dirichlet(labels_N, 20, alpha, seed))
                          for seed in range(3)])
          for alpha in (100.0, 1.0, 0.1)}
    assert tv[100.0] < tv[1.0] < tv[0.1], tv
    assert tv[100.0] < 0.1  # near IID
    assert tv[0.1] > 0.5  # most of each client's mass on few classes
    iid_tv = _mean_tv_distance(labels_N, partition.iid(labels_N, 20, 0))
    assert iid_tv < tv[1.0]


def test_dirichlet_raises_when_clients_cannot_be_filled(labels_N):
    with pytest.raises(ConfigError, match=r"data\.dirichlet_alpha.*data\.num_clients"):
        partition.dirichlet(labels_N, 100, 0.01, seed=0, min_size=25, max_tries=5)


def test_dirichlet_min_size_is_met(labels_N):
    parts = partition.dirichlet(labels_N, 20, 0.3, seed=0, min_size=20)
    assert min(len(p) for p in parts) >= 20


def test_iid_sizes_differ_by_at_most_one(labels_N):
    sizes = [len(p) for p in partition.iid(labels_N, 7, 0)]
    assert max(sizes) - min(sizes) <= 1


def test_shards_give_each_client_at_most_shards_per_client_labels():
    # Balanced classes of 100, 40 shards of 25: no shard straddles two labels.
    labels_N = np.random.default_rng(0).permutation(np.repeat(np.arange(NUM_CLASSES), 100))
    parts = partition.shards(labels_N, 20, 2, seed=3)
    distinct = [len(np.unique(labels_N[p])) for p in parts]
    assert max(distinct) <= 2
    assert all(len(p) == 50 for p in parts)
    # ... and the split is not trivially one label per client: some clients get two.
    assert max(distinct) == 2


def test_too_many_clients_is_a_config_error():
    labels_N = np.zeros(5, dtype=np.int64)
    for split in (lambda: partition.iid(labels_N, 6, 0), lambda: partition.dirichlet(labels_N, 6, 1.0, 0),
                  lambda: partition.shards(labels_N, 3, 2, 0)):
        with pytest.raises(ConfigError, match="data.num_clients"):
            split()
