"""``python -m fedddp.launch``, the README's first command: torchrun's launcher in one process,
ending with fedddp's one line and exit status (a run refused, a run stopped by SIGTERM), never
torchrun's ChildFailedError or SignalException traceback and status 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from fedddp import env, launch
from fedrun import QUICKSTART, REPO, SLOW, metrics, wait_for_rounds

QUIET = ["run.progress=false"]
# torchrun's words, which must not reach the user.
TORCHRUN = ("Traceback", "ChildFailedError", "SignalException", "torch/distributed", "closing signal")


def launcher_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", env.STATUS_FILE_VAR)}


def launch_command(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedddp.launch", "--nproc", "2", QUICKSTART, *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=launcher_env())


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """One short quickstart on two ranks, the folder a second run is refused."""
    out = tmp_path_factory.mktemp("launch") / "quickstart"
    return out, launch_command("run.rounds=2", f"run.out_dir={out}", *QUIET)


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_a_finished_run_exits_0_with_nothing_of_torchruns(first_run):
    out, done = first_run
    assert done.returncode == 0, done.stderr[-4000:]
    assert not any(word in done.stderr for word in TORCHRUN), done.stderr[-4000:]
    assert [m["round"] for m in metrics(out)] == [1, 2] and (out / "final.pt").exists()


@pytest.mark.parametrize("check", [True, False], ids=["checked", "no-check"])
@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_the_quickstart_run_twice_ends_with_fedddps_line_and_2(first_run, check):
    """The README's command run twice: the second refuses to overwrite the first run's folder.
    Checked here first, before any rank starts; with --no-check the ranks refuse it under
    torchrun, whose ChildFailedError traceback (35 lines) and status 1 came after fedddp's line."""
    out, done = first_run
    assert done.returncode == 0, done.stderr[-4000:]
    again = launch_command(*([] if check else ["--no-check"]), "run.rounds=2", f"run.out_dir={out}", *QUIET)
    assert again.returncode == 2, again.stderr[-4000:]
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1, again.stderr[-4000:]
    assert lines[0].startswith(f"fedddp: error: run.out_dir: {out} already holds a run's results"), lines
    assert again.stdout == ""
    assert [m["round"] for m in metrics(out)] == [1, 2]  # untouched


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_sigterm_stops_the_ranks_with_one_line_and_143_and_resume_finishes(tmp_path):
    """What Slurm sends at a time limit: the ranks stop, the launcher says so in one line and
    exits 143 (torchrun: a SignalException traceback and status 1); run.resume=true continues
    from the last checkpoint to the end."""
    out = tmp_path / "out"
    args = [*QUIET, *SLOW, f"run.out_dir={out}"]
    status, text, stopping = stopped_after_round_2([sys.executable, "-m", "fedddp.launch", "--nproc", "2",
                                                    QUICKSTART, *args], out, signal.SIGTERM, launcher_env())
    assert status == 143, text[-4000:]
    done = len(metrics(out))
    assert 3 <= done < 10, f"stopped after round {done} of 10"
    saved = int((out / "checkpoints" / "LATEST").read_text().split("_")[1])
    assert text.strip().splitlines() == [f"fedddp: stopped by SIGTERM; the same command with run.resume=true "
                                         f"continues from the checkpoint of round {saved}"], text[-4000:]
    assert stopping < 30, f"{stopping:.1f} s to stop: a rank outlived SIGTERM until torch's SIGKILL"
    assert ranks_of(out) == [], "a rank outlived the launcher"
    kept = (out / "metrics.jsonl").read_text().splitlines()[:saved]
    resumed = launch_command(*args, "run.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert (out / "metrics.jsonl").read_text().splitlines()[:saved] == kept
    assert [m["round"] for m in metrics(out)] == list(range(1, 11)) and (out / "final.pt").exists()


def stopped_after_round_2(cmd: list[str], out, signum: int, env=None) -> tuple[int, str, float]:
    """``cmd``'s run sent ``signum`` once the checkpoint of round 2 is complete: (its exit
    status, its stderr, the seconds it took to stop)."""
    log = open(out.parent / "stopped.log", "w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, cwd=REPO, env=env)
    try:
        wait_for_rounds(out, 3, proc, log)
        sent = time.monotonic()
        proc.send_signal(signum)
        status = proc.wait(timeout=60)
        stopping = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    return status, log.read(), stopping


def ranks_of(out) -> list[int]:
    """Processes still running with ``out`` on their command line: a rank left behind."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if f"run.out_dir={out}".encode() in fh.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


# -- the parts, without a process -----------------------------------------------------------------

def test_status_records_are_read_back_lowest_order_first(tmp_path):
    """What the ranks left (fedddp.env.write_status), read back the way fedddp.launch and
    fedddp.slurm take the run's line: a relay of another rank's error comes after that rank's."""
    path = tmp_path / "status"
    environ = {env.STATUS_FILE_VAR: str(path)}
    assert env.read_status(str(path)) == []
    env.write_status(3, "fedddp: error: relayed", 0 + 2, environ)
    env.write_status(3, "fedddp: error: rank 1's\nfile", 1, environ)
    with open(path, "a") as fh:
        fh.write("not a record\n")
    assert env.read_status(str(path)) == [(3, 1, "fedddp: error: rank 1's file"), (3, 2, "fedddp: error: relayed")]


def test_the_ranks_command_is_torchruns_standalone_one(monkeypatch):
    args = launch.parse_args([QUICKSTART, "run.rounds=3", "--nproc", "3", "run.seed=1", "--max-restarts", "1"])
    assert (args.config, args.overrides, args.nproc, args.max_restarts, args.check) == \
        (QUICKSTART, ["run.rounds=3", "run.seed=1"], 3, 1, True)
    parsed = launch.torchrun.parse_args(launch.torchrun_argv(args, 3))
    assert (parsed.nproc_per_node, parsed.max_restarts, parsed.rdzv_backend, parsed.rdzv_endpoint) == \
        ("3", 1, "c10d", "localhost:0")
    assert parsed.module and [parsed.training_script, *parsed.training_script_args] == \
        ["fedddp", QUICKSTART, "run.rounds=3", "run.seed=1"]
    monkeypatch.setattr(launch.torch.cuda, "device_count", lambda: 0)
    assert launch.default_nproc() == 2
    monkeypatch.setattr(launch.torch.cuda, "device_count", lambda: 4)
    assert launch.default_nproc() == 4


@pytest.mark.parametrize("argv", [[QUICKSTART, "--nproc", "0"], [QUICKSTART, "--max-restarts", "-1"], []])
def test_launcher_flags_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        launch.parse_args(argv)
    assert exc.value.code == 2 and capsys.readouterr().err.splitlines()[-1].startswith(f"{launch.PROG}: error: ")


def test_a_signal_raises_once_as_the_agent_expects():
    """Before the ranks start a signal ends the check (Stopped: not an Exception, which a user's
    code wrapped by the check would take); after, it is the agent's SignalException, which stops
    the ranks: with SIGTERM for SIGINT, so that no rank prints a line of its own (fedddp:
    interrupted). A second signal is left to the stop under way."""
    stop = launch.Stop()
    with pytest.raises(launch.Stopped) as before:
        stop(signal.SIGTERM, None)
    assert before.value.signum == signal.SIGTERM and not isinstance(before.value, Exception)
    stop = launch.Stop()
    stop.launched = True
    with pytest.raises(launch.SignalException) as after:
        stop(signal.SIGINT, None)
    assert after.value.sigval == signal.SIGTERM and stop.signum == signal.SIGINT
    assert stop(signal.SIGTERM, None) is None and stop.signum == signal.SIGINT


def test_the_stopped_line_says_how_to_continue(tmp_path):
    out = tmp_path / "out"
    said = launch.stopped_line(signal.SIGTERM, str(out))
    assert said == ("fedddp: stopped by SIGTERM before its first checkpoint (run.ckpt_every); the same "
                    "command with run.resume=true starts over")
    assert launch.stopped_line(signal.SIGINT, None) == \
        "fedddp: stopped by SIGINT; the same command with run.resume=true continues from the last checkpoint"
    before = launch.stopped_line(signal.SIGHUP, None, started=False)
    assert before == "fedddp: stopped by SIGHUP before any rank started"


def failure(rank: int, exitcode: int, timestamp: int):
    found = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="<N/A>")
    found.timestamp = timestamp
    return found


def test_a_failure_no_rank_explained_is_one_line():
    """The first rank to fail (torch's root cause), and how."""
    exc = launch.ChildFailedError("fedddp", {0: failure(0, -15, 3), 1: failure(1, -9, 2)})
    assert launch.failed_line(exc) == "fedddp: error: rank 1 was killed by SIGKILL"
    exc = launch.ChildFailedError("fedddp", {0: failure(0, 1, 1)})
    assert launch.failed_line(exc) == "fedddp: error: rank 0 exited with status 1"


def test_the_readme_quickstart_runs_the_launcher():
    """The README's Quick start block (read as .ci/run reads it: two commands, one a line) starts
    the quickstart through fedddp.launch, whose end is fedddp's, not torchrun's."""
    lines, block, inside = open(os.path.join(REPO, "README.md")).read().splitlines(), [], None
    for line in lines[lines.index("## Quick start"):]:
        if inside is None and line.startswith("```bash"):
            inside = True
        elif inside and line.startswith("```"):
            break
        elif inside and line.strip():
            block.append(line)
    assert len(block) == 2 and block[1] == 'pip install -e ".[test]" && python -m pytest -q tests', block
    assert block[0] == "pip install -e . && python -m fedddp.launch --nproc 2 configs/quickstart.toml", block


@pytest.mark.processes
def test_ctrl_c_to_a_plain_run_says_how_to_continue(tmp_path):
    """``python -m fedddp`` without the launcher, interrupted (Ctrl-C) after a checkpoint: one line
    naming the round the same command with run.resume=true continues from, exit 130."""
    out = tmp_path / "out"
    status, text, _ = stopped_after_round_2([sys.executable, "-m", "fedddp", QUICKSTART, *QUIET, *SLOW,
                                             f"run.out_dir={out}"], out, signal.SIGINT)
    saved = int((out / "checkpoints" / "LATEST").read_text().split("_")[1])
    assert status == 130 and text.strip().splitlines() == [
        f"fedddp: interrupted; the same command with run.resume=true continues from the checkpoint of round {saved}"], text
