"""The files people watch: metrics.csv holds metrics.jsonl's numbers, clients.jsonl one row per
reporting client with the rule's per-client diagnostics, tensorboard/ the same numbers as
events; all three follow a resume exactly as metrics.jsonl does."""

from __future__ import annotations

import csv
import errno
import math
import os
import sys

import pytest
import torch

from fedddp import logs
from fedddp.__main__ import main as fedddp_main
from fedrun import QUICKSTART, client_rows, make_mnist_like, metrics, run_fedddp

# CGW on the quickstart, with dropouts (rounds 1 and 2 lose clients: 10, 15, 18 and 0, 26)
CGW = [QUICKSTART, "algorithm.name=cgw", "run.rounds=3", "run.clients_per_round=5", "run.eval_every=2",
       "run.ckpt_every=2", "run.dropout=0.3", "run.progress=false"]
TIMINGS = {"time_s", "train_s", "train_imbalance_s", "communicate_s", "aggregate_s", "evaluate_s",
           "checkpoint_s", "train_time_s"}


def csv_rows(out) -> list[dict]:
    with open(os.path.join(out, "metrics.csv"), newline="") as fh:
        return list(csv.DictReader(fh))


def without(rows: list[dict], keys) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in keys} for row in rows]


def assert_csv_is_jsonl(out) -> None:
    lines, rows = metrics(out), csv_rows(out)
    assert len(rows) == len(lines)
    for line, row in zip(lines, rows):
        scalars = {k: v for k, v in line.items() if not isinstance(v, list)}
        assert list(row) == list(scalars)  # same keys, same order; clients and dropped left out
        for key, value in scalars.items():
            assert row[key] == ("" if value is None else str(value)), (key, row[key], value)
            assert value is None or float(row[key]) == value


def tensorboard_scalars(out) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(os.path.join(out, "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def assert_tensorboard_is_jsonl(out) -> None:
    scalars = tensorboard_scalars(out)
    expected: dict[str, list] = {}
    for line in metrics(out):
        for key, value in line.items():
            if key != "round" and isinstance(value, (int, float)):
                expected.setdefault(key, []).append((line["round"], value))
    assert scalars.keys() == expected.keys()
    for key, points in expected.items():
        # event files hold float32
        assert scalars[key] == [(step, float(torch.tensor(v, dtype=torch.float32))) for step, v in points], key


@pytest.fixture(scope="module")
def cgw_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cgw")
    assert fedddp_main(CGW + [f"run.out_dir={out}"]) == 0
    return out


@pytest.mark.e2e
def test_cgw_csv_holds_the_numbers_of_metrics_jsonl(cgw_run):
    assert_csv_is_jsonl(cgw_run)
    header = list(csv_rows(cgw_run)[0])
    assert "cgw_c" in header and "clients" not in header and "cgw_x" not in header
    assert "cgw_x" not in metrics(cgw_run)[0]  # per-client diagnostics are not in metrics.jsonl


def test_cgw_clients_rows_and_corrective_weights(cgw_run):
    lines, rows = metrics(cgw_run), client_rows(cgw_run)
    assert len(rows) == sum(line["num_reports"] for line in lines) == 10
    for line in lines:
        mine = [row for row in rows if row["round"] == line["round"]]
        # the reporting clients, in client-id order; dropped clients have no row
        assert [row["client"] for row in mine] == sorted(set(line["clients"]) - set(line["dropped"]))
        assert all(row["num_steps"] > 0 and row["num_samples"] > 0 and row["rank"] == 0 for row in mine)
        # p_k: CGW weighs by samples, and the round's train loss is the p-weighted client loss
        total = sum(row["num_samples"] for row in mine)
        for row in mine:
            assert row["cgw_weight"] == pytest.approx(row["num_samples"] / total, rel=1e-6)
        assert line["train_loss"] == pytest.approx(sum(r["cgw_weight"] * r["train_loss"] for r in mine), rel=1e-6)
        # eq. 24: sum_k (x_k ||D_k||)^2 = c^2
        assert sum((r["cgw_x"] * r["cgw_grad_norm"]) ** 2 for r in mine) == pytest.approx(line["cgw_c"] ** 2,
                                                                                          rel=1e-9)


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_two_ranks_write_the_same_clients_rows(cgw_run, tmp_path):
    out = tmp_path / "two"
    run_fedddp(CGW[1:] + [f"run.out_dir={out}"], nproc=2)
    rows = client_rows(out)
    assert without(rows, {"train_time_s", "rank"}) == without(client_rows(cgw_run), {"train_time_s", "rank"})
    assert {row["rank"] for row in rows} == {0, 1}
    # the test loss is all-reduced from per-rank float64 sums: its last digits may differ
    assert without(csv_rows(out), TIMINGS | {"test_loss"}) == without(csv_rows(cgw_run), TIMINGS | {"test_loss"})


@pytest.mark.e2e
def test_feder_clients_rows_hold_layer_weights(tmp_path):
    root = tmp_path / "data"
    make_mnist_like(str(root), num=300)
    out = tmp_path / "feder"
    args = [QUICKSTART, "algorithm.name=feder", "data.name=mnist", f"data.root={root}", "data.holdout_from_test=0.2",
            "data.num_clients=4", "model.name=cnn", "run.rounds=2", "run.clients_per_round=3", "train.local_steps=2",
            "train.batch_size=16", "run.eval_every=2", "run.ckpt_every=0", "run.progress=false",
            f"run.out_dir={out}"]
    assert fedddp_main(args) == 0
    assert_csv_is_jsonl(out)
    rows = client_rows(out)
    assert [(r["round"], r["num_steps"]) for r in rows] == [(1, 2)] * 3 + [(2, 2)] * 3
    for round_idx in (1, 2):
        alpha_KL = torch.tensor([r["feder_alpha"] for r in rows if r["round"] == round_idx])
        assert alpha_KL.shape == (3, 2)  # the CNN's two conv layers
        torch.testing.assert_close(alpha_KL.sum(0), torch.ones(2, dtype=alpha_KL.dtype))


@pytest.mark.e2e
def test_resume_cuts_every_file_back_to_the_checkpoint(tmp_path):
    """A run past its last checkpoint (round 3 after the checkpoint of round 2), killed in the
    middle of a write (a last line cut short), then resumed: the lines of round 3 are dropped
    and written again, as in an uninterrupted run; a stopped run resumes to the same files."""
    pytest.importorskip("tensorboard")
    full, crashed, stopped = tmp_path / "full", tmp_path / "crashed", tmp_path / "stopped"
    assert fedddp_main(CGW + ["run.tensorboard=true", f"run.out_dir={full}"]) == 0
    assert fedddp_main(CGW + ["run.tensorboard=true", f"run.out_dir={crashed}"]) == 0
    (crashed / "final.pt").unlink()
    for name, cut in (("clients.jsonl", '{"round": 4, "cli'), ("metrics.csv", "4,0.1"), ("metrics.jsonl", '{"ro')):
        with open(crashed / name, "a") as fh:
            fh.write(cut)
    assert fedddp_main(CGW + ["run.tensorboard=true", "run.resume=true", f"run.out_dir={crashed}"]) == 0
    assert fedddp_main(CGW + ["run.stop_after=2", f"run.out_dir={stopped}"]) == 0
    assert [r["round"] for r in csv_rows(stopped)] == ["1", "2"]
    assert fedddp_main(CGW + ["run.resume=true", f"run.out_dir={stopped}"]) == 0
    for out in (crashed, stopped):
        assert without(csv_rows(out), TIMINGS) == without(csv_rows(full), TIMINGS)
        assert without(client_rows(out), TIMINGS) == without(client_rows(full), TIMINGS)
        assert without(metrics(out), TIMINGS) == without(metrics(full), TIMINGS)
        assert_csv_is_jsonl(out)
    # TensorBoard's purge drops the first run's round 3; the resumed run's values are the file's
    assert_tensorboard_is_jsonl(crashed)
    assert [step for step, _ in tensorboard_scalars(crashed)["time_s"]] == [1, 2, 3]
    assert not (stopped / "tensorboard").exists()


@pytest.mark.e2e
def test_tensorboard_events_hold_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "tb"
    assert fedddp_main(CGW + ["run.tensorboard=true", f"run.out_dir={out}"]) == 0
    assert_tensorboard_is_jsonl(out)
    assert {"train_loss", "test_accuracy", "aggregate_s", "cgw_c"} <= tensorboard_scalars(out).keys()


@pytest.mark.e2e
def test_tensorboard_without_the_extra_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    capsys.readouterr()
    assert fedddp_main(CGW + ["run.tensorboard=true", f"run.out_dir={tmp_path / 'o'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedddp: error: run.tensorboard:"), err
    assert "pip install 'fedddp[tensorboard]'" in err[0]
    # the launchers' check before any rank starts says the same
    assert fedddp_main(["--check"] + CGW + ["run.tensorboard=true", f"run.out_dir={tmp_path / 'o'}"]) == 2
    assert capsys.readouterr().err.strip() == err[0]


@pytest.mark.parametrize("name", ["metrics.csv", "clients.jsonl"])
@pytest.mark.e2e
def test_full_disk_while_writing_a_log_is_one_line(tmp_path, capsys, monkeypatch, name):
    out = tmp_path / "o"

    def opening_on_a_full_disk(path, mode="r", *args, **kwargs):
        if str(path).endswith(name) and mode == "a":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(logs, "open", opening_on_a_full_disk, raising=False)
    capsys.readouterr()
    assert fedddp_main(CGW + [f"run.out_dir={out}"]) == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"while writing {name} in {out}" in err[0], err


def test_csv_columns_stay_the_same_when_diagnostics_appear_late(tmp_path):
    """A round without reports has no rule diagnostics: the column that appears with the first
    report is added to every row (empty before), and nulls are empty cells."""
    run_logs = logs.RunLogs(str(tmp_path), 1, tensorboard=False)
    base = {"train_loss": None, "test_loss": 0.5, "clients": [3], "num_reports": 0, "dropped": [3]}
    run_logs.write_round({"round": 1} | base, {}, {}, [], {}, None)
    stacks = {"num_samples_K": torch.tensor([7.0]), "num_steps_K": torch.tensor([2.0]),
              "train_loss_K": torch.tensor([0.25]), "train_time_K": torch.tensor([0.1])}
    line = run_logs.write_round({"round": 2} | base | {"train_loss": 0.25, "num_reports": 1, "dropped": []},
                                {"rule_c": torch.tensor(math.inf), "rule_x_K": torch.tensor([2.0])},
                                stacks, [3], {3: 0}, None)
    assert line["rule_c"] is None and "rule_x_K" not in line and "rule_x" not in line
    assert (tmp_path / "metrics.csv").read_text().splitlines() == [
        "round,train_loss,test_loss,num_reports,rule_c", "1,,0.5,0,", "2,0.25,0.5,1,"]
    assert client_rows(tmp_path) == [{"round": 2, "client": 3, "rank": 0, "num_samples": 7, "num_steps": 2,
                                      "train_loss": 0.25, "train_time_s": pytest.approx(0.1), "rule_x": 2.0}]
