"""fedddp.study.results: runs a sweep file's grid, then writes the document with the claim, the commands,
the commit, the summary table and a verdict computed from the table by the stated rule."""

import importlib.util
import os
import subprocess
import sys

import pytest

from fedddp.study import results
from fedrun import REPO

SWEEP = """\
# Paper:    a tiny stand-in for a paper.
# Claim:    server momentum beats FedAvg
#           on Synthetic(1, 1).
# Summary:  --metric test_accuracy --at last --by algorithm.name
# Summary:  --metric test_loss --at mean-last-2 --by algorithm.name
# Verdict:  name=fedmom vs name=fedavg
# Figure:   --metric test_accuracy --group-by algorithm.name

[run]
rounds = 2
out_dir = "{out}"
clients_per_round = 4
eval_every = 1
progress = false

[data]
name = "synthetic"
num_clients = 8

[model]
name = "logistic"

[sweep]
algorithm.name = ["fedavg", "fedmom"]
run.seed = [0]
"""


def call(*args):
    return subprocess.run([sys.executable, "-m", "fedddp.study.results", *args], capture_output=True, text=True,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"), timeout=300)


@pytest.mark.processes
@pytest.mark.e2e
def test_runs_the_sweep_and_writes_the_document(tmp_path):
    path, doc, out = tmp_path / "tiny.toml", tmp_path / "results.md", tmp_path / "runs"
    path.write_text(SWEEP.format(out=out))
    proc = call(str(path), "--doc", str(doc))
    assert proc.returncode == 0, proc.stderr
    text = doc.read_text()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    assert f"this document at commit {head}" in text
    assert "runs made at commit " + head in text
    assert "**Claim.** server momentum beats FedAvg on Synthetic(1, 1)." in text
    assert "seeds: run.seed 0 (n = 1)" in text
    assert f"python -m fedddp.study.summary {out} --metric test_accuracy --at last --by algorithm.name" in text
    assert "| algorithm.name | test_accuracy (last) |" in text
    assert "| algorithm.name | test_loss (mean-last-2) |" in text
    fedavg_row = next(line for line in text.splitlines() if line.startswith("| fedavg | "))
    assert fedavg_row.endswith(" ± n/a (1) |")  # one seed: no std
    assert "**Verdict rule.** A claimed method reproduces the claim when" in text
    verdicts = [line for line in text.splitlines() if line.startswith("- **")]
    # one seed: no stds (0 to the rule), so any lead counts; the line names both groups and their numbers
    assert len(verdicts) == 1 and "fedmom 0." in verdicts[0] and "vs fedavg 0." in verdicts[0]
    assert f"- tiny: {verdicts[0][2:].split(' vs ')[0]}\n" in text  # the overview at the top repeats it
    assert sorted(os.listdir(out)) == ["base.toml", "logs", "name-fedavg", "name-fedmom"]  # one seed: not named
    if importlib.util.find_spec("matplotlib") is not None:  # the figure beside the document, shown with its command
        assert (tmp_path / "figures" / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "![tiny](figures/tiny.png)" in text
        assert f"python -m fedddp.study.plot {out} --metric test_accuracy --group-by algorithm.name --out " in text

    # a second call runs nothing (the runs are finished) and writes the same tables
    again = call(str(path), "--doc", str(doc))
    assert again.returncode == 0 and "0 run(s) started" in again.stdout
    assert doc.read_text() == text


def rows(**cells):
    return [{"algorithm.name": name, "m": cell} for name, cell in cells.items()]


@pytest.mark.parametrize("metric, cells, expected", [
    ("test_accuracy", {"new": (0.90, 0.01, 3), "old": (0.85, 0.02, 3)}, "**reproduced**"),
    ("test_accuracy", {"new": (0.86, 0.02, 3), "old": (0.85, 0.01, 3)}, "(within the spread)"),
    ("test_accuracy", {"new": (0.80, 0.01, 3), "old": (0.85, 0.01, 3)}, "(behind a baseline)"),
    ("test_mae", {"new": (0.10, 0.01, 3), "old": (0.15, 0.01, 3)}, "**reproduced**"),
    ("test_mae", {"new": (0.20, 0.01, 3), "old": (0.15, 0.01, 3)}, "(behind a baseline)"),
])
def test_verdict_rule(metric, cells, expected):
    """Guards the verdict against being read off the means alone: a lead smaller than the larger
    std is not a reproduction, and for an error metric lower is better."""
    table = [{"algorithm.name": n, metric: c} for n, c in cells.items()]
    lines = results.verdict(table, ["algorithm.name"], metric, [{"name": "new"}],
                            [{"name": "old"}], 3, "test")
    assert len(lines) == 1 and lines[0].startswith(f"{expected}" if expected.startswith("**") else "**not")
    assert expected in lines[0]


def test_every_baseline_must_be_beaten():
    """Guards the several-baselines case: beating the weakest baseline is not enough."""
    table = [{"algorithm.name": n, "test_accuracy": c} for n, c in
             {"new": (0.90, 0.01, 3), "weak": (0.80, 0.01, 3), "strong": (0.895, 0.01, 3)}.items()]
    [line] = results.verdict(table, ["algorithm.name"], "test_accuracy", [{"name": "new"}],
                             [{"name": "weak"}, {"name": "strong"}], 3, "test")
    assert "(within the spread)" in line and "vs strong 0.895" in line and "1 of 2" in line


@pytest.mark.parametrize("cells, expected", [
    ({"sim": (0.865, 0.01, 3), "real": (0.87, 0.005, 3)}, "**reproduced (matches)**"),
    ({"sim": (0.84, 0.01, 3), "real": (0.87, 0.005, 3)}, "**not reproduced at this scale (differs)**"),
    ({"sim": (0.90, 0.01, 3), "real": (0.87, 0.005, 3)}, "**not reproduced at this scale (differs)**"),
])
def test_match_rule(cells, expected):
    """A match claim (a cheap run reaches what an expensive one does) holds when the means differ
    by at most the larger std, in either direction; '# Match:' is one group ~ one group."""
    table = [{"algorithm.name": n, "test_accuracy": c} for n, c in cells.items()]
    line = results.match(table, ["algorithm.name"], "test_accuracy", {"name": "sim"}, {"name": "real"}, 3, "test")
    assert line.startswith(expected) and "sim 0." in line and "~ real 0.870" in line
    assert results.parse_match("name=sim&seed=0 ~ name=real", "x") == ({"name": "sim", "seed": "0"}, {"name": "real"})
    with pytest.raises(results.ConfigError):
        results.parse_match("name=sim, name=other ~ name=real", "x")


@pytest.mark.processes
def test_header_without_a_verdict_is_one_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(SWEEP.replace("# Verdict:  name=fedmom vs name=fedavg\n", "").format(out=tmp_path / "r"))
    proc = call(str(path), "--doc", str(tmp_path / "doc.md"))
    assert proc.returncode == 2 and not (tmp_path / "r").exists()
    assert proc.stderr.count("\n") == 1 and "no '# Verdict:' line" in proc.stderr and "Traceback" not in proc.stderr
    missing = call(str(tmp_path / "nope.toml"), "--doc", str(tmp_path / "doc.md"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "nope.toml: cannot read" in missing.stderr


def test_the_hand_written_part_after_the_kept_line_survives_a_rewrite(tmp_path):
    doc = tmp_path / "results.md"
    results.write_doc([], str(doc), "abc1234", "python -m fedddp.study.results", "")
    generated = doc.read_text()
    assert results.KEPT not in generated
    tail = f"{results.KEPT}\n\n## A figure\n\n![f](figures/f.png)\n"
    doc.write_text(generated.replace("abc1234", "old") + "\n" + tail)
    results.write_doc([], str(doc), "abc1234", "python -m fedddp.study.results", "")
    assert doc.read_text() == generated + "\n" + tail
    results.write_doc([], str(doc), "abc1234", "python -m fedddp.study.results", "")  # again: the same
    assert doc.read_text() == generated + "\n" + tail
