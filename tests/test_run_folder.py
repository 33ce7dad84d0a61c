"""One run per out_dir, an unusable out_dir or a full disk as one line, divergence as its own
exit status, and the lines that say where a run resumed or how to continue a stopped one."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest

from fedddp import checkpoint, logs
from fedddp.__main__ import main as fedddp_main
from fedrun import QUICKSTART, REPO, SLOW, assert_same_state, final_state, metrics, wait_for_rounds

ARGS = [QUICKSTART, "run.rounds=6", "run.clients_per_round=7", "run.eval_every=2", "run.ckpt_every=2",
        "run.progress=false"]


def _main(args, capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    status = fedddp_main(args)
    return status, [line for line in capsys.readouterr().err.splitlines() if line.startswith("fedddp:")]


def _strict_json_lines(path) -> list[dict]:
    def refuse(name):
        raise ValueError(f"bare {name} in {path}")
    with open(path) as fh:
        return [json.loads(line, parse_constant=refuse) for line in fh]


# -- out_dir: unusable, checked before any data is loaded ---------------------------------------

# data that does not exist: were it loaded first, the run would end with exit status 3
NO_DATA = ["data.name=mnist", "model.name=mlp", "data.root=/nonexistent/fedddp-data"]


@pytest.mark.e2e
def test_out_dir_that_is_a_file_is_one_line_before_data_loads(tmp_path, capsys):
    """Regression: a file as out_dir was a traceback (exit 1), after the data had been loaded."""
    target = tmp_path / "a_file"
    target.write_text("x")
    status, lines = _main(ARGS + NO_DATA + [f"run.out_dir={target}"], capsys)
    assert status == 2 and lines == [f"fedddp: error: run.out_dir: {target} is a file, not a folder; "
                                     "pick another run.out_dir"]


@pytest.mark.e2e
def test_empty_out_dir_is_one_line(capsys):
    status, lines = _main(ARGS + NO_DATA + ["run.out_dir="], capsys)
    assert status == 2 and len(lines) == 1 and "run.out_dir: empty" in lines[0]


@pytest.mark.e2e
def test_unwritable_out_dir_is_one_line(tmp_path, capsys):
    """Regression: a read-only out_dir was a traceback. (Root ignores file modes; sysfs refuses
    new files even to root.)"""
    target = "/sys/kernel"
    try:
        open(os.path.join(target, ".lock"), "a").close()
        pytest.skip(f"{target} is writable here")
    except OSError:
        pass
    status, lines = _main(ARGS + NO_DATA + [f"run.out_dir={target}"], capsys)
    assert status == 2 and len(lines) == 1 and f"run.out_dir: cannot write to {target}" in lines[0], lines


# -- one run per out_dir ------------------------------------------------------------------------

@pytest.mark.e2e
def test_second_run_into_a_locked_out_dir_names_the_holder(tmp_path, capsys):
    from fedddp import outdir
    out = tmp_path / "o"
    lock = outdir.open_out_dir(str(out))
    try:
        status, lines = _main(ARGS + [f"run.out_dir={out}", "run.resume=true"], capsys)
    finally:
        lock.release()
    assert status == 2 and len(lines) == 1, lines
    assert f"{out} is in use by another run (pid {os.getpid()} on " in lines[0]
    assert fedddp_main(ARGS + [f"run.out_dir={out}"]) == 0  # released: the folder is usable again


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_two_runs_at_once_in_one_out_dir(tmp_path):
    """Regression: two runs into one out_dir both exited 0 with interleaved metrics.jsonl. The
    first holds the lock for its life; the second (even one that resumes) is refused."""
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "fedddp", QUICKSTART, "run.progress=false", *SLOW, "run.rounds=100000",
           f"run.out_dir={out}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    first = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
    try:
        wait_for_rounds(out, 1, first, log=None)
        second = subprocess.run(cmd + ["run.resume=true", "run.rounds=1"], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=300)
        assert first.poll() is None  # the first run was still going when the second started
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert second.returncode == 2, second.stderr
    assert second.stderr.strip() == (f"fedddp: error: run.out_dir: {out} is in use by another run (pid "
                                     f"{first.pid} on {os.uname().nodename}); wait for it to end or pick "
                                     "another run.out_dir")


# -- divergence -------------------------------------------------------------------------------

@pytest.mark.e2e
def test_divergence_stops_the_run_with_status_4(tmp_path, capsys):
    """Regression: model.name=mlp train.lr=3 went NaN at round 2 and exited 0 with an all-NaN
    final.pt, pruned the finite checkpoints for NaN ones and wrote bare NaN into metrics.jsonl."""
    out = tmp_path / "o"
    status, lines = _main(ARGS + ["model.name=mlp", "train.lr=3", "run.ckpt_every=1", f"run.out_dir={out}"],
                          capsys)
    assert status == 4 and len(lines) == 1, lines
    assert lines[0].startswith("fedddp: error: round 2: the run diverged") and "train.lr = 3.0" in lines[0]
    assert f"last checkpoint {out / 'checkpoints' / 'round_000001'}" in lines[0]
    assert [m["round"] for m in _strict_json_lines(out / "metrics.jsonl")] == [1]
    assert not (out / "final.pt").exists()
    # no checkpoint of the bad round; the last finite one is complete and kept
    assert [r for r, _ in checkpoint.round_folders(str(out / "checkpoints"))] == [1]
    assert checkpoint.latest(str(out / "checkpoints")) == str(out / "checkpoints" / "round_000001")


def test_metrics_lines_write_non_finite_values_as_null():
    line = {"round": 3, "test_loss": math.inf, "ranks": [1.0, math.nan], "clients": [1, 2]}
    clean = {k: logs.finite_or_null(v) for k, v in line.items()}
    assert clean == {"round": 3, "test_loss": None, "ranks": [1.0, None], "clients": [1, 2]}
    json.dumps(clean, allow_nan=False)


# -- full disk --------------------------------------------------------------------------------

def _no_space():
    """What torch.save raises on a full disk: a RuntimeError with the OSError in its chain."""
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as exc:
        raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from exc


@pytest.mark.e2e
def test_full_disk_while_checkpointing_is_one_line_and_resumes(tmp_path, capsys, monkeypatch):
    """Regression: a full disk was a traceback with ENOSPC buried in a chained exception."""
    full, out = tmp_path / "full", tmp_path / "o"
    assert fedddp_main(ARGS + [f"run.out_dir={full}"]) == 0
    real_save = checkpoint.atomic_save

    def saving_on_a_full_disk(obj, path):
        if "round_000004" in path:
            _no_space()
        return real_save(obj, path)

    monkeypatch.setattr(checkpoint, "atomic_save", saving_on_a_full_disk)
    status, lines = _main(ARGS + [f"run.out_dir={out}"], capsys)
    assert status == 5 and len(lines) == 1, lines
    assert "No space left on device on the file system at " in lines[0]
    assert f"the checkpoint of round 4 in {out / 'checkpoints'}" in lines[0]
    assert f"the last complete checkpoint is {out / 'checkpoints' / 'round_000002'}" in lines[0]
    assert not [p for p in (out / "checkpoints" / "round_000004").iterdir() if ".tmp." in p.name]
    monkeypatch.setattr(checkpoint, "atomic_save", real_save)
    status, lines = _main(ARGS + [f"run.out_dir={out}", "run.resume=true"], capsys)
    assert status == 0 and lines[0].startswith("fedddp: resuming from round 2 ("), lines
    assert_same_state(final_state(full), final_state(out))


@pytest.mark.e2e
def test_full_disk_before_the_first_checkpoint_then_the_advised_rerun_and_a_restart_work(tmp_path, capsys,
                                                                                        monkeypatch):
    """Regression: a full disk during the first checkpoint said "free space and rerun", but the
    plain rerun was refused (a folder with results) and run.resume=true, like a torchrun
    restart, exited 3 (round folders but none complete). The line now advises run.resume=true,
    which removes the round folder whose save never finished, says so, and starts from round 1;
    a restart does the same."""
    full, out = tmp_path / "full", tmp_path / "o"
    assert fedddp_main(ARGS + [f"run.out_dir={full}"]) == 0
    real_save = checkpoint.atomic_save

    def saving_on_a_full_disk(obj, path):
        if path.endswith(os.path.join("round_000002", "server.pt")):
            _no_space()
        return real_save(obj, path)

    monkeypatch.setattr(checkpoint, "atomic_save", saving_on_a_full_disk)
    status, lines = _main(ARGS + [f"run.out_dir={out}"], capsys)
    assert status == 5 and len(lines) == 1, lines
    assert lines[0].endswith("no complete checkpoint yet: free space and rerun with run.resume=true (it starts "
                             "from round 1)"), lines
    monkeypatch.setattr(checkpoint, "atomic_save", real_save)
    restarted = tmp_path / "restarted"
    shutil.copytree(out, restarted)
    removed = ("was ever completed (round_000002: no manifest (its save did not finish)); removed its round "
               "folder(s), starting from round 1")
    status, lines = _main(ARGS + [f"run.out_dir={out}", "run.resume=true"], capsys)
    assert status == 0 and lines == [f"fedddp: no checkpoint in {out / 'checkpoints'} {removed}"], lines
    assert [m["round"] for m in metrics(out)] == list(range(1, 7))
    assert_same_state(final_state(full), final_state(out))
    # torchrun --max-restarts restarts the plain command with TORCHELASTIC_RESTART_COUNT > 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    status, lines = _main(ARGS + [f"run.out_dir={restarted}"], capsys)
    assert status == 0 and lines[-1] == f"fedddp: no checkpoint in {restarted / 'checkpoints'} {removed}", lines
    assert_same_state(final_state(full), final_state(restarted))


@pytest.mark.e2e
def test_full_disk_while_writing_metrics_is_one_line(tmp_path, capsys, monkeypatch):
    out, appends = tmp_path / "o", []

    def opening_on_a_full_disk(path, mode="r", *args, **kwargs):
        if str(path).endswith("metrics.jsonl") and mode == "a":
            appends.append(path)
            if len(appends) == 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(logs, "open", opening_on_a_full_disk, raising=False)
    status, lines = _main(ARGS + [f"run.out_dir={out}"], capsys)
    assert status == 5 and len(lines) == 1, lines
    assert f"while writing metrics.jsonl in {out}" in lines[0]
    assert f"the last complete checkpoint is {out / 'checkpoints' / 'round_000002'}" in lines[0]


# -- what a stopped or resumed run says -------------------------------------------------------

@pytest.mark.e2e
def test_stop_after_says_how_to_continue(tmp_path, capsys):
    out = tmp_path / "o"
    status, lines = _main(ARGS + [f"run.out_dir={out}", "run.stop_after=3"], capsys)
    assert status == 0
    assert lines == [f"fedddp: stopped after round 3 (run.stop_after); continue from "
                     f"{out / 'checkpoints' / 'round_000003'} with run.resume=true"]
    status, lines = _main(ARGS + [f"run.out_dir={out}", "run.resume=true"], capsys)
    assert status == 0 and lines == [f"fedddp: resuming from round 3 ({out / 'checkpoints' / 'round_000003'})"]
    assert [m["round"] for m in metrics(out)] == list(range(1, 7))


def test_check_refuses_a_fresh_run_into_a_folder_with_results(tmp_path, capsys):
    """The launchers run --check before torchrun: a fresh run into a folder with results must be
    refused there, or torchrun --max-restarts restarts the refused workers, which are then forced
    to resume the earlier run. The check deletes nothing, even with run.overwrite=true."""
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n')
    status, lines = _main(["--check", QUICKSTART, f"run.out_dir={tmp_path}"], capsys)
    assert status == 2 and len(lines) == 1 and "run.overwrite=true" in lines[0], lines
    for extra in ("run.overwrite=true", "run.resume=true"):
        assert _main(["--check", QUICKSTART, f"run.out_dir={tmp_path}", extra], capsys)[0] == 0
    assert (tmp_path / "metrics.jsonl").exists()
