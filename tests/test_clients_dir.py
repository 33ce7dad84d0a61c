"""data.name = clients_dir (a population on disk, a client read when it trains): the clients it
builds equal data.name = tensors' of the same arrays, a run from it equals the in-memory run bit
for bit, nothing per client is kept, and each bad folder is one line naming the file."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import fedddp
from fedddp import checks, data
from fedddp.__main__ import main
from fedddp.data import clients_dir
from fedddp.registry import DATA_SETS
from fedrun import assert_same_state, client_rows, final_state, metrics, run_fedddp

N, T, CLIENTS = 150, 40, 7


def arrays(seed: int = 0, x_dtype=np.float32) -> dict:
    """Uneven clients (client_train not sorted), as data.name = tensors takes them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 1, 4, 4)) if x_dtype == np.float32 else rng.integers(0, 256, size=(N, 1, 4, 4))
    return {"x_train": x.astype(x_dtype), "y_train": rng.integers(0, 3, N),
            "x_test": rng.normal(size=(T, 1, 4, 4)).astype(x_dtype), "y_test": rng.integers(0, 3, T),
            "client_train": np.concatenate([np.arange(CLIENTS), rng.integers(0, CLIENTS, N - CLIENTS)])}


def folder_of(tmp_path, source: dict, name: str = "pop") -> str:
    path = str(tmp_path / name)
    clients_dir.write(path, source["x_train"], source["y_train"], source["client_train"], source["x_test"],
                      source["y_test"])
    return path


def build(path: str, *overrides: str, ids=None):
    cfg = checks.load(None, ["data.name=clients_dir", f"data.path={path}", f"data.num_clients={CLIENTS}",
                             *overrides])
    return data.build(cfg, cfg.data.seed, range(CLIENTS) if ids is None else ids)


def test_every_declared_data_set_has_a_builder():
    # importing fedddp.data (above) imports fedddp.data.build, whose builders register
    assert all(callable(fn) for fn in DATA_SETS.values()), [k for k, fn in DATA_SETS.items() if not callable(fn)]


@pytest.mark.parametrize("x_dtype", [np.float32, np.uint8])
def test_clients_equal_the_tensors_file_ones(tmp_path, x_dtype):
    source = arrays(x_dtype=x_dtype)
    np.savez(tmp_path / "d.npz", **source)
    on_disk = build(folder_of(tmp_path, source))
    cfg = checks.load(None, ["data.name=tensors", f"data.path={tmp_path / 'd.npz'}", f"data.num_clients={CLIENTS}",
                             "data.partition=natural"])
    in_memory = data.build(cfg, cfg.data.seed, range(CLIENTS))
    assert on_disk.num_samples == in_memory.num_samples == np.bincount(source["client_train"]).tolist()
    assert (on_disk.num_classes, on_disk.input_shape, on_disk.task) == (3, (1, 4, 4), "classification")
    for k in range(CLIENTS):
        a, b = on_disk.train[k], in_memory.train[k]
        assert a.x.dtype == b.x.dtype == torch.float32 and a.y.dtype == b.y.dtype == torch.int64
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert torch.equal(on_disk.test.x, in_memory.test.x) and torch.equal(on_disk.test.y, in_memory.test.y)


def test_a_client_is_read_when_used_and_not_kept(tmp_path):
    path = folder_of(tmp_path, arrays())
    fed = build(path, ids=range(1, CLIENTS, 2))
    assert isinstance(fed.train.ids, range) and list(fed.train) == [1, 3, 5]
    assert 0 not in fed.train and 3 in fed.train
    first, again = fed.train[3], fed.train[3]
    assert first is not again and torch.equal(first.x, again.x)  # read afresh, the same bits
    assert not fed.train._made
    with pytest.raises(KeyError):
        fed.train[0]


def test_held_out_split_and_regression_targets(tmp_path):
    source = arrays()
    source["y_train"] = source["y_train"].astype(np.float32) * 0.5
    source["y_test"] = source["y_test"].astype(np.float32)
    fed = build(folder_of(tmp_path, source), "data.client_test_fraction=0.25")
    assert fed.task == "regression" and fed.num_classes == 1 and fed.train[0].y.dtype == torch.float32
    counts = np.bincount(source["client_train"])
    assert [a + b for a, b in zip(fed.num_samples, fed.num_held_out)] == counts.tolist()
    assert len(fed.held_out[2]) == fed.num_held_out[2] and not fed.train._made


def test_poisson_sampling_vectorised_is_the_per_client_draw():
    from fedddp import sampling
    for seed, round_idx, num, rate in [(0, 1, 3000, 0.1), (12345, 7, 70000, 0.002), (2 ** 40, 3, 500, 0.5)]:
        one_by_one = [c for c in range(num) if sampling.uniform(sampling._POISSON_STREAM, seed, round_idx, c) < rate]
        assert sampling.sample_poisson(num, rate, seed, round_idx) == one_by_one


RUN_KEYS = [f"data.num_clients={CLIENTS}", "data.seed=0", "model.name=mlp", "run.rounds=3", "run.clients_per_round=4",
            "run.ckpt_every=0", "run.progress=false", "run.eval_every=1"]


def _run(tmp_path, name: str, *data_keys: str):
    return fedddp.run({}, RUN_KEYS + list(data_keys), out_dir=tmp_path / name)


def timeless(rows: list[dict]) -> list[dict]:
    """Rows without wall-clock columns (*_s, *_time), which differ run to run; the simulated
    clock (sim_*) stays."""
    return [{k: v for k, v in r.items() if k.startswith("sim_") or not (k.endswith("_s") or k.endswith("_time"))}
            for r in rows]


@pytest.mark.slow
@pytest.mark.e2e
def test_a_run_from_the_folder_is_the_in_memory_run_bit_for_bit(tmp_path):
    source = arrays()
    np.savez(tmp_path / "d.npz", **source)
    on_disk = _run(tmp_path, "disk", "data.name=clients_dir", f"data.path={folder_of(tmp_path, source)}")
    in_memory = _run(tmp_path, "memory", "data.name=tensors", f"data.path={tmp_path / 'd.npz'}",
                     "data.partition=natural")
    assert timeless(on_disk.metrics) == timeless(in_memory.metrics)
    assert timeless(client_rows(on_disk.out_dir)) == timeless(client_rows(in_memory.out_dir))
    assert len(on_disk.metrics) == 3 and len(client_rows(on_disk.out_dir)) == 12
    assert_same_state(on_disk.state_dict, in_memory.state_dict)
    assert_same_state(final_state(on_disk.out_dir), final_state(in_memory.out_dir))


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_two_ranks_from_the_folder_are_one_rank_in_memory_bit_for_bit(tmp_path):
    """Each rank reads the clients it trains from the same folder, with held-out samples and
    client evaluation: the bits of one rank holding every sample."""
    source = arrays()
    np.savez(tmp_path / "d.npz", **source)
    held = ["data.client_test_fraction=0.2", "run.client_eval_every=1"]
    run_fedddp(RUN_KEYS + held + ["data.name=clients_dir", f"data.path={folder_of(tmp_path, source)}",
                                  f"run.out_dir={tmp_path / 'disk'}"], nproc=2, config=None)
    in_memory = _run(tmp_path, "memory", "data.name=tensors", f"data.path={tmp_path / 'd.npz'}",
                     "data.partition=natural", *held)
    # test_loss aside: the global test set's shards sum in another order on 2 ranks; and the
    # rank that trained a client
    two, one = timeless(metrics(tmp_path / "disk")), timeless(in_memory.metrics)
    assert [r.pop("test_loss") for r in two] == pytest.approx([r.pop("test_loss") for r in one], rel=1e-6)
    assert two == one and any(k.startswith("client_eval_") for k in one[0])
    without_rank = lambda rows: [{k: v for k, v in r.items() if k != "rank"} for r in timeless(rows)]  # noqa: E731
    rows_two = client_rows(tmp_path / "disk")
    assert without_rank(rows_two) == without_rank(client_rows(in_memory.out_dir))
    assert {r["rank"] for r in rows_two} == {0, 1}
    assert_same_state(final_state(tmp_path / "disk"), final_state(in_memory.out_dir))


def _bad_folder(tmp_path, edit) -> str:
    path = folder_of(tmp_path, arrays())
    edit(path)
    return path


def _meta_edit(**changes):
    def edit(path):
        meta_path = os.path.join(path, "meta.json")
        with open(meta_path) as f:
            meta = json.load(f)
        meta.update(changes)
        with open(meta_path, "w") as f:
            json.dump(meta, f)
    return edit


def _save(name, array):
    return lambda path: np.save(os.path.join(path, name), array)


BAD = [  # (id, edit of a good folder, exit status, the file named, words of the line)
    ("no meta", lambda p: os.remove(os.path.join(p, "meta.json")), 3, "meta.json", "no such file"),
    ("meta not json", lambda p: open(os.path.join(p, "meta.json"), "w").write("{"), 3, "meta.json", "not JSON"),
    ("other format", _meta_edit(format="x"), 3, "meta.json", "fedddp-clients-dir"),
    ("bad task", _meta_edit(task="ranking"), 3, "meta.json", "task is 'ranking'"),
    ("other population", _meta_edit(num_clients=CLIENTS + 1), 3, "offsets.npy", f"[{CLIENTS + 2}]"),
    ("empty client", _save("offsets.npy", np.array([0, 5, 5, 20, 40, 60, 90, N])), 3, "offsets.npy",
     "client(s) 1 hold none"),
    ("offsets past x", _save("offsets.npy", np.array([0, 5, 10, 20, 40, 60, 90, N + 1])), 3, "offsets.npy",
     f"ends at row {N + 1}"),
    ("no x", lambda p: os.remove(os.path.join(p, "x.npy")), 3, "x.npy", "no such file"),
    ("x not npy", lambda p: open(os.path.join(p, "x.npy"), "wb").write(b"junk"), 3, "x.npy", "numpy.save"),
    ("x cut", lambda p: os.truncate(os.path.join(p, "x.npy"), 300), 3, "x.npy", "shorter than"),
    ("y short", _save("y.npy", np.zeros(N - 1, dtype=np.int64)), 3, "y.npy", f"must be [{N}]"),
    ("labels out of range", _save("y.npy", np.full(N, 3)), 3, "y.npy", "outside [0, 3)"),
    ("float labels", _save("y.npy", np.zeros(N, dtype=np.float32)), 3, "y.npy", "integer class labels"),
    ("nan samples", _save("x.npy", np.full((N, 1, 4, 4), np.nan, dtype=np.float32)), 3, "x.npy", "non-finite"),
    ("test shape", _save("x_test.npy", np.zeros((T, 1, 4, 5), dtype=np.float32)), 3, "x_test.npy",
     "they must match"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_a_bad_folder_is_one_line_naming_the_file(tmp_path, capsys, case):
    _, edit, status, name, words = case
    path = _bad_folder(tmp_path, edit)
    got = main(["--check", "data.name=clients_dir", f"data.path={path}", f"data.num_clients={CLIENTS}",
                "model.name=mlp", f"run.out_dir={tmp_path / 'out'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert got == status and len(lines) == 1, (got, lines)
    assert os.path.join(path, name) in lines[0] and words in lines[0], lines[0]


@pytest.mark.parametrize("overrides, words", [
    ([f"data.num_clients={CLIENTS + 1}"], "data.num_clients: the folder of"),
    (["data.holdout_from_test=0.2"], "data.holdout_from_test: a clients_dir folder brings its own test set"),
])
def test_a_config_that_does_not_fit_the_folder_is_one_line(tmp_path, capsys, overrides, words):
    path = folder_of(tmp_path, arrays())
    got = main(["--check", "data.name=clients_dir", f"data.path={path}", f"data.num_clients={CLIENTS}",
                "model.name=mlp", f"run.out_dir={tmp_path / 'out'}", *overrides])
    lines = capsys.readouterr().err.strip().splitlines()
    assert got == 2 and len(lines) == 1 and words in lines[0], (got, lines)


def test_a_missing_folder_is_one_line(tmp_path, capsys):
    got = main(["--check", "data.name=clients_dir", f"data.path={tmp_path / 'nowhere'}", "model.name=mlp",
                f"run.out_dir={tmp_path / 'out'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert got == 3 and len(lines) == 1 and "is not a folder" in lines[0], lines
