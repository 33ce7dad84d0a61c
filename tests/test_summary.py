"""fedddp.study.summary groups runs by the keys that differ (seeds left out) and gives mean +- sample
std (n); fedddp.study.plot --group-by draws the same groups. Runs are written by hand here (config.toml
as the runtime writes it, metrics.jsonl rows), so the statistics are checked against known numbers."""

import json
import os
import statistics
import subprocess
import sys

import pytest

from fedddp import config
from fedddp.study import summary
from fedrun import REPO


def fake_run(folder, accuracies, finished=True, eval_every=1, **keys):
    """A run folder whose test_accuracy at round r is accuracies[r - 1] (None: not evaluated)."""
    sections = {}
    for dotted, value in {**keys, "run__out_dir": str(folder)}.items():
        section, key = dotted.split("__")
        sections.setdefault(section, {})[key] = value
    cfg = config.Config(**{section: config.SECTIONS[section](**values) for section, values in sections.items()})
    os.makedirs(folder)
    with open(os.path.join(folder, "config.toml"), "w") as fh:
        fh.write(config.dumps(cfg))
    with open(os.path.join(folder, "metrics.jsonl"), "w") as fh:
        for r, acc in enumerate(accuracies, 1):
            fh.write(json.dumps({"round": r, "train_loss": 1.0 / r, "test_loss": None if acc is None else 1 - acc,
                                 "test_accuracy": acc}) + "\n")
    if finished:
        open(os.path.join(folder, "final.pt"), "wb").close()


@pytest.fixture
def sweep(tmp_path):
    """2 algorithms x 3 run seeds, plus a data seed and a progress flag that must not split groups."""
    root = tmp_path / "sweep"
    table = {"fedavg": [[0.5, 0.60], [0.5, 0.62], [0.5, 0.64]],
             "fedmom": [[0.4, 0.70], [0.6, 0.71], [0.5, 0.75]]}
    for name, per_seed in table.items():
        for seed, accs in zip((0, 13, 42), per_seed):
            fake_run(root / f"name={name},seed={seed}", accs, algorithm__name=name, run__seed=seed,
                     data__seed=seed % 2, run__progress=seed == 0)
    return root, table


def test_groups_by_the_differing_keys_and_gives_mean_and_sample_std(sweep):
    root, table = sweep
    runs = summary.usable(summary.find_runs([str(root)]), ["test_accuracy"], print)
    keys = summary.differing_keys(runs)
    assert keys == ["algorithm.name"]  # not run.seed, data.seed or run.progress
    rows = summary.summarise(runs, ["test_accuracy"], "last", keys)
    assert [r["algorithm.name"] for r in rows] == ["fedavg", "fedmom"]
    for row in rows:
        last = [accs[-1] for accs in table[row["algorithm.name"]]]
        mean, std, n = row["test_accuracy"]
        assert n == 3
        assert mean == pytest.approx(statistics.mean(last)) and std == pytest.approx(statistics.stdev(last))
    best = summary.summarise(runs, ["test_loss"], "best", keys)  # a loss: best is the lowest
    assert best[1]["test_loss"][0] == pytest.approx(statistics.mean([0.30, 0.29, 0.25]))
    mean_last_2 = summary.summarise(runs, ["test_accuracy"], "mean-last-2", keys)
    assert mean_last_2[0]["test_accuracy"][0] == pytest.approx(statistics.mean([0.55, 0.56, 0.57]))
    round_2 = summary.summarise(runs, ["test_accuracy"], "rounds-2-5", keys)  # rounds past the end: none
    assert round_2[1]["test_accuracy"][0] == pytest.approx(statistics.mean([0.70, 0.71, 0.75]))
    assert summary.usable(runs, ["test_accuracy"], print, "rounds-3-4") == []


def test_rows_in_numeric_order_baselines_named_constant_columns_dropped_and_one_run_has_no_std(tmp_path):
    """Guards four frictions of a first table: eta sorted as text (0.01, 0.1, 0.003, 0.03); the
    fedavg baseline's eta cell None; a column the same in every row; a std of 0.0000 from one run."""
    for eta in (0.1, 0.01, 0.003, 0.03):
        for seed in (0, 1):
            fake_run(tmp_path / f"eta{eta}_s{seed}", [0.5, 0.6 + eta + seed / 100], algorithm__name="fedadam",
                     algorithm__params={"eta": eta}, run__seed=seed)
    fake_run(tmp_path / "fedavg", [0.5, 0.6], algorithm__name="fedavg")
    runs = summary.find_runs([str(tmp_path)])
    keys = summary.differing_keys(runs)
    assert keys == ["algorithm.name", "algorithm.params.eta"]
    table = summary.format_table(summary.summarise(runs, ["test_accuracy"], "last", keys), keys, ["test_accuracy"],
                                 "last", "md").splitlines()
    assert table[:3] == ["| algorithm.name | algorithm.params.eta | test_accuracy (last) |", "|---|---|---|",
                         "| fedadam | 0.003 | 0.6080 ± 0.0071 (2) |"]
    assert [line.split(" | ")[1] for line in table[2:]] == ["0.003", "0.01", "0.03", "0.1", ""]  # blank: fedavg's
    assert table[-1] == "| fedavg |  | 0.6000 ± n/a (1) |"
    by_eta = summary.summarise(runs, ["test_accuracy"], "last", ["algorithm.params.eta"])
    assert [row["algorithm.params.eta"] for row in by_eta] == [0.003, 0.01, 0.03, 0.1, "fedavg"]  # the rule's name
    csv_rows = summary.format_table(by_eta, ["algorithm.params.eta"], ["test_accuracy"], "last", "csv").splitlines()
    assert csv_rows[-1] == "fedavg,0.6,,1"  # one run: no std, an empty cell
    tuned = [r for r in runs if r.config["algorithm.name"] == "fedadam"]
    both = ["algorithm.name", "algorithm.params.eta"]
    table = summary.format_table(summary.summarise(tuned, ["test_accuracy"], "last", both), both,
                                 ["test_accuracy"], "last", "md").splitlines()
    assert table[0] == "| algorithm.params.eta | test_accuracy (last) |"
    assert table[-1] == "Every row: algorithm.name = fedadam."


@pytest.mark.processes
def test_cli_tables_skip_unfinished_and_metricless_runs(sweep, tmp_path):
    root, _ = sweep
    fake_run(root / "unfinished", [0.1], finished=False, algorithm__name="fedavg")
    fake_run(root / "never_evaluated", [None, None], algorithm__name="fedavg")
    proc = subprocess.run([sys.executable, "-m", "fedddp.study.summary", str(root), "--by", "algorithm.name"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "| algorithm.name | test_accuracy (last) |"
    assert lines[2] == "| fedavg | 0.6200 ± 0.0200 (3) |"
    assert "unfinished (no final.pt)" in proc.stderr and "never_evaluated: no values of test_accuracy" in proc.stderr
    csv_out = subprocess.run([sys.executable, "-m", "fedddp.study.summary", str(root), "--format", "csv",
                              "--metric", "test_accuracy,test_loss"], capture_output=True, text=True, cwd=REPO)
    header, first = csv_out.stdout.splitlines()[:2]
    assert header == "algorithm.name,test_accuracy_mean,test_accuracy_std,test_accuracy_n,test_loss_mean," \
                     "test_loss_std,test_loss_n"
    assert first.startswith("fedavg,0.62") and first.endswith(",3")
    by_name = subprocess.run([sys.executable, "-m", "fedddp.study.summary", str(root), "--by", "name"],
                             capture_output=True, text=True, cwd=REPO)  # only algorithm.name varies
    assert by_name.stdout == proc.stdout
    bad = subprocess.run([sys.executable, "-m", "fedddp.study.summary", str(root), "--by", "seed"],
                         capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "'seed' matches run.seed, data.seed" in bad.stderr and "Traceback" not in bad.stderr


def test_plot_group_curve_is_mean_and_std_over_rounds_all_runs_have(tmp_path):
    from fedddp.study import plot
    fake_run(tmp_path / "a", [0.1, None, 0.3, 0.4], algorithm__name="fedavg", run__seed=0)
    fake_run(tmp_path / "b", [0.3, None, 0.5], finished=False, algorithm__name="fedavg", run__seed=1)
    fake_run(tmp_path / "c", [0.9, 0.9, 0.9], algorithm__name="fedmom", run__seed=0)
    fake_run(tmp_path / "d", [None], algorithm__name="fedmom", run__seed=1)
    skipped = []
    lines = plot.curves(summary.find_runs([str(tmp_path)]), "test_accuracy", "auto", skipped.append)
    assert len(skipped) == 1 and "d: no values of test_accuracy" in skipped[0]
    (label_a, rounds_a, mean_a, std_a), (label_c, rounds_c, mean_c, std_c) = lines
    assert label_a == "name=fedavg (n=2)" and rounds_a == [1, 3]
    assert mean_a == pytest.approx([0.2, 0.4]) and std_a == pytest.approx([statistics.stdev([0.1, 0.3])] * 2)
    assert label_c == "name=fedmom (n=1)" and std_c == [0.0, 0.0, 0.0]


@pytest.mark.processes
def test_plot_cli_groups_and_skips_a_run_without_the_metric(tmp_path):
    pytest.importorskip("matplotlib")
    fake_run(tmp_path / "runs" / "a", [0.1, 0.2], algorithm__name="fedavg", run__seed=0)
    fake_run(tmp_path / "runs" / "b", [0.2, 0.3], algorithm__name="fedavg", run__seed=1)
    fake_run(tmp_path / "runs" / "c", [None, None], algorithm__name="fedmom")
    out = tmp_path / "g.png"
    proc = subprocess.run([sys.executable, "-m", "fedddp.study.plot", str(tmp_path / "runs"), "--group-by",
                           "algorithm.name", "--out", str(out)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert proc.stderr.count("skipped") == 1 and "c: no values of test_accuracy" in proc.stderr


def timed_run(folder, points, mode):
    """A run whose metrics.jsonl rows are (sim_time_s, test_accuracy or None), one per round."""
    os.makedirs(folder)
    cfg = config.Config(run=config.RunConfig(mode=mode, out_dir=str(folder)))
    with open(os.path.join(folder, "config.toml"), "w") as fh:
        fh.write(config.dumps(cfg))
    with open(os.path.join(folder, "metrics.jsonl"), "w") as fh:
        for r, (t, acc) in enumerate(points, 1):
            fh.write(json.dumps({"round": r, "test_accuracy": acc, "sim_time_s": t}) + "\n")
    open(os.path.join(folder, "final.pt"), "wb").close()


def test_at_a_simulated_time(tmp_path):
    """time-T: each run's last evaluated value at simulated time <= T; a run whose clock ends
    before T has none (left out with one line); plot --x sim_time_s steps through the same values."""
    from fedddp.study import plot

    timed_run(tmp_path / "sync", [(10.0, 0.2), (20.0, 0.4), (30.0, 0.5)], "sync")
    timed_run(tmp_path / "async", [(4.0, 0.1), (8.0, None), (12.0, 0.45), (16.0, 0.5), (33.0, 0.7)], "async")
    runs = summary.find_runs([str(tmp_path)])
    assert [summary.value_of(r, "test_accuracy", "time-15") for r in runs] == [0.45, 0.2]
    assert [summary.value_of(r, "test_accuracy", "time-8.5") for r in runs] == [0.1, None]
    assert summary.value_of(runs[1], "test_accuracy", "time-31") is None  # the sync clock ended at 30
    warned = []
    assert [r.folder for r in summary.usable(runs, ["test_accuracy"], warned.append, "time-31")] == [runs[0].folder]
    assert "by simulated time 31" in warned[0]
    rows = summary.summarise(runs, ["test_accuracy"], "time-20", ["run.mode"])
    assert [(r["run.mode"], r["test_accuracy"][0]) for r in rows] == [("async", 0.5), ("sync", 0.4)]
    with pytest.raises(summary.ConfigError, match="time-T"):
        summary.parse_at("time-")
    x, mean, std = plot.group_curve(runs, "test_accuracy", x="sim_time_s")
    assert x == [10.0, 12.0, 16.0, 20.0, 30.0]
    assert mean == pytest.approx([0.15, 0.325, 0.35, 0.45, 0.5])
    assert plot._points(runs[0], "test_accuracy", None, "sim_time_s") == ([4.0, 12.0, 16.0, 33.0], [0.1, 0.45, 0.5, 0.7])
