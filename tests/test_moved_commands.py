"""The study tools' old command names (``python -m fedddp.sweep``, ``.summary``, ``.results``,
``.plot``, documented until they moved to ``fedddp.study``) still run, for one release: each runs
the new module with the same arguments and exit status and says the new name once."""

from __future__ import annotations

import importlib
import runpy
import subprocess
import sys

import pytest

from fedrun import REPO

TOOLS = ["sweep", "summary", "results", "plot"]


# runpy warns here, where an earlier test imported the new module; ``python -m`` imports it once
@pytest.mark.filterwarnings("ignore:'fedddp.study:RuntimeWarning")
@pytest.mark.parametrize("tool", TOOLS)
def test_the_old_name_runs_the_new_module_and_says_its_name_once(tool, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [f"fedddp/{tool}.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module(f"fedddp.{tool}", run_name="__main__", alter_sys=True)
    assert exit_.value.code == 0
    out, err = capsys.readouterr()
    assert "usage:" in out  # the new module's own --help
    assert err.count(f"fedddp.study.{tool}") == 1 and err.count("\n") == 1, err


@pytest.mark.parametrize("tool", TOOLS)
def test_importing_the_old_name_gives_the_new_module(tool):
    sys.modules.pop(f"fedddp.{tool}", None)
    with pytest.warns(DeprecationWarning, match=f"fedddp.study.{tool}"):
        old = importlib.import_module(f"fedddp.{tool}")
    assert old is importlib.import_module(f"fedddp.study.{tool}")


@pytest.mark.processes
def test_python_dash_m_with_the_old_name_keeps_the_exit_status():
    """A real ``python -m``: a mistake the new module refuses with 2 is refused with 2 here."""
    done = subprocess.run([sys.executable, "-m", "fedddp.summary", "/nonexistent/runs"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    new = subprocess.run([sys.executable, "-m", "fedddp.study.summary", "/nonexistent/runs"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert done.returncode == new.returncode != 0
    assert "No module named" not in done.stderr
    assert done.stderr.splitlines()[0].startswith("fedddp: `python -m fedddp.summary` is now")
    assert done.stderr.splitlines()[1:] == new.stderr.splitlines()
