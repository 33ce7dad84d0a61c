"""What rank 0 says on stderr while a run goes: one short start line (its long form with
--verbose), and the progress line rewritten in place on a terminal, ended before any other
message so that none lands in the middle of it."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

import pytest

from fedddp import book, console
from fedrun import QUICKSTART, REPO


def _stderr_lines(tmp_path, *args, verbose_env: bool = False) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "FEDDDP_VERBOSE"}  # conftest sets it for the suite
    if verbose_env:
        env["FEDDDP_VERBOSE"] = "1"
    flags = [a for a in args if a.startswith("--")]
    overrides = [a for a in args if not a.startswith("--")]
    proc = subprocess.run([sys.executable, "-m", "fedddp", *flags, QUICKSTART, "run.rounds=1",
                           f"run.out_dir={tmp_path}", *overrides], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr.splitlines()


@pytest.mark.processes
def test_the_start_line_is_short_and_verbose_gives_the_long_form(tmp_path):
    """Guards the 330-character start line a user saw on every run."""
    short = _stderr_lines(tmp_path / "a")[0]
    assert short == ("fedddp: 1 rank(s) on cpu; fedavg; 10 of 30 clients a round; clients one after another "
                     "(--verbose says more)")
    for long in (_stderr_lines(tmp_path / "b", "--verbose")[0], _stderr_lines(tmp_path / "c", verbose_env=True)[0]):
        assert long.startswith("fedddp: 1 rank(s) on cpu; fedavg: plain clients, fedavg server rule, samples weights; "
                               "10 of 30 clients a round; aggregation: ") and "run.parallel_clients=auto" in long


def test_a_message_after_a_progress_line_starts_on_its_own_line(capsys):
    progress = book.Progress(3, enabled=True)
    progress.tty = True
    progress.update(1, 0, {"test_accuracy": 0.5, "train_loss": 1.0})
    console.say("fedddp: error: something")
    console.say("fedddp: and then")
    err = capsys.readouterr().err
    assert err.startswith("\rround 1/3 | acc 0.5000 | train loss 1.0000 | ")
    assert "\n" not in err.split("ETA ", 1)[0]  # the progress line itself is open
    assert err.split("\n", 1)[1] == "fedddp: error: something\nfedddp: and then\n"
    progress.update(3, 0, {"test_accuracy": 0.5, "train_loss": 1.0})  # the last round ends its own line
    console.say("fedddp: finished")
    assert capsys.readouterr().err.endswith("\nfedddp: finished\n") and not console._open


@pytest.mark.processes
def test_on_a_terminal_a_failing_round_says_so_below_the_progress_line(tmp_path):
    """A callback that raises at round 2's end, rank 0's stderr a terminal: the progress line of
    round 2 is open when the error is said."""
    (tmp_path / "boom.py").write_text("class Boom:\n    def on_round_end(self, round_idx, row, model):\n"
                                      "        if round_idx == 2:\n            raise RuntimeError('boom')\n")
    leader, follower = pty.openpty()
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-m", "fedddp", QUICKSTART, "run.rounds=4", "run.callbacks=boom:Boom",
                             f"run.out_dir={tmp_path / 'out'}"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=follower, cwd=REPO, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert proc.wait(timeout=300) == 7
    text = b"".join(chunks).decode().replace("\r\n", "\n")
    assert "\rround 2/4 |" in text, text
    error = text.index("fedddp: error:")
    assert text[error - 1] == "\n", text  # not glued to the end of "ETA 0:00"


def test_dp_start_words_weigh_the_noise_against_the_clip():
    """The docs' DP example (quickstart, C = 1, z = 1, cohort 10, 610 parameters) ended at chance
    accuracy with no hint: the noise's norm is sqrt(610) / 10 = 2.47 times the largest mean update."""
    from fedddp.strategies import dpfedavg

    params = dict(dpfedavg.PARAMS, dp_clip=1.0)
    words = dpfedavg.start_words(params, 10.0, 610)
    assert words.startswith("DP noise std 0.1 a coordinate, its norm 2.47x the clip C") and "outweighs" in words
    assert dpfedavg.start_words(dict(params, dp_clip=3.0), 10.0, 610).startswith("DP noise std 0.3 a coordinate, "
                                                                                 "its norm 2.47x")
    calm = dpfedavg.start_words(dict(params, dp_noise_cohort=1000), 10.0, 610)  # m = 1000: std 1e-3
    assert calm.startswith("DP noise std 0.001 a coordinate, its norm 0.0247x") and "outweighs" not in calm
    assert dpfedavg.start_words(dict(params, dp_noise=0.0), 10.0, 610) == ""
    # adaptive clipping: the update's multiplier z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2, sigma_b = m / 20
    z_delta = (1.0 - (2 * 100 / 20) ** -2) ** -0.5
    adaptive = dpfedavg.start_words(dict(params, dp_adaptive_quantile=0.5), 100.0, 610)
    assert adaptive.startswith(f"DP noise std {z_delta / 100:.3g} a coordinate")


@pytest.mark.processes
def test_a_dp_run_says_its_noise_against_its_clip_before_round_1(tmp_path):
    lines = _stderr_lines(tmp_path, "algorithm.name=dpfedavg", "algorithm.params.dp_clip=1.0")
    assert lines[1].startswith("fedddp: dpfedavg: DP noise std 0.1 a coordinate, its norm 2.47x the clip C"), lines
    assert not any("DP noise" in line for line in _stderr_lines(tmp_path / "plain"))
