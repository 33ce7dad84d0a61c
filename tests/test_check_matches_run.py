"""``python -m fedddp --check`` exits with the status the run would: every refusal the run makes
before round 1 (its folder, a resume's checkpoint, the data, the model, the batch size, the
clients' speeds), made by ``fedddp.__main__.check`` as the same error, and without writing
anything. In this process: ``check`` against ``fedddp.run``, each refused before round 1."""

from __future__ import annotations

import os
import shutil
import textwrap

import pytest

import fedddp
from fedddp import outdir
from fedddp.__main__ import check, main
from fedddp.errors import ConfigError, DataError, UserError
from fedrun import QUICKSTART

QUIET = ["run.progress=false"]

# A plugin model with BatchNorm1d: on the quickstart's clients (641, 113, 65, 261 ... samples)
# batch sizes 8, 16, 32 and 64 leave some client a last batch of one sample.
MODELS = """
    from torch import nn

    def batch_norm(input_shape, num_classes):
        return nn.Sequential(nn.Linear(input_shape[0], 16), nn.BatchNorm1d(16), nn.ReLU(),
                             nn.Linear(16, num_classes))

    def wrong_output(input_shape, num_classes):
        return nn.Linear(input_shape[0], num_classes + 1)
"""


@pytest.fixture(autouse=True)
def plugin_models(tmp_path, monkeypatch, plugin_registries):
    """check_matches_models.py in tmp_path, the working directory (where plugins are looked up);
    the registries it joins are restored after the test (conftest's plugin_registries)."""
    (tmp_path / "check_matches_models.py").write_text(textwrap.dedent(MODELS))
    monkeypatch.chdir(tmp_path)


def files_under(root) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None: a folder)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(folder, name), root)] = None
        for name in files:
            with open(os.path.join(folder, name), "rb") as fh:
                found[os.path.relpath(os.path.join(folder, name), root)] = fh.read()
    return found


def assert_check_refuses_as_the_run(tmp_path, overrides: list[str], error: type, *words: str) -> None:
    """check() raises what fedddp.run raises (class, exit status, line), writing nothing."""
    before = files_under(tmp_path)
    with pytest.raises(UserError) as checked:
        check(QUICKSTART, overrides)
    assert files_under(tmp_path) == before, "--check wrote or changed files"
    with pytest.raises(UserError) as ran:
        fedddp.run(QUICKSTART, overrides + QUIET)
    assert type(ran.value) is error and ran.value.exit_code == error.exit_code, repr(ran.value)
    assert type(checked.value) is type(ran.value) and checked.value.exit_code == ran.value.exit_code
    assert str(checked.value) == str(ran.value)
    for word in words:
        assert word in str(ran.value), str(ran.value)


@pytest.mark.parametrize("batch_size", [8, 16, 32, 64])
def test_a_batch_of_one_sample_for_batch_norm(tmp_path, capsys, batch_size):
    """--check said OK and the run exited 2 (client/__init__.py: check_one_sample_batches)."""
    args = [f"run.out_dir={tmp_path / 'out'}", "model.name=check_matches_models:batch_norm",
            f"train.batch_size={batch_size}"]
    assert_check_refuses_as_the_run(tmp_path, args, ConfigError, f"train.batch_size: {batch_size} leaves client(s)",
                                    "a last batch of one sample")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    assert main(["--check", QUICKSTART, *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("fedddp: error: train.batch_size:"), err


def test_a_batch_size_without_a_batch_of_one_passes(tmp_path):
    check(QUICKSTART, [f"run.out_dir={tmp_path / 'out'}", "model.name=check_matches_models:batch_norm",
                       "train.batch_size=12"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["a file", "under a file", "in use", "holds results"])
def test_the_run_folder(tmp_path, case):
    """outdir.open_out_dir's refusals (--check used to pass a file, a path under a file and a
    folder another run holds), and a fresh run into a folder holding results."""
    out, lock = tmp_path / "out", None
    if case == "a file":
        out.write_text("")
    elif case == "under a file":
        (tmp_path / "plain").write_text("")
        out = tmp_path / "plain" / "out"
    elif case == "in use":
        lock = outdir.open_out_dir(str(out))  # another run holds it
    else:
        out.mkdir()
        (out / "metrics.jsonl").write_text('{"round": 1}\n')
    words = {"a file": "is a file, not a folder", "under a file": "cannot write to",
             "in use": f"is in use by another run (pid {os.getpid()} on ", "holds results": "already holds"}[case]
    try:
        assert_check_refuses_as_the_run(tmp_path, [f"run.out_dir={out}"], ConfigError, "run.out_dir: ", words)
    finally:
        if lock is not None:
            lock.release()


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> str:
    """A quickstart run of 2 rounds with a checkpoint each round, for the resumes to continue."""
    out = tmp_path_factory.mktemp("finished") / "out"
    fedddp.run(QUICKSTART, ["run.rounds=2", "run.eval_every=2", "run.ckpt_every=1"] + QUIET, out_dir=out)
    return str(out)


def _corrupt(path) -> None:
    with open(path, "r+b") as fh:
        first = fh.read(1)
        fh.seek(0)
        fh.write(bytes([first[0] ^ 0xFF]))


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["another run", "rounds below", "damaged metrics", "no complete checkpoint"])
def test_a_resume(tmp_path, finished, case):
    """A resume's refusals (round.refuse_before_data), which --check skipped for run.resume=true."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    args = [f"run.out_dir={out}", "run.resume=true", "run.rounds=4"]
    if case == "another run":
        args.append("train.lr=0.02")
        error, words = ConfigError, ("run.resume: the checkpoint", "is of another run: train.lr 0.01 -> 0.02")
    elif case == "rounds below":
        args.append("run.rounds=1")
        error, words = ConfigError, ("run.rounds: 1 is below the round of the checkpoint",)
    elif case == "damaged metrics":
        with open(out / "metrics.jsonl", "a") as fh:
            fh.write("not json\n")
        error, words = DataError, ("metrics.jsonl: line 3 is damaged (not JSON)",)
    else:
        for folder in (out / "checkpoints").glob("round_*"):
            _corrupt(folder / "server.pt")
        error, words = DataError, ("none is complete", "fails its checksum")
    assert_check_refuses_as_the_run(tmp_path, args, error, *words)


@pytest.mark.e2e
def test_a_resume_that_continues_passes_and_changes_nothing(tmp_path, finished):
    """--check of a resume the run takes: OK, and the rows past the checkpoint it would cut back
    are still there (the run removes them, the check does not)."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    shutil.rmtree(out / "checkpoints" / "round_000002")  # the run resumes from round 1's
    before = files_under(tmp_path)
    check(QUICKSTART, [f"run.out_dir={out}", "run.resume=true"])
    assert files_under(tmp_path) == before


def test_the_model_and_the_data(tmp_path):
    """The refusals --check already made, kept in the list: a model's output against the task,
    and data that cannot be read."""
    out = f"run.out_dir={tmp_path / 'out'}"
    assert_check_refuses_as_the_run(tmp_path, [out, "model.name=check_matches_models:wrong_output"], ConfigError,
                                    "model.name: check_matches_models:wrong_output returns [2, 11]")
    assert_check_refuses_as_the_run(tmp_path, [out, "data.name=tensors", "data.path=missing.npz"], DataError,
                                    "missing.npz")


def test_an_unusable_client_speed(tmp_path):
    """exp(SIGMA z) past a float's range: the run exited 1 with OverflowError, --check 0."""
    assert_check_refuses_as_the_run(tmp_path, [f"run.out_dir={tmp_path / 'out'}", "run.mode=async",
                                               "data.client_speed=lognormal:800"], ConfigError, "data.client_speed: ")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("parallel_clients", [1, 2])
def test_a_refusal_a_trainer_adds_is_made_by_check_too(tmp_path, monkeypatch, parallel_clients):
    """--check builds the run's trainer with the run's builder (client/trainers.trainer_of) and
    calls the same ``check_first``: a refusal added there, one after another or side by side,
    is --check's too, with the run's line."""
    from fedddp.client.trainers import OneAfterAnother

    def refuse(self, data, ids):
        raise ConfigError(f"train.batch_size: refused by {type(self).__name__} for {len(ids)} clients")

    monkeypatch.setattr(OneAfterAnother, "check_first", refuse)
    trainer = "OneAfterAnother" if parallel_clients == 1 else "SideBySide"
    assert_check_refuses_as_the_run(tmp_path, [f"run.out_dir={tmp_path / 'out'}",
                                               f"run.parallel_clients={parallel_clients}"],
                                    ConfigError, f"refused by {trainer}")
