"""Client (federated) evaluation (fedddp/client_eval.py): held-out splits, cohorts, the rows it
writes, a slow twin of its numbers, personalization leaving training alone, side by side, world
sizes and resume."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedddp import checks, client_eval, tasks
from fedddp.__main__ import main as fedddp_main
from fedddp.algorithms import build_model
from fedddp.data import build
from fedddp.data.clients import held_out_count, held_out_positions
from fedddp.sampling import eval_cohort
from fedrun import QUICKSTART, assert_same_state, final_state, metrics, run_fedddp_each, run_here

TIMINGS = {"time_s", "train_s", "train_imbalance_s", "communicate_s", "aggregate_s", "evaluate_s", "checkpoint_s",
           "client_eval_s"}
BASE = ["run.rounds=4", "run.eval_every=2", "run.ckpt_every=0"]
ON = ["data.client_test_fraction=0.2", "run.client_eval_every=2", "run.client_eval_clients=12"]


def eval_rows(out) -> list[dict]:
    with open(os.path.join(out, "client_eval.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def without(rows: list[dict], keys) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in keys} for row in rows]


def client_keys(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith("client_eval_") and k not in TIMINGS}


def _run(tmp_path_factory, name: str, args: list[str]) -> str:
    out = str(tmp_path_factory.mktemp(name))
    run_here(BASE + args + [f"run.out_dir={out}"])
    return out


@pytest.fixture(scope="module")
def k0_run(tmp_path_factory):
    return _run(tmp_path_factory, "k0", ON)


@pytest.fixture(scope="module")
def k3_run(tmp_path_factory):
    return _run(tmp_path_factory, "k3", ON + ["run.client_eval_steps=3"])


@pytest.fixture(scope="module")
def k3_side_run(tmp_path_factory):
    return _run(tmp_path_factory, "k3side", ON + ["run.client_eval_steps=3", "run.parallel_clients=3"])


# -- held-out split and cohort: pure functions of the seeds ------------------------------------

def _cfg(*overrides):
    return checks.load(QUICKSTART, list(overrides))


def test_held_out_split_is_disjoint_seeded_and_the_same_on_any_rank():
    whole = build(_cfg(), 0, list(range(30)))
    split = build(_cfg("data.client_test_fraction=0.25"), 0, list(range(30)))
    one_rank = build(_cfg("data.client_test_fraction=0.25"), 0, [1, 3, 5])
    assert split.num_held_out == [held_out_count(n, 0.25) for n in whole.num_samples]
    assert split.num_samples == [n - m for n, m in zip(whole.num_samples, split.num_held_out)]
    assert all(0 < m < n for n, m in zip(whole.num_samples, split.num_held_out) if n > 2)
    for c in (1, 3, 5):
        train_pos, held_pos = held_out_positions(whole.num_samples[c], 0.25, 0, c)
        assert sorted(train_pos.tolist() + held_pos.tolist()) == list(range(whole.num_samples[c]))
        assert torch.equal(split.train[c].x, whole.train[c].x[train_pos])  # training order kept
        assert torch.equal(split.held_out[c].y, whole.train[c].y[held_pos])
        assert torch.equal(one_rank.train[c].x, split.train[c].x)  # whichever rank builds it
        assert torch.equal(one_rank.held_out[c].x, split.held_out[c].x)
    other_seed = build(_cfg("data.client_test_fraction=0.25", "data.seed=1"), 1, [1])
    assert other_seed.held_out is not None and whole.held_out is None and whole.num_held_out == []


def test_held_out_counts_round_and_keep_a_training_sample():
    assert [held_out_count(n, 0.2) for n in (0, 1, 2, 3, 5, 7, 10)] == [0, 0, 0, 1, 1, 1, 2]
    assert held_out_count(10, 0.25) == 3 and held_out_count(4, 0.9) == 3  # halves up; n - 1 at most


def test_cohort_is_drawn_from_the_seed_and_round_among_clients_with_held_out_samples():
    eligible = [0, 2, 3, 5, 8, 9, 11]
    a = eval_cohort(eligible, 4, 0, 3)
    assert a == eval_cohort(eligible, 4, 0, 3) and a == sorted(a) and set(a) <= set(eligible) and len(a) == 4
    assert eval_cohort(eligible, 0, 0, 3) == eligible == eval_cohort(eligible, 9, 0, 3)
    assert len({tuple(eval_cohort(eligible, 4, 0, r)) for r in range(1, 9)}) > 1


def test_percentiles_and_summary_keys():
    values = sorted(np.random.default_rng(0).random(11).tolist())
    for q in client_eval.PERCENTILES:
        assert client_eval.percentile(values, q) == pytest.approx(np.percentile(values, q), abs=1e-15)
    assert client_eval.percentile([0.5], 90) == 0.5
    regression = client_eval.keys(tasks.get("regression"), 2)
    assert "client_eval_mae_wmean" in regression and "client_eval_personalized_mae_p90" in regression
    result = client_eval.summary(tasks.get("regression"), [4, 7], [[2, 1.0, 3.0, 0.5, 1.0], [6, 6.0, 6.0, 3.0, 3.0]],
                                 {4: 0, 7: 1}, 5, 2, 0.0)
    assert list(result.metrics) == regression
    assert result.metrics["client_eval_mae_mean"] == 1.25 and result.metrics["client_eval_mae_wmean"] == 9 / 8
    assert result.rows[0] == {"round": 5, "client": 4, "rank": 0, "num_samples": 2, "steps": 2, "loss": 0.5,
                              "mae": 1.5, "personalized_loss": 0.25, "personalized_mae": 0.5}


@pytest.mark.parametrize("override, key", [
    ("run.client_eval_every=-1", "run.client_eval_every"),
    ("run.client_eval_every=x", "run.client_eval_every"),
    ("run.client_eval_clients=-1", "run.client_eval_clients"),
    ("run.client_eval_clients=31", "run.client_eval_clients"),
    ("run.client_eval_steps=-3", "run.client_eval_steps"),
    ("data.client_test_fraction=1.0", "data.client_test_fraction"),
    ("data.client_test_fraction=-0.1", "data.client_test_fraction"),
])
def test_bad_values_are_one_line_naming_the_key(override, key, capsys, tmp_path):
    status = fedddp_main(["--check", QUICKSTART, f"run.out_dir={tmp_path}", "data.client_test_fraction=0.2",
                          "run.client_eval_every=2", override])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err and err.startswith("fedddp: error:") and f"{key}:" in err, err


def test_client_eval_without_held_out_samples_is_refused(capsys, tmp_path):
    status = fedddp_main(["--check", QUICKSTART, f"run.out_dir={tmp_path}", "run.client_eval_every=2"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err and "run.client_eval_every:" in err and "data.client_test_fraction" in err


# -- runs --------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_rows_every_n_rounds_in_client_id_order(k0_run):
    rows, evals = metrics(k0_run), eval_rows(k0_run)
    assert [r["client_eval_clients"] for r in rows] == [None, 12, None, 12]
    assert rows[0]["client_eval_accuracy_mean"] is None and rows[1]["client_eval_accuracy_mean"] > 0
    assert "client_eval_personalized_accuracy_mean" not in rows[1]  # k = 0: the global model only
    cfg = _cfg(*ON)
    held = build(cfg, 0, []).num_held_out
    for r in (2, 4):
        mine = [e for e in evals if e["round"] == r]
        assert [e["client"] for e in mine] == client_eval.cohort(cfg.run, held, r)
        assert [e["num_samples"] for e in mine] == [held[e["client"]] for e in mine]
        assert set(mine[0]) == {"round", "client", "rank", "num_samples", "steps", "loss", "accuracy"}
    assert [e["round"] for e in evals] == [2] * 12 + [4] * 12


@pytest.mark.e2e
def test_cohort_numbers_equal_a_slow_twin_on_final_pt(k0_run):
    """The last round's cohort evaluated by hand: final.pt, each client's held-out samples
    rebuilt from the config, one forward each."""
    cfg = _cfg(*ON, *BASE)
    data = build(cfg, cfg.data.seed, list(range(cfg.data.num_clients)))
    torch.manual_seed(0)
    model = build_model(cfg, data.input_shape, data.num_classes, data.task)
    model.load_state_dict(final_state(k0_run))
    model.eval()
    clients = client_eval.cohort(cfg.run, data.num_held_out, 4)
    accuracy, loss, n = [], [], []
    with torch.no_grad():
        for c in clients:
            x, y = data.held_out[c].x, data.held_out[c].y
            logits = model(x)
            accuracy.append((logits.argmax(1) == y).double().mean().item())
            loss.append(F.cross_entropy(logits, y, reduction="sum").double().item() / len(y))
            n.append(len(y))
    row = metrics(k0_run)[-1]
    assert row["client_eval_accuracy_mean"] == pytest.approx(sum(accuracy) / len(accuracy), rel=1e-12)
    assert row["client_eval_accuracy_wmean"] == pytest.approx(np.dot(accuracy, n) / sum(n), rel=1e-12)
    for q in (10, 50, 90):
        assert row[f"client_eval_accuracy_p{q}"] == pytest.approx(np.percentile(accuracy, q), rel=1e-12)
    assert row["client_eval_loss_mean"] == pytest.approx(np.mean(loss), rel=1e-6)
    assert row["client_eval_loss_wmean"] == pytest.approx(np.dot(loss, n) / sum(n), rel=1e-6)
    last = [e for e in eval_rows(k0_run) if e["round"] == 4]
    assert [e["accuracy"] for e in last] == pytest.approx(accuracy, rel=1e-12)
    assert not math.isclose(min(accuracy), max(accuracy))  # non-IID: the clients differ


@pytest.mark.e2e
def test_personalization_leaves_the_global_model_and_training_alone(k0_run, k3_run, tmp_path):
    """k > 0 steps change nothing of training: the same final model, train losses and test
    metrics as k = 0 and as client evaluation off on the same held-out split; the global model's
    numbers are k = 0's, and the personalized ones, on this non-IID data, higher."""
    off = str(tmp_path / "off")
    run_here(BASE + ["data.client_test_fraction=0.2", f"run.out_dir={off}"])
    assert_same_state(final_state(k3_run), final_state(k0_run))
    assert_same_state(final_state(off), final_state(k0_run))
    training = lambda out: [(r["train_loss"], r["test_loss"], r["test_accuracy"]) for r in metrics(out)]  # noqa: E731
    assert training(k3_run) == training(k0_run) == training(off)
    assert not any(k.startswith("client_eval") for k in metrics(off)[-1]) and not os.path.exists(
        os.path.join(off, "client_eval.jsonl"))
    k0, k3 = metrics(k0_run)[-1], metrics(k3_run)[-1]
    assert {k: v for k, v in client_keys(k3).items() if "personalized" not in k} == client_keys(k0)
    assert k3["client_eval_personalized_accuracy_mean"] > k3["client_eval_accuracy_mean"] + 0.1
    assert k3["client_eval_personalized_loss_mean"] < k3["client_eval_loss_mean"]
    assert all(e["steps"] == 3 and "personalized_accuracy" in e for e in eval_rows(k3_run))


@pytest.mark.e2e
def test_off_by_default_trains_as_without_the_keys(tmp_path):
    """The new keys at their defaults: no split, no client evaluation, today's bits."""
    plain, explicit = str(tmp_path / "plain"), str(tmp_path / "explicit")
    run_here(BASE + [f"run.out_dir={plain}"])
    run_here(BASE + ["run.client_eval_every=0", "run.client_eval_clients=0", "run.client_eval_steps=0",
                     "data.client_test_fraction=0.0", f"run.out_dir={explicit}"])
    assert_same_state(final_state(plain), final_state(explicit))
    assert without(metrics(plain), TIMINGS) == without(metrics(explicit), TIMINGS)
    assert not any(k.startswith("client_eval") for k in metrics(plain)[-1])
    data, steps = build(_cfg(), 0, [0]), build(_cfg("run.client_eval_steps=4"), 0, [0])
    assert data.held_out is None and torch.equal(data.train[0].x, steps.train[0].x)


@pytest.mark.e2e
def test_side_by_side_equals_one_after_another(k3_run, k3_side_run):
    """run.parallel_clients = 3: the global model's evaluation as one forward over a group's
    concatenated held-out samples, the personalization steps side by side: equal to one after
    another to float32 rounding (training is side by side too)."""
    for a, b in zip(metrics(k3_side_run), metrics(k3_run)):
        for key, value in client_keys(b).items():
            assert a[key] == (None if value is None else pytest.approx(value, rel=1e-4, abs=1e-6)), key
    a, b = eval_rows(k3_side_run), eval_rows(k3_run)
    assert without(a, {"loss", "accuracy", "personalized_loss", "personalized_accuracy"}) == \
        without(b, {"loss", "accuracy", "personalized_loss", "personalized_accuracy"})
    for key in ("loss", "accuracy", "personalized_loss", "personalized_accuracy"):
        assert [e[key] for e in a] == pytest.approx([e[key] for e in b], rel=1e-4, abs=1e-6)


@pytest.mark.e2e
def test_resume_writes_the_same_rows(k3_run, tmp_path):
    out = str(tmp_path / "resumed")
    args = BASE + ON + ["run.client_eval_steps=3", f"run.out_dir={out}"]
    run_here(args + ["run.stop_after=2"])
    assert len(eval_rows(out)) == 12
    run_here(args + ["run.resume=true"])
    assert without(metrics(out), TIMINGS) == without(metrics(k3_run), TIMINGS)
    assert eval_rows(out) == eval_rows(k3_run)
    assert_same_state(final_state(out), final_state(k3_run))


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_two_ranks_write_the_same_rows(k0_run, k3_side_run, tmp_path):
    """Under real torchrun with 2 ranks: the cohorts split over the ranks, the rows gathered in
    client-id order, bitwise those of 1 rank (test_loss aside: the global test set's shards sum
    in another order), for k = 0 one after another and k = 3 side by side."""
    two_k0, two_k3 = str(tmp_path / "k0"), str(tmp_path / "k3")
    run_fedddp_each([BASE + ON + [f"run.out_dir={two_k0}"],
                     BASE + ON + ["run.client_eval_steps=3", "run.parallel_clients=3", f"run.out_dir={two_k3}"]],
                    nproc=2)
    for two, one in ((two_k0, k0_run), (two_k3, k3_side_run)):
        assert without(metrics(two), TIMINGS | {"test_loss"}) == without(metrics(one), TIMINGS | {"test_loss"})
        assert without(eval_rows(two), {"rank"}) == without(eval_rows(one), {"rank"})
        assert {e["rank"] for e in eval_rows(two)} == {0, 1}
