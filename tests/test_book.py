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
    proc = subprocess.run([sys.executable, "-m", "fedddp", *args, QUICKSTART, "run.rounds=1",
                           f"run.out_dir={tmp_path}"], capture_output=True, text=True, cwd=REPO, env=env,
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
