"""Partitioners: a label array -> one sorted int64 index array per client.

Pure and seeded: the same (labels, arguments, seed) give the same split on every rank, so each
rank computes every client's sample count from the labels alone and loads only its own clients.
Every sample goes to exactly one client and no client is empty.

Legend: N samples, K clients, C classes.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError


def _check_enough(num_samples: int, num_parts: int, what: str) -> None:
    if num_parts > num_samples:
        raise ConfigError(f"data.num_clients: {what} needs {num_parts} non-empty parts but there are only "
                          f"{num_samples} training samples; lower data.num_clients")


def _groups(owner_N: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Client of each sample -> the sorted sample indices of each client."""
    order_N = np.argsort(owner_N, kind="stable").astype(np.int64)  # stable: indices stay sorted
    counts_K = np.bincount(owner_N, minlength=num_clients)
    return np.split(order_N, np.cumsum(counts_K)[:-1])


def iid(labels_N: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """A random permutation cut into K parts whose sizes differ by at most one."""
    _check_enough(len(labels_N), num_clients, "the iid partition")
    perm_N = np.random.default_rng(seed).permutation(len(labels_N))
    return [np.sort(part).astype(np.int64) for part in np.array_split(perm_N, num_clients)]


def dirichlet(labels_N: np.ndarray, num_clients: int, alpha: float, seed: int, min_size: int = 1,
              max_tries: int = 100) -> list[np.ndarray]:
    """Label skew (Hsu et al. 2019): for each class, the shares of the K clients are drawn from
    Dir(alpha, ..., alpha) and that class's samples (shuffled) are cut at those shares. Small
    alpha gives clients few classes. The whole split is redrawn (from the same generator, at most
    ``max_tries`` times) until every client holds at least ``min_size`` samples."""
    _check_enough(len(labels_N), num_clients * min_size, f"the dirichlet partition (min_size {min_size})")
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(labels_N == c) for c in np.unique(labels_N)]
    owner_N = np.empty(len(labels_N), dtype=np.int64)
    for _ in range(max_tries):
        for idx_c in by_class:
            share_K = rng.dirichlet(np.full(num_clients, alpha))
            cuts_Km1 = (np.cumsum(share_K)[:-1] * len(idx_c)).astype(np.int64)
            # Position j of the shuffled class goes to the client whose share interval holds j.
            owner_N[rng.permutation(idx_c)] = np.searchsorted(cuts_Km1, np.arange(len(idx_c)), side="right")
        if np.bincount(owner_N, minlength=num_clients).min() >= min_size:
            return _groups(owner_N, num_clients)
    raise ConfigError(f"data.dirichlet_alpha: in {max_tries} seeded draws with alpha = {alpha} some client "
                      f"always had fewer than {min_size} sample(s) ({len(labels_N)} samples, "
                      f"data.num_clients = {num_clients}); raise data.dirichlet_alpha or lower data.num_clients")


def shards(labels_N: np.ndarray, num_clients: int, shards_per_client: int, seed: int) -> list[np.ndarray]:
    """McMahan et al. 2017: sort by label (random order within a label), cut into
    K * shards_per_client equal shards, give each client shards_per_client random shards. A shard
    that straddles a class boundary holds two labels, so a client has at most shards_per_client
    labels only when class sizes are multiples of the shard size."""
    if shards_per_client < 1:
        raise ConfigError(f"data.shards_per_client: must be >= 1, got {shards_per_client}")
    num_shards = num_clients * shards_per_client
    _check_enough(len(labels_N), num_shards, f"the shards partition ({shards_per_client} shards per client)")
    rng = np.random.default_rng(seed)
    perm_N = rng.permutation(len(labels_N))
    by_label_N = perm_N[np.argsort(labels_N[perm_N], kind="stable")]
    shard_list = np.array_split(by_label_N, num_shards)
    shard_ids_KS = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([shard_list[s] for s in row])).astype(np.int64) for row in shard_ids_KS]


def classes(labels_N: np.ndarray, num_clients: int, classes_per_client: int, seed: int) -> list[np.ndarray]:
    """Each client holds exactly ``classes_per_client`` classes and about equal numbers of their
    samples (FedGMA's non-IID colored MNIST: "exactly two digits" per client, which ``shards``
    does not guarantee when class sizes are not multiples of the shard size). The K * s class slots
    are spread as evenly as possible over the classes; each client takes the s classes with the
    most slots left (ties broken at random), which always leaves s distinct classes for the rest;
    the clients holding a class split its shuffled samples into near-equal parts. Client sizes
    are about equal when K * s is a multiple of the number of classes; otherwise a class held by
    one client fewer gives its holders bigger parts (up to about twice as big)."""
    class_ids_C = np.unique(labels_N)
    num_classes, s = len(class_ids_C), classes_per_client
    if not 1 <= s <= num_classes:
        raise ConfigError(f"data.shards_per_client: partition = classes gives each client {s} classes but the "
                          f"data have {num_classes}; use 1 to {num_classes}")
    if num_clients * s < num_classes:
        raise ConfigError(f"data.num_clients: {num_clients} clients x {s} classes leave some of the {num_classes} "
                          f"classes unused; raise data.num_clients or data.shards_per_client")
    rng = np.random.default_rng(seed)
    slots_C = np.full(num_classes, num_clients * s // num_classes)
    slots_C[rng.permutation(num_classes)[:num_clients * s % num_classes]] += 1
    holders_C: list[list[int]] = [[] for _ in range(num_classes)]
    for k in range(num_clients):
        for c in np.lexsort((rng.random(num_classes), -slots_C))[:s]:  # most slots left first
            slots_C[c] -= 1
            holders_C[c].append(k)
    owner_N = np.empty(len(labels_N), dtype=np.int64)
    for c, holders in enumerate(holders_C):
        idx_c = rng.permutation(np.flatnonzero(labels_N == class_ids_C[c]))
        _check_enough(len(idx_c), len(holders), f"the classes partition (class {class_ids_C[c]})")
        for k, part in zip(holders, np.array_split(idx_c, len(holders))):
            owner_N[part] = k
    return _groups(owner_N, num_clients)


_HOLDOUT_STREAM = 0x484F_4C44  # domain tag of the holdout permutation's generator


def holdout_split(split, fraction: float, seed: int):
    """(images, labels) -> (train, test): a seeded permutation sends round(fraction * N) samples to
    test and the rest to train; both keep the file order (sorted indices)."""
    images, labels_N = split
    perm_N = np.random.default_rng([_HOLDOUT_STREAM, seed]).permutation(len(labels_N))
    num_test = round(fraction * len(labels_N))
    test_idx, train_idx = np.sort(perm_N[:num_test]), np.sort(perm_N[num_test:])
    if len(train_idx) == 0 or len(test_idx) == 0:
        raise ConfigError(f"data.holdout_from_test: {fraction} of {len(labels_N)} samples leaves an empty "
                          "train or test set; use a value such as 0.2")
    return (images[train_idx], labels_N[train_idx]), (images[test_idx], labels_N[test_idx])


def split(labels_N: np.ndarray, data, seed: int) -> list[np.ndarray]:
    """The sample indices of each client, by ``data.partition`` (a DataConfig)."""
    if data.partition == "iid":
        return iid(labels_N, data.num_clients, seed)
    if data.partition == "dirichlet":
        return dirichlet(labels_N, data.num_clients, data.dirichlet_alpha, seed)
    if data.partition == "shards":
        return shards(labels_N, data.num_clients, data.shards_per_client, seed)
    if data.partition == "classes":
        return classes(labels_N, data.num_clients, data.shards_per_client, seed)
    if data.partition == "natural":
        raise ConfigError(f"data.partition: {data.name} has no natural clients (femnist has: its writers); "
                          "use iid, dirichlet, shards or classes")
    raise ConfigError(f"data.partition: unknown {data.partition!r} (valid: iid, dirichlet, shards, classes, natural)")
