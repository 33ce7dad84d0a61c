"""Every server rule of the papers runs end to end, on one rank (``fedddp.__main__.main``, what
``python -m fedddp`` runs, in this process) and on two through real ``torchrun``, and gives the
bitwise-same model with 1 and 2 ranks: on the quickstart, and on the seed-002 CNN with the real
MNIST test split (skipped where that folder is absent). The two-rank runs of one table share one
torchrun (fedrun.run_fedddp_each), each in a process group of its own."""

import os

import pytest

from fedrun import QUICKSTART, REPO, assert_same_state, client_rows, final_state, metrics, run_fedddp_each
from fedrun import is_selected, run_here, selected

REAL_MNIST = os.path.join(REPO, "..", "shared", "data")
MNIST_CNN = os.path.join(REPO, "configs", "mnist_cnn.toml")
DIAGNOSTIC = {"fedmom": "velocity_norm", "fedcong": "cong_positive", "fedgma": "mask_density",
              "cgw": "cgw_c", "feder": None}
# per-client diagnostics, in clients.jsonl
CLIENT_DIAGNOSTIC = {"cgw": "cgw_x", "feder": "feder_alpha"}


QUICK = ["run.rounds=3", "run.clients_per_round=7", "run.ckpt_every=0", "run.eval_every=3"]
CNN = [f"data.root={REAL_MNIST}", "run.rounds=2", "train.local_steps=3", "run.eval_every=2", "run.ckpt_every=0"]
GAM = ["algorithm.local=gam"]


def two_rank_runs(tmp_path_factory, config, cases: dict, outs: dict | None = None) -> dict:
    """{key: out_dir} of each case's run on 2 ranks, all under one torchrun; ``outs`` names the
    folders of cases that continue a run already there."""
    root = tmp_path_factory.mktemp("two_ranks")
    outs = {key: (outs or {}).get(key, root / str(key)) for key in cases}
    if cases:
        run_fedddp_each([args + [f"run.out_dir={outs[key]}"] for key, args in cases.items()], nproc=2,
                        config=config)
    return outs


FEDMOM = ["algorithm.name=fedmom", "run.rounds=4", "run.clients_per_round=7", "run.ckpt_every=1",
          "run.eval_every=4"]


@pytest.fixture(scope="module")
def quickstart_two_ranks(request, tmp_path_factory):
    """The quickstart's runs on 2 ranks under one torchrun: each selected rule's, and FedMom's
    resume of a run stopped after round 2 on one rank (here, first) as "resumed"."""
    cases = {n: QUICK + [f"algorithm.name={n}"] for n in selected(request, "test_rule_on_quickstart", "name")}
    outs = {}
    if is_selected(request, "test_fedmom_server_state_survives_a_stop_and_resume"):
        outs["resumed"] = tmp_path_factory.mktemp("fedmom") / "part"
        run_here(FEDMOM + [f"run.out_dir={outs['resumed']}", "run.stop_after=2"])
        cases["resumed"] = FEDMOM + ["run.resume=true"]
    return two_rank_runs(tmp_path_factory, QUICKSTART, cases, outs)


@pytest.fixture(scope="module")
def cnn_two_ranks(request, tmp_path_factory):
    cases = {n: CNN + [f"algorithm.name={n}"] for n in selected(request, "test_rule_on_real_mnist_cnn", "name")}
    if is_selected(request, "test_gam_clients_with_feder_aggregation"):
        cases["gam"] = CNN + GAM + ["algorithm.name=feder"]
    return two_rank_runs(tmp_path_factory, MNIST_CNN, cases)


def check_invariant(tmp_path, name, config, extra, double):
    """The one-rank run here against ``double``, the same run on two ranks."""
    single = tmp_path / "one"
    run_here(extra + [f"algorithm.name={name}", f"run.out_dir={single}"], config=config)
    assert_same_state(final_state(single), final_state(double))
    rows = metrics(single)
    assert DIAGNOSTIC[name] is None or DIAGNOSTIC[name] in rows[-1], rows[-1].keys()
    if name in CLIENT_DIAGNOSTIC:
        assert CLIENT_DIAGNOSTIC[name] in client_rows(single)[-1]
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fedmom", "fedcong", "fedgma", "cgw"])
@pytest.mark.processes
@pytest.mark.e2e
def test_rule_on_quickstart(tmp_path, name, quickstart_two_ranks):
    rows = check_invariant(tmp_path, name, QUICKSTART, QUICK, quickstart_two_ranks[name])
    assert rows[-1]["test_accuracy"] is not None


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(os.path.join(REAL_MNIST, "MNIST", "raw", "t10k-images-idx3-ubyte.gz")),
                    reason="the real MNIST test split is not in ../shared/data")
@pytest.mark.parametrize("name", ["fedmom", "fedcong", "fedgma", "cgw", "feder"])
@pytest.mark.processes
@pytest.mark.e2e
def test_rule_on_real_mnist_cnn(tmp_path, name, cnn_two_ranks):
    rows = check_invariant(tmp_path, name, MNIST_CNN, CNN, cnn_two_ranks[name])
    last = [row for row in client_rows(tmp_path / "one") if row["round"] == rows[-1]["round"]]
    assert len(last) == 10
    if name == "feder":
        assert all(len(row["feder_alpha"]) == 2 for row in last)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(os.path.join(REAL_MNIST, "MNIST", "raw", "t10k-images-idx3-ubyte.gz")),
                    reason="the real MNIST test split is not in ../shared/data")
@pytest.mark.processes
@pytest.mark.e2e
def test_gam_clients_with_feder_aggregation(tmp_path, cnn_two_ranks):
    """A composed pair (seed 002's local rule, seed 003's server rule) runs end to end and stays
    world-size invariant."""
    check_invariant(tmp_path, "feder", MNIST_CNN, CNN + GAM, cnn_two_ranks["gam"])


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_fedmom_server_state_survives_a_stop_and_resume(tmp_path, quickstart_two_ranks):
    """FedMom's state (the previous global model) goes into the checkpoint: stopped after round
    2 on one rank and resumed on two (quickstart_two_ranks), the run ends where the uninterrupted
    one does."""
    full, part = tmp_path / "full", quickstart_two_ranks["resumed"]
    run_here(FEDMOM + [f"run.out_dir={full}"])
    assert_same_state(final_state(full), final_state(part))
    norms = [[row["velocity_norm"] for row in metrics(out)] for out in (full, part)]
    assert norms[0] == norms[1] and len(norms[0]) == 4 and norms[0][2] > 0
