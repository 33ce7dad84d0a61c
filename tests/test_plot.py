"""python -m fedddp.study.plot draws runs' metrics and names a missing metric."""

import subprocess
import sys

import pytest

from fedrun import REPO, run_here

pytest.importorskip("matplotlib")


@pytest.mark.processes
@pytest.mark.e2e
def test_plot_two_runs(tmp_path):
    for name in ("fedavg", "fedmom"):
        run_here([f"algorithm.name={name}", "run.rounds=3", "run.eval_every=1",
                  f"run.out_dir={tmp_path / name}"])
    out = tmp_path / "cmp.png"
    proc = subprocess.run([sys.executable, "-m", "fedddp.study.plot", str(tmp_path / "fedavg"),
                           str(tmp_path / "fedmom"), "--out", str(out)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "fedddp.study.plot", str(tmp_path / "fedavg"), "--metric", "nope",
                          "--out", str(out)], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "no run has values of 'nope'" in bad.stderr and "test_accuracy" in bad.stderr
