"""Every server rule of the papers runs end to end, through ``python -m fedddp`` and through real
``torchrun``, and gives the bitwise-same model with 1 and 2 ranks: on the quickstart, and on the
seed-002 CNN with the real MNIST test split (skipped where that folder is absent)."""

import os

import pytest

from fedrun import QUICKSTART, REPO, assert_same_state, client_rows, final_state, metrics, run_fedddp

REAL_MNIST = os.path.join(REPO, "..", "shared", "data")
MNIST_CNN = os.path.join(REPO, "configs", "mnist_cnn.toml")
DIAGNOSTIC = {"fedmom": "velocity_norm", "fedcong": "cong_positive", "fedgma": "mask_density",
              "cgw": "cgw_c", "feder": None}
# per-client diagnostics, in clients.jsonl
CLIENT_DIAGNOSTIC = {"cgw": "cgw_x", "feder": "feder_alpha"}


def check_invariant(tmp_path, name, config, extra):
    single, double = tmp_path / "one", tmp_path / "two"
    run_fedddp(extra + [f"algorithm.name={name}", f"run.out_dir={single}"], nproc=1, config=config)
    run_fedddp(extra + [f"algorithm.name={name}", f"run.out_dir={double}"], nproc=2, config=config)
    assert_same_state(final_state(single), final_state(double))
    rows = metrics(single)
    assert DIAGNOSTIC[name] is None or DIAGNOSTIC[name] in rows[-1], rows[-1].keys()
    if name in CLIENT_DIAGNOSTIC:
        assert CLIENT_DIAGNOSTIC[name] in client_rows(single)[-1]
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fedmom", "fedcong", "fedgma", "cgw"])
def test_rule_on_quickstart(tmp_path, name):
    rows = check_invariant(tmp_path, name, QUICKSTART, ["run.rounds=3", "run.clients_per_round=7",
                                                  "run.ckpt_every=0", "run.eval_every=3"])
    assert rows[-1]["test_accuracy"] is not None


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(os.path.join(REAL_MNIST, "MNIST", "raw", "t10k-images-idx3-ubyte.gz")),
                    reason="the real MNIST test split is not in ../shared/data")
@pytest.mark.parametrize("name", ["fedmom", "fedcong", "fedgma", "cgw", "feder"])
def test_rule_on_real_mnist_cnn(tmp_path, name):
    rows = check_invariant(tmp_path, name, MNIST_CNN, [
        f"data.root={REAL_MNIST}", "run.rounds=2", "train.local_steps=3", "run.eval_every=2",
        "run.ckpt_every=0"])
    last = [row for row in client_rows(tmp_path / "one") if row["round"] == rows[-1]["round"]]
    assert len(last) == 10
    if name == "feder":
        assert all(len(row["feder_alpha"]) == 2 for row in last)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(os.path.join(REAL_MNIST, "MNIST", "raw", "t10k-images-idx3-ubyte.gz")),
                    reason="the real MNIST test split is not in ../shared/data")
def test_gam_clients_with_feder_aggregation(tmp_path):
    """A composed pair (seed 002's local rule, seed 003's server rule) runs end to end and stays
    world-size invariant."""
    check_invariant(tmp_path, "feder", MNIST_CNN, [
        f"data.root={REAL_MNIST}", "algorithm.local=gam", "run.rounds=2", "train.local_steps=3",
        "run.eval_every=2", "run.ckpt_every=0"])


@pytest.mark.slow
def test_fedmom_server_state_survives_a_stop_and_resume(tmp_path):
    """FedMom's state (the previous global model) goes into the checkpoint: stopped after round
    2 on one rank and resumed on two, the run ends where the uninterrupted one does."""
    full, part = tmp_path / "full", tmp_path / "part"
    args = ["algorithm.name=fedmom", "run.rounds=4", "run.clients_per_round=7", "run.ckpt_every=1",
            "run.eval_every=4"]
    run_fedddp(args + [f"run.out_dir={full}"])
    run_fedddp(args + [f"run.out_dir={part}", "run.stop_after=2"])
    run_fedddp(args + [f"run.out_dir={part}", "run.resume=true"], nproc=2)
    assert_same_state(final_state(full), final_state(part))
    norms = [[row["velocity_norm"] for row in metrics(out)] for out in (full, part)]
    assert norms[0] == norms[1] and len(norms[0]) == 4 and norms[0][2] > 0
