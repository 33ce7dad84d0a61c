"""End-to-end runs: world-size invariance and resume equivalence (one rank in this process, several
through real torchrun, the 2-rank runs of the module under one torchrun), the outputs, and the
exit status of ``python -m fedddp``."""

import os
import shutil

import pytest
import torch

from fedrun import assert_same_state, final_state, is_selected, make_mnist_like, metrics, run_fedddp, run_fedddp_each
from fedrun import run_here

SMALL = ["run.rounds=6", "run.clients_per_round=7", "run.eval_every=2", "run.ckpt_every=0"]


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_world_size_invariance_quickstart(tmp_path, two_ranks):
    run_here(SMALL + [f"run.out_dir={tmp_path / 'w1'}"])
    run_fedddp(SMALL + [f"run.out_dir={tmp_path / 'w4'}"], nproc=4)
    outs = [tmp_path / "w1", two_ranks["quickstart"], tmp_path / "w4"]
    states = [final_state(out) for out in outs]
    assert all(len(metrics(out)) == 6 for out in outs)
    assert_same_state(states[0], states[1])
    assert_same_state(states[0], states[2])


@pytest.fixture(scope="module")
def mnist_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_mnist_like(str(root), num=500)
    return str(root)


CNN = ["data.name=mnist", "data.holdout_from_test=0.2", "data.num_clients=6", "data.partition=dirichlet",
       "data.dirichlet_alpha=0.5", "model.name=cnn", "run.rounds=3", "run.clients_per_round=5",
       "train.batch_size=16", "train.lr=0.05", "train.local_epochs=2", "run.eval_every=1"]
RESUME = ["run.rounds=6", "run.clients_per_round=7", "run.ckpt_every=2"]


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory, mnist_root) -> dict:
    """The module's 2-rank runs, under one torchrun (each in a process group of its own): the
    quickstart, the CNN, and the resume test's run stopped after round 3."""
    root = tmp_path_factory.mktemp("two_ranks")
    runs = {key: args for key, args, test in (
        ("quickstart", SMALL, "test_world_size_invariance_quickstart"),
        ("cnn", CNN + [f"data.root={mnist_root}"], "test_world_size_invariance_cnn_with_buffers"),
        ("stopped", RESUME + ["run.stop_after=3"], "test_resume_equivalence_across_world_sizes"))
        if is_selected(request, test)}
    outs = {key: root / key for key in runs}
    if runs:
        run_fedddp_each([args + [f"run.out_dir={outs[key]}"] for key, args in runs.items()], nproc=2)
    return outs


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_world_size_invariance_cnn_with_buffers(tmp_path, mnist_root, two_ranks):
    a = tmp_path / "a"
    run_here(CNN + [f"data.root={mnist_root}", f"run.out_dir={a}"])
    assert_same_state(final_state(a), final_state(two_ranks["cnn"]))
    acc = [m["test_accuracy"] for m in metrics(a)]
    assert acc[-1] > 0.5, acc  # the stand-in data are learnable: the loop really trains


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_resume_equivalence_across_world_sizes(tmp_path, two_ranks):
    full, part = tmp_path / "full", tmp_path / "part"
    args = RESUME
    run_here(args + [f"run.out_dir={full}"])
    shutil.copytree(two_ranks["stopped"], part)  # stopped after round 3 on 2 ranks
    assert not (part / "final.pt").exists()
    assert [m["round"] for m in metrics(part)] == [1, 2, 3]
    run_here(args + [f"run.out_dir={part}", "run.resume=true"])
    assert_same_state(final_state(full), final_state(part))
    assert [m["round"] for m in metrics(part)] == list(range(1, 7))
    assert [m["test_accuracy"] for m in metrics(part)] == [m["test_accuracy"] for m in metrics(full)]


@pytest.mark.processes
def test_missing_dataset_exits_3_naming_folder_and_files(tmp_path):
    proc = run_fedddp(["data.name=mnist", "model.name=cnn", f"data.root={tmp_path}",
                       f"run.out_dir={tmp_path / 'out'}"], check=False)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert os.path.join(str(tmp_path), "MNIST", "raw") in lines[0]
    assert "train-images-idx3-ubyte" in lines[0]


@pytest.mark.e2e
def test_outputs_follow_the_contract(tmp_path):
    out = tmp_path / "o"
    run_here(["run.rounds=2", "run.eval_every=1", "run.ckpt_every=1", f"run.out_dir={out}"])
    rows = metrics(out)
    for key in ("round", "train_loss", "test_loss", "test_accuracy", "time_s", "train_s",
                "communicate_s", "aggregate_s", "evaluate_s"):
        assert key in rows[0], key
    assert (out / "config.toml").exists()
    state = torch.load(out / "final.pt", weights_only=True)
    assert set(state) == {"head.weight", "head.bias"}  # logistic regression: Flatten + Linear
    assert (out / "checkpoints" / "LATEST").read_text() == "round_000002"
