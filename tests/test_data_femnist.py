"""FEMNIST in LEAF's JSON format: small train/ and test/ files written here as LEAF's preprocess
writes them; writers become clients in file order, the test set is their test samples, errors
are one line with the right exit status, and a short run goes end to end."""

import json
import os

import numpy as np
import pytest
import torch

from fedddp import checks, config
from fedddp.__main__ import main
from fedddp.data import build, leaf
from fedddp.errors import ConfigError, DataError
from fedrun import REPO, metrics, run_fedddp, run_here

CGW_FEMNIST = os.path.join(REPO, "configs", "cgw_femnist.toml")
# (file index, writers with their train and test sample counts); the files are named like LEAF's,
# and index 10 sorts after 2 by number though before it by plain string order.
FILES = [(2, {"f0000_14": (5, 2), "f0001_33": (3, 1)}),
         (10, {"f0002_07": (4, 1)}),
         (0, {"f0003_45": (6, 2), "f0004_11": (2, 1)})]
ORDER = ["f0003_45", "f0004_11", "f0000_14", "f0001_33", "f0002_07"]  # by file number, then users order


def pixels(writer: str, split: str, num: int) -> list[list[float]]:
    """784 floats in [0, 1] per image, first three encoding (writer, split, sample) for tracing."""
    rng = np.random.default_rng(sum(map(ord, writer + split)))
    rows = rng.random((num, 784)).round(4)
    rows[:, 0], rows[:, 1], rows[:, 2] = int(writer[1:5]) / 100, split == "test", np.arange(num) / 100
    return rows.tolist()


def labels(writer: str, split: str, num: int) -> list[int]:
    return [(int(writer[1:5]) * 7 + i * 13 + (split == "test")) % 62 for i in range(num)]


def write_leaf(root, files=FILES):
    for index, writers in files:
        for split, col in (("train", 0), ("test", 1)):
            folder = root / "FEMNIST" / split
            folder.mkdir(parents=True, exist_ok=True)
            blob = {"users": list(writers), "num_samples": [counts[col] for counts in writers.values()],
                    "user_data": {w: {"x": pixels(w, split, counts[col]), "y": labels(w, split, counts[col])}
                                  for w, counts in writers.items()}}
            name = f"all_data_{index}_niid_0_keep_0_{split}_9.json"
            (folder / name).write_text(json.dumps(blob))


def femnist_cfg(root, num_clients=5):
    return checks.load(None, ["data.name=femnist", "data.partition=natural", f"data.root={root}",
                              f"data.num_clients={num_clients}", "run.clients_per_round=1"])


def expected(writer, split):
    counts = {w: c for _, ws in FILES for w, c in ws.items()}[writer]
    num = counts[split == "test"]
    x = torch.tensor(pixels(writer, split, num), dtype=torch.float32).view(num, 1, 28, 28)
    return x, torch.tensor(labels(writer, split, num), dtype=torch.int64)


def test_writers_are_clients_in_file_order_with_their_samples(tmp_path):
    write_leaf(tmp_path)
    fd = build(femnist_cfg(tmp_path), seed=0, owned_ids=[0, 1, 2, 3, 4])
    assert fd.num_classes == 62 and fd.input_shape == (1, 28, 28)
    counts = {w: c for _, ws in FILES for w, c in ws.items()}
    assert fd.num_samples == [counts[w][0] for w in ORDER]
    for k, writer in enumerate(ORDER):
        x, y = expected(writer, "train")
        assert fd.train[k].x.dtype == torch.float32 and torch.equal(fd.train[k].x, x)  # unstandardised
        assert torch.equal(fd.train[k].y, y)
    # The test set: every client writer's test samples, in client order.
    test_x = torch.cat([expected(w, "test")[0] for w in ORDER])
    assert torch.equal(fd.test.x, test_x)
    assert torch.equal(fd.test.y, torch.cat([expected(w, "test")[1] for w in ORDER]))


def test_first_n_writers_and_only_their_test_samples(tmp_path):
    write_leaf(tmp_path)
    fd = build(femnist_cfg(tmp_path, num_clients=3), seed=0, owned_ids=[2])
    assert fd.num_samples == [6, 2, 5] and list(fd.train) == [2]
    assert torch.equal(fd.train[2].x, expected("f0000_14", "train")[0])
    assert torch.equal(fd.test.x, torch.cat([expected(w, "test")[0] for w in ORDER[:3]]))


def test_client_tensors_do_not_depend_on_the_owner(tmp_path):
    write_leaf(tmp_path)
    cfg = femnist_cfg(tmp_path)
    alone, everyone = build(cfg, 0, [3]), build(cfg, 1, list(range(5)))  # the seed plays no part
    assert alone.num_samples == everyone.num_samples
    assert torch.equal(alone.train[3].x, everyone.train[3].x) and torch.equal(alone.train[3].y, everyone.train[3].y)
    assert torch.equal(alone.test.x, everyone.test.x)


def test_more_clients_than_writers_is_a_config_error(tmp_path):
    write_leaf(tmp_path)
    with pytest.raises(ConfigError, match=r"data\.num_clients: 6 clients .* only 5 FEMNIST writers"):
        build(femnist_cfg(tmp_path, num_clients=6), seed=0, owned_ids=[0])


def test_corrupt_and_inconsistent_files_name_the_file(tmp_path):
    write_leaf(tmp_path)
    bad = tmp_path / "FEMNIST" / "train" / "all_data_0_niid_0_keep_0_train_9.json"
    bad.write_text('{"users": ["a"], "user_data": ')
    with pytest.raises(DataError, match="all_data_0_niid_0_keep_0_train_9.json: not a LEAF JSON file"):
        build(femnist_cfg(tmp_path), seed=0, owned_ids=[0])
    bad.write_text(json.dumps({"users": ["a"], "num_samples": [2], "user_data": {"a": {"x": [[0.5] * 784], "y": [1]}}}))
    with pytest.raises(DataError, match="writer a has 1 images, 1 labels and num_samples 2"):
        build(femnist_cfg(tmp_path), seed=0, owned_ids=[0])
    bad.write_text(json.dumps({"users": ["a"], "user_data": {"a": {"x": [[0.5] * 783], "y": [1]}}}))
    with pytest.raises(DataError, match="writer a's images are not rows of 784"):
        build(femnist_cfg(tmp_path), seed=0, owned_ids=[0])
    bad.write_text(json.dumps({"users": ["a"], "user_data": {"a": {"x": [[0.5] * 784], "y": [62]}}}))
    with pytest.raises(DataError, match=r"labels outside \[0, 62\)") as info:
        build(femnist_cfg(tmp_path), seed=0, owned_ids=[0])
    assert "\n" not in str(info.value) and "preprocess.sh" in str(info.value)  # one line, how to get it


def test_empty_split_folder_and_user_split_are_data_errors(tmp_path):
    write_leaf(tmp_path)
    for path in (tmp_path / "FEMNIST" / "test").iterdir():
        path.unlink()
    with pytest.raises(DataError, match=r"FEMNIST/test: no FEMNIST \*\.json files"):
        build(femnist_cfg(tmp_path), seed=0, owned_ids=[0])
    (tmp_path / "FEMNIST" / "test" / "t.json").write_text(json.dumps(
        {"users": ["someone_else"], "user_data": {"someone_else": {"x": [[0.0] * 784], "y": [3]}}}))
    with pytest.raises(DataError, match="none of the 5 client writers has test samples"):
        build(femnist_cfg(tmp_path), seed=0, owned_ids=[0])


@pytest.mark.processes
def test_missing_folder_exits_3_with_one_line(tmp_path):
    missing = run_fedddp([f"data.root={tmp_path}", f"run.out_dir={tmp_path / 'out'}"],
                         config=CGW_FEMNIST, check=False, timeout=120)
    assert missing.returncode == 3, missing.stderr
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and os.path.join(str(tmp_path), "FEMNIST") in lines[0] and "LEAF" in lines[0]


def test_natural_partition_without_natural_clients_exits_2(capsys):
    # In process (main() is what python -m fedddp runs): the error comes before any data or rank.
    assert main(["data.name=mnist", "data.partition=natural"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "data.partition: natural" in lines[0] and "mnist has none" in lines[0]
    assert main(["data.name=femnist", "data.partition=iid"]) == 2
    assert "set data.partition = natural" in capsys.readouterr().err


@pytest.mark.e2e
def test_cgw_on_femnist_end_to_end(tmp_path):
    write_leaf(tmp_path / "data")
    out = tmp_path / "out"
    run_here([f"data.root={tmp_path / 'data'}", f"run.out_dir={out}", "data.num_clients=5", "run.rounds=2",
                "run.clients_per_round=3", "run.ckpt_every=0", "model.name=logistic"], config=CGW_FEMNIST)
    rows = metrics(out)
    assert [r["round"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["test_loss"]) and 0 <= r["test_accuracy"] <= 1 for r in rows)
    assert os.path.exists(out / "final.pt")


def test_leaf_file_order_is_numeric():
    names = ["all_data_10_niid_0_keep_0_train_9.json", "all_data_2_niid_0_keep_0_train_9.json",
             "all_data_0_niid_0_keep_0_train_9.json"]
    assert sorted(names, key=leaf._natural_key) == [names[2], names[1], names[0]]


@pytest.mark.parametrize("split", ["train", "test"])
def test_nan_pixel_is_a_data_error_naming_the_file(tmp_path, split):
    """JSON admits NaN: a LEAF file with one NaN pixel used to train a NaN model to the end with
    exit 0."""
    write_leaf(tmp_path)
    path = tmp_path / "FEMNIST" / split / f"all_data_0_niid_0_keep_0_{split}_9.json"
    blob = json.loads(path.read_text())
    blob["user_data"]["f0004_11"]["x"][0][300] = float("nan")
    path.write_text(json.dumps(blob))  # writes the bare NaN literal, as Python's json does
    with pytest.raises(DataError, match=rf"{path.name}: writer f0004_11's image 0 has non-finite pixels"):
        build(femnist_cfg(tmp_path), seed=0, owned_ids=[0, 1, 2, 3, 4])


def test_float_label_is_refused_not_truncated(tmp_path):
    """Labels were cast with int64, so 3.7 silently became class 3."""
    write_leaf(tmp_path)
    path = tmp_path / "FEMNIST" / "train" / "all_data_0_niid_0_keep_0_train_9.json"
    blob = json.loads(path.read_text())
    blob["user_data"]["f0003_45"]["y"][1] = 3.7
    path.write_text(json.dumps(blob))
    with pytest.raises(DataError, match=rf"{path.name}: writer f0003_45 has a label 3.7 that is not an integer"):
        build(femnist_cfg(tmp_path), seed=0, owned_ids=[0])
    blob["user_data"]["f0003_45"]["y"][1] = 3.0  # an integral float is the class it names
    path.write_text(json.dumps(blob))
    assert build(femnist_cfg(tmp_path), seed=0, owned_ids=[0]).train[0].y[1].item() == 3


@pytest.mark.processes
def test_nan_pixel_exits_3_in_one_line(tmp_path):
    write_leaf(tmp_path / "data")
    path = tmp_path / "data" / "FEMNIST" / "train" / "all_data_2_niid_0_keep_0_train_9.json"
    blob = json.loads(path.read_text())
    blob["user_data"]["f0000_14"]["x"][1][5] = float("inf")
    path.write_text(json.dumps(blob))
    proc = run_fedddp([f"data.root={tmp_path / 'data'}", f"run.out_dir={tmp_path / 'out'}", "run.rounds=1",
                       "data.name=femnist", "data.partition=natural", "data.num_clients=5",
                       "run.clients_per_round=2", "model.name=logistic"], check=False)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and str(path) in proc.stderr, proc.stderr
