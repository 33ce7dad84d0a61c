"""data.name = tensors (an .npz or .pt file of arrays) and data callables: what they build, every
partitioner and the holdout split on them, and each bad input as one line with its exit status."""

import os

import numpy as np
import pytest
import torch

from fedddp import checks, config, data
from fedddp.__main__ import main

N, T, CLIENTS = 120, 40, 6


def arrays(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x_train": rng.normal(size=(N, 2, 3)).astype(np.float32), "y_train": rng.integers(0, 3, N),
            "x_test": rng.normal(size=(T, 2, 3)).astype(np.float32), "y_test": rng.integers(0, 3, T),
            "client_train": np.arange(N) % CLIENTS}


def save(path, mapping) -> str:
    """The mapping as an .npz (numpy arrays) or .pt (torch tensors and plain values)."""
    if str(path).endswith(".npz"):
        np.savez(path, **mapping)
    else:  # a torch file holds no text tensors: text as str, or a list of them
        torch.save({k: v if not isinstance(v, np.ndarray) else torch.from_numpy(v) if v.dtype.kind != "U" else
                    v.tolist() for k, v in mapping.items()}, path)
    return str(path)


def build(path: str, *overrides: str):
    cfg = checks.load(None, ["data.name=tensors", f"data.path={path}", f"data.num_clients={CLIENTS}",
                             *overrides])
    return data.build(cfg, cfg.data.seed, list(range(CLIENTS)))


@pytest.mark.parametrize("suffix", [".npz", ".pt"])
def test_natural_clients_from_a_file(tmp_path, suffix):
    source = arrays()
    fed = build(save(tmp_path / f"d{suffix}", source), "data.partition=natural")
    assert fed.task == "classification" and fed.num_classes == 3 and fed.input_shape == (2, 3)
    assert fed.num_samples == [N // CLIENTS] * CLIENTS
    for k in range(CLIENTS):
        mine = source["client_train"] == k
        assert torch.equal(fed.train[k].x, torch.from_numpy(source["x_train"][mine]))
        assert torch.equal(fed.train[k].y, torch.from_numpy(source["y_train"][mine]))
        assert fed.train[k].y.dtype == torch.int64
    assert torch.equal(fed.test.x, torch.from_numpy(source["x_test"]))


def test_npz_and_pt_build_the_same_clients(tmp_path):
    a = build(save(tmp_path / "d.npz", arrays()), "data.partition=dirichlet")
    b = build(save(tmp_path / "d.pt", arrays()), "data.partition=dirichlet")
    assert a.num_samples == b.num_samples
    for k in range(CLIENTS):
        assert torch.equal(a.train[k].x, b.train[k].x) and torch.equal(a.train[k].y, b.train[k].y)


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "shards", "classes"])
@pytest.mark.parametrize("holdout", [0.0, 0.25])
def test_every_partitioner_and_the_holdout_split_work_on_it(tmp_path, partition, holdout):
    fed = build(save(tmp_path / "d.npz", arrays()), f"data.partition={partition}",
                f"data.holdout_from_test={holdout}")
    train_total = N if holdout == 0 else T - round(holdout * T)
    assert sum(fed.num_samples) == train_total and min(fed.num_samples) > 0
    assert len(fed.test) == (T if holdout == 0 else round(holdout * T))
    if partition == "classes":  # shards_per_client = 2 classes each
        assert all(len(fed.train[k].y.unique()) == 2 for k in range(CLIENTS))


def test_regression_from_float_targets(tmp_path):
    source = arrays()
    source["y_train"], source["y_test"] = source["y_train"] * 0.5, source["y_test"] * 0.5
    fed = build(save(tmp_path / "r.pt", source), "data.partition=iid")
    assert fed.task == "regression" and fed.num_classes == 1 and fed.train[0].y.dtype == torch.float32


def test_a_data_callable_gets_root_and_data_seed(tmp_path, monkeypatch):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = checks.load(None, ["data.name=examples.my_plugin:blobs", "data.num_clients=12", "data.partition=natural",
                             "data.seed=3", f"data.root={tmp_path}"])
    fed = data.build(cfg, cfg.data.seed, [0, 5])
    from examples.my_plugin import blobs

    source = blobs(str(tmp_path), 3)
    assert torch.equal(fed.train[5].x, torch.from_numpy(source["x_train"][source["client_train"] == 5]))
    assert sorted(fed.train) == [0, 5] and sum(fed.num_samples) == len(source["y_train"])


def bad(mapping_edit):
    source = arrays()
    mapping_edit(source)
    return source


# (what is wrong, the edit, the overrides, exit status, words of the one line)
BAD = [
    ("a key missing", lambda m: m.pop("y_test"), [], 3, "has no y_test"),
    ("an unknown key", lambda m: m.update(labels=m["y_train"]), [], 3, "unknown key(s) labels"),
    ("labels shorter than samples", lambda m: m.update(y_train=m["y_train"][:-1]), [], 3,
     "y_train must be [120] (one per x_train sample), got shape [119]"),
    ("features that differ", lambda m: m.update(x_test=m["x_test"][:, :1]), [], 3,
     "x_train samples have shape [2, 3] but x_test samples [1, 3]"),
    ("text features", lambda m: m.update(x_train=m["x_train"].astype(str)), [], 3, "x_train "),
    ("a NaN feature", lambda m: m["x_test"].__setitem__((0, 0, 0), np.nan), [], 3,
     "x_test has 1 non-finite value(s)"),
    ("a negative label", lambda m: m["y_train"].__setitem__(4, -1), [], 3,
     "y_train has labels in [-1, 2], outside [0, 3)"),
    ("a label past num_classes", lambda m: m.update(num_classes=np.array(2)), [], 3,
     "outside [0, 2) (num_classes = 2)"),
    ("float labels for classification", lambda m: m.update(task=np.array("classification"),
                                                           y_train=m["y_train"] * 1.0), [], 3,
     "y_train must be integer class labels"),
    ("an infinite target", lambda m: m.update(y_train=np.where(np.arange(N) == 3, np.inf, 1.0),
                                              y_test=np.ones(T)), ["data.partition=iid"], 3,
     "y_train has 1 non-finite target(s)"),
    ("an unknown task", lambda m: m.update(task=np.array("ranking")), [], 3, "task is 'ranking'"),
    ("client ids of another length", lambda m: m.update(client_train=m["client_train"][:10]),
     ["data.partition=natural"], 3, "client_train must be [120] integer client ids"),
    ("a client without samples", lambda m: m.update(client_train=np.where(m["client_train"] == 2, 1,
                                                                          m["client_train"])),
     ["data.partition=natural"], 3, "client_train names no sample for client(s) 2"),
    ("more clients than data.num_clients", lambda m: m.update(client_train=np.arange(N) % 8),
     ["data.partition=natural"], 2, "data.num_clients: ", "set data.num_clients = 8"),
    ("natural without client ids", lambda m: m.pop("client_train"), ["data.partition=natural"], 2,
     "data.partition: natural needs", "no client_train"),
    ("a label split of regression targets", lambda m: m.update(y_train=m["y_train"] * 1.0, y_test=m["y_test"] * 1.0),
     ["data.partition=dirichlet"], 2, "data.partition: dirichlet splits by class label", "use iid"),
]


@pytest.mark.parametrize("suffix", [".npz", ".pt"])
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_a_bad_file_is_one_line(tmp_path, capsys, case, suffix):
    _, edit, overrides, status, *words = case
    path = save(tmp_path / f"d{suffix}", bad(edit))
    got = main(["--check", "data.name=tensors", f"data.path={path}", f"data.num_clients={CLIENTS}",
                f"run.out_dir={tmp_path / 'out'}", *overrides])
    lines = capsys.readouterr().err.strip().splitlines()
    assert got == status and len(lines) == 1, (got, lines)
    assert f"data.path: {path}" in lines[0] or words[0].startswith("data."), lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    if case[0] == "text features":  # a .pt file holds the text as a list
        assert ("must hold numbers, got dtype <U" if suffix == ".npz" else
                "x_train is a list; give a numpy array or a torch tensor") in lines[0], lines[0]


@pytest.mark.parametrize("content, status, words", [
    (None, 3, ("data.path", "no such file")),
    (b"not an archive", 3, ("data.path", "cannot read it as a file written by")),
])
@pytest.mark.parametrize("suffix", [".npz", ".pt"])
def test_a_missing_or_unreadable_file_is_one_line(tmp_path, capsys, content, status, words, suffix):
    path = tmp_path / f"d{suffix}"
    if content is not None:
        path.write_bytes(content)
    got = main(["--check", "data.name=tensors", f"data.path={path}", f"run.out_dir={tmp_path / 'out'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert got == status and len(lines) == 1, (got, lines)
    assert all(w in lines[0] for w in words), lines[0]


def test_data_path_must_name_an_npz_or_pt_file(capsys, tmp_path):
    got = main(["--check", "data.name=tensors", "data.path=d.csv", f"run.out_dir={tmp_path}"])
    line = capsys.readouterr().err.strip()
    assert got == 2 and "data.path: data.name = tensors reads its arrays from an .npz" in line and "d.csv" in line


def test_all_finite_answers_as_isfinite_does():
    """The sum's shortcut says "finite" only when every value is; finite values whose sum
    overflows are settled value by value."""
    from fedddp.data.tensors import all_finite

    big = np.full(4, np.finfo(np.float32).max, dtype=np.float32)
    with np.errstate(over="ignore"):
        assert not np.isfinite(big.sum())
    assert all_finite(big)  # the sum overflows, the values are finite
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones((3, 5), dtype=np.float32)
        x[2, 4] = bad
        assert not all_finite(x)
    pair = np.array([np.inf, -np.inf], dtype=np.float32)  # a NaN sum of two infinities
    assert not all_finite(pair)
    assert all_finite(np.zeros(0, dtype=np.float32)) and all_finite(np.ones((2, 3), dtype=np.float32))


def test_consecutive_natural_clients_are_views_of_the_arrays_and_others_copies(tmp_path):
    """Clients whose samples are consecutive rows (arrays ordered by client, as pfl's CIFAR10
    users) share the training arrays' memory: a client made costs no copy; interleaved clients
    get their rows copied. Both hold the same values as indexing by the client's ids."""
    source = arrays()
    ordered = dict(source, client_train=np.repeat(np.arange(CLIENTS), N // CLIENTS))
    for mapping, shared in ((ordered, True), (source, False)):
        fed = data.tensors.build(mapping, "test", config.DataConfig(name="tensors", partition="natural",
                                                                   num_clients=CLIENTS), 0, list(range(CLIENTS)))
        for k in range(CLIENTS):
            mine = mapping["client_train"] == k
            assert torch.equal(fed.train[k].x, torch.from_numpy(mapping["x_train"][mine]))
            assert torch.equal(fed.train[k].y, torch.from_numpy(mapping["y_train"][mine]))
            assert np.shares_memory(fed.train[k].x.numpy(), mapping["x_train"]) == shared
