"""fedddp.study.sweep: axes from the [sweep] table and the command line, one folder per combination named
by its values (portable names: key-value_key-value); a rerun skips finished runs, resumes unfinished
ones (also in folders of older names) and refuses a folder that holds a run with other settings;
--ranks runs through torchrun; --slurm submits a job array, --slurm --dry-run prints it."""

import dataclasses
import glob
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from fedddp import checks, config
from fedddp.study import sweep
from fedddp.errors import ConfigError
from fedrun import REPO, assert_same_state, descendants, final_state, metrics, run_here, wait_for_rounds

SWEEP_FILE = """
[run]
rounds = 3
clients_per_round = 2
eval_every = 1
ckpt_every = 1
progress = false

[data]
num_clients = 8

[sweep]
run.seed = [0, 1, 2]
"""


def write_sweep(tmp_path, text=SWEEP_FILE):
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return str(path)


def test_axes_from_file_and_command_line_expand_to_named_folders(tmp_path):
    path = write_sweep(tmp_path, SWEEP_FILE + '"data.partition+data.dirichlet_alpha" = [["iid", 0.3], '
                                              '["dirichlet", 0.7]]\nalgorithm.name = ["fedavg"]\n')
    raw, file_axes = sweep.read_sweep_file(path)
    assert "sweep" not in raw and raw["run"]["rounds"] == 3
    axes = sweep.merge_axes(file_axes, sweep.cli_axes(["algorithm.name=fedavg,fedmom", "data.seed=0,1"]))
    points = sweep.expand(axes, "out")
    assert len(points) == 3 * 2 * 2 * 2
    # the first axis varies slowest; the command line replaced the file's algorithm.name axis
    assert points[0].name == "run.seed-0_partition-iid_dirichlet_alpha-0.3_name-fedavg_data.seed-0"
    assert points[1].overrides == ["run.seed=0", "data.partition=iid", "data.dirichlet_alpha=0.3",
                                   "algorithm.name=fedavg", "data.seed=1"]
    assert points[-1].out_dir == os.path.join("out", "run.seed-2_partition-dirichlet_dirichlet_alpha-0.7_"
                                                     "name-fedmom_data.seed-1")
    assert len({p.name for p in points}) == len(points)
    with pytest.raises(ConfigError, match="run.out_dir: set by the sweep"):
        sweep.cli_axes(["run.out_dir=a,b"])
    with pytest.raises(ConfigError, match="run.seed: varied by two axes"):
        sweep.merge_axes([], sweep.cli_axes(["run.seed=0,1", "run.seed+data.seed=0+0"]))
    with pytest.raises(ConfigError, match="each value is a list of 2"):
        sweep.axis_from("data.partition+data.dirichlet_alpha", ["iid"], "sweep.")


def test_folder_names_are_portable_and_leave_out_single_valued_axes():
    """Guards names that broke Windows, scp and make (name=fedmom,seed=2; a plugin's module:attr):
    only letters, digits and . _ + - remain, and an axis of one value names nothing."""
    axes = sweep.cli_axes(["algorithm.name=fedavg,examples.my_plugin:TRIMMED_MEAN", "run.seed=2",
                           "data.path=a b/c.npz,d", "train.lr=0.1,1e-05"])
    names = [p.name for p in sweep.expand(axes, "out")]
    assert names[:2] == ["name-fedavg_path-a_b_c.npz_lr-0.1", "name-fedavg_path-a_b_c.npz_lr-1e-05"]
    assert names[-1] == "name-examples.my_plugin.TRIMMED_MEAN_path-d_lr-1e-05"
    assert all(set(n) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+-") for n in names)
    assert [p.name for p in sweep.expand(sweep.cli_axes(["run.seed=2"]), "out")] == ["run"]
    assert "run.seed=2" in sweep.expand(axes, "out")[0].overrides  # still set, just not in the name


def test_a_rerun_continues_runs_in_folders_of_older_names(tmp_path, capsys):
    """A sweep run before the names changed (name=fedavg,seed=0), or with an axis of one value
    then (its folder named without it), is found by its settings: finished runs skipped, the
    others resumed where they are; a folder with other settings is not taken."""
    path, out = write_sweep(tmp_path, SWEEP_FILE + 'algorithm.name = ["fedavg", "fedmom"]\n'), tmp_path / "out"
    _, _, points = sweep.plan(path, [], str(out))
    by_overrides = {tuple(p.overrides): p for p in points}
    for old, overrides, state in (("name=fedavg,seed=0", ("run.seed=0", "algorithm.name=fedavg"), "final.pt"),
                                  ("seed=1", ("run.seed=1", "algorithm.name=fedavg"), "checkpoints"),
                                  ("name=fedmom,seed=2", ("run.seed=2", "algorithm.name=fedavg"), "final.pt")):
        cfg = by_overrides[overrides].cfg
        if old == "name=fedmom,seed=2":
            cfg = by_overrides[("run.seed=2", "algorithm.name=fedmom")].cfg
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, rounds=4))  # other settings: not this sweep's run
        (out / old).mkdir(parents=True)
        (out / old / "config.toml").write_text(config.dumps(cfg))
        (out / old / state).mkdir() if state == "checkpoints" else (out / old / state).touch()
    listing = sweep_here(capsys, path, "--out", str(out), "--dry-run")
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.splitlines()[:6] == [
        f"done    {out / 'name=fedavg,seed=0'}  run.seed=0 algorithm.name=fedavg",
        f"new     {out / 'seed-0_name-fedmom'}  run.seed=0 algorithm.name=fedmom",
        f"resume  {out / 'seed=1'}  run.seed=1 algorithm.name=fedavg",
        f"new     {out / 'seed-1_name-fedmom'}  run.seed=1 algorithm.name=fedmom",
        f"new     {out / 'seed-2_name-fedavg'}  run.seed=2 algorithm.name=fedavg",
        f"new     {out / 'seed-2_name-fedmom'}  run.seed=2 algorithm.name=fedmom"]
    assert listing.stderr == ("fedddp.study.sweep: 2 combination(s) continue in existing run folders of other names "
                              "that hold their settings (e.g. name=fedavg,seed=0: an older naming, or an axis "
                              "that had one value)\n")
    resumed = next(p for p in sweep.plan(path, [], str(out))[2] if p.status == "resume")
    assert sweep.run_argv(str(out / "base.toml"), resumed)[-2:] == [f"run.out_dir={out / 'seed=1'}", "run.resume=true"]


def test_a_sweep_submitted_in_parts_keeps_each_part_in_its_own_folder(tmp_path):
    """run.seed=0, then run.seed=1: each part's seed is one value, left out of the names, so the
    second part's name-fedavg holds the first's run; it goes to seed-1_name-fedavg (every axis)
    instead of being refused, and the whole sweep later finds both."""
    path, out = write_sweep(tmp_path, SWEEP_FILE + 'algorithm.name = ["fedavg", "fedmom"]\n'), tmp_path / "out"

    def make(folder, cfg):
        (out / folder).mkdir(parents=True)
        (out / folder / "config.toml").write_text(config.dumps(cfg))
        (out / folder / "final.pt").touch()

    first = sweep.plan(path, ["run.seed=0"], str(out))[2]
    assert [p.name for p in first] == ["name-fedavg", "name-fedmom"]
    for point in first:
        make(point.name, point.cfg)
    second = sweep.plan(path, ["run.seed=1"], str(out))[2]
    assert [(p.name, p.status, p.moved) for p in second] == [("seed-1_name-fedavg", "new", "full"),
                                                             ("seed-1_name-fedmom", "new", "full")]
    for point in second:
        make(point.name, point.cfg)
    whole = sweep.plan(path, [], str(out))[2]
    assert [(p.name, p.status) for p in whole] == [
        ("name-fedavg", "done"), ("name-fedmom", "done"), ("seed-1_name-fedavg", "done"),
        ("seed-1_name-fedmom", "done"), ("seed-2_name-fedavg", "new"), ("seed-2_name-fedmom", "new")]


def test_slurm_dry_run_prints_the_job_array_and_submits_nothing(tmp_path, monkeypatch, capsys):
    from test_launch import no_submitting

    no_submitting(monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    path, out = write_sweep(tmp_path), tmp_path / "out"
    shown = sweep_here(capsys, path, "--out", str(out), "--slurm", "--dry-run", "--ranks", "2", "--partition", "P",
                       "--time", "30", "--output", str(tmp_path / "submitit" / "%j"))
    assert shown.returncode == 0, shown.stderr
    assert "would submit a job array of 3 tasks to Slurm through submitit" in shown.stdout
    assert f"array task 2 runs: python -m fedddp {out / 'base.toml'} run.seed=2 run.out_dir={out / 'seed-2'}" in shown.stdout
    for line in ("#SBATCH --array=0-2%3", "#SBATCH --ntasks-per-node=2", "#SBATCH --partition=P", "#SBATCH --time=30"):
        assert line + "\n" in shown.stdout, line
    assert not out.exists() and not (tmp_path / "submitit").exists()


def test_a_sweep_file_run_directly_says_how_to_run_it(tmp_path):
    with pytest.raises(ConfigError, match="python -m fedddp.study.sweep"):
        checks.load(write_sweep(tmp_path))


@pytest.mark.processes
def test_bad_combination_is_one_line_naming_it_and_the_file(tmp_path):
    path = write_sweep(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "fedddp.study.sweep", path, "run.rounds=2,0", "--dry-run",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "combination seed-0_rounds-0" in proc.stderr and path in proc.stderr
    assert "run.rounds: must be > 0" in proc.stderr and not (tmp_path / "out").exists()


def test_gpu_slots_are_disjoint(monkeypatch):
    point = sweep.Point("a", [], "out", cfg=checks.load(None, ["run.device=cuda"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert sweep.gpu_slots([point], 2, 2) == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert sweep.gpu_slots([point], 4, 1)[3] == {"CUDA_VISIBLE_DEVICES": "7"}
    with pytest.raises(ConfigError, match="needs 6 GPUs, 4 visible"):
        sweep.gpu_slots([point], 3, 2)
    assert sweep.launcher(2)[1:4] == ["-m", "torch.distributed.run", "--standalone"]


def run_sweep(*args):
    return subprocess.run([sys.executable, "-m", "fedddp.study.sweep", *args], capture_output=True, text=True,
                          cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))


def sweep_here(capsys, *args):
    """``python -m fedddp.study.sweep ARGS`` in this process (what it runs: sweep.main), for the
    invocations that start no run (--dry-run): its status and output, as run_sweep gives them."""
    capsys.readouterr()
    status = sweep.main(list(args))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=status, stdout=out.out, stderr=out.err)


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_rerun_skips_finished_resumes_unfinished_and_refuses_other_settings(tmp_path, capsys):
    path, out = write_sweep(tmp_path), tmp_path / "out"
    # the command line narrows the axis to one value, which names no folder: out/run
    first = run_sweep(path, "run.seed=0", "--out", str(out))
    assert first.returncode == 0, first.stderr
    finished = out / "run" / "final.pt"
    stamp = finished.stat().st_mtime_ns
    # seed 1 stopped after round 1 with a checkpoint: unfinished
    run_here([f"run.out_dir={out / 'seed-1'}", "run.seed=1", "run.stop_after=1"], config=str(out / "base.toml"))
    assert not (out / "seed-1" / "final.pt").exists()

    listing = sweep_here(capsys, path, "--out", str(out), "--dry-run")
    assert listing.returncode == 0, listing.stderr
    assert [line.split()[0] for line in listing.stdout.splitlines()[:3]] == ["done", "resume", "new"]

    second = run_sweep(path, "--out", str(out), "--parallel", "2")
    assert second.returncode == 0, second.stderr
    assert finished.stat().st_mtime_ns == stamp  # skipped (found in out/run by its settings), not rerun
    assert not (out / "seed-0").exists() and "1 combination(s) continue in existing run folders" in second.stderr
    assert "run.resume=true" in (out / "logs" / "seed-1.log").read_text().splitlines()[0]  # its command
    assert "run.resume=true" not in (out / "logs" / "seed-2.log").read_text()
    invocations = (out / "logs" / "sweep.log").read_text().splitlines()
    assert len(invocations) == 2 and " commit " in invocations[1]
    assert invocations[1].endswith(f"python -m fedddp.study.sweep {path} --out {out} --parallel 2")
    for seed in (1, 2):
        assert (out / f"seed-{seed}" / "final.pt").exists()
        assert [row["round"] for row in metrics(out / f"seed-{seed}")] == [1, 2, 3]

    # --ranks 2: through torchrun, and bitwise the run of one rank
    ranked = run_sweep(path, "run.seed=0", "--ranks", "2", "--out", str(tmp_path / "ranked"))
    assert ranked.returncode == 0, ranked.stderr
    assert "--nproc_per_node=2" in (tmp_path / "ranked" / "logs" / "run.log").read_text()
    assert_same_state(final_state(tmp_path / "ranked" / "run"), final_state(out / "run"))

    (tmp_path / "sweep.toml").write_text(SWEEP_FILE.replace("num_clients = 8", "num_clients = 9"))
    refused = sweep_here(capsys, path, "--out", str(out), "--dry-run")
    assert refused.returncode == 2 and "holds a run with other settings (data.num_clients: 8 there, 9 here)" \
        in refused.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.processes
def test_sigterm_stops_the_sweep_and_its_running_run(tmp_path):
    """Regression: a sweep sent SIGTERM ended alone and left its running run going in the
    background, holding its folder's lock, so rerunning the sweep failed that run with exit 2
    "in use by another run". The sweep now passes the signal on, waits for the run to end and
    exits 143; the rerun then resumes the run."""
    # rounds slow enough (an MLP, 2 local epochs, 10 clients) that the run is mid-way when signalled
    path = write_sweep(tmp_path, SWEEP_FILE.replace("rounds = 3", "rounds = 5").replace(
        "clients_per_round = 2", "clients_per_round = 8") + "[model]\nname = 'mlp'\nhidden = 128\n"
        "[train]\nlocal_epochs = 2\n")
    out, log = tmp_path / "out", open(tmp_path / "sweep.out", "w+")
    cmd = [sys.executable, "-m", "fedddp.study.sweep", path, "run.seed=0", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    runs = []
    try:
        wait_for_rounds(out / "run", 1, proc, log)
        runs = descendants(proc.pid)
        assert runs
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=120)
        left = [pid for pid in runs if _alive(pid)]
    finally:  # nothing of the test outlives it, whatever failed
        for pid in runs:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    text = log.read()
    assert status == 143 and not left, (status, left, text[-3000:])
    assert "fedddp.study.sweep: stopped by SIGTERM" in text and "stopped run" in text, text[-3000:]
    assert not (out / "run" / "final.pt").exists()
    again = run_sweep(path, "run.seed=0", "--out", str(out))
    assert again.returncode == 0, again.stdout + again.stderr
    assert [row["round"] for row in metrics(out / "run")] == list(range(1, 6))


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_slurm_job_array_through_submitits_local_executor(tmp_path, monkeypatch):
    """One single-rank task per combination. Also guards a crash of a one-rank distributed run
    (a submitit task or torchrun --nproc_per_node=1): rank 0 gathered into a buffer it never made."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the LocalExecutor copies this environment
    path, out = write_sweep(tmp_path), tmp_path / "out"
    # the axis after a launcher flag still narrows the sweep (argparse hands it to the launcher's parser)
    assert sweep.main([path, "--out", str(out), "--slurm", "--local", "--gpus-per-node", "0", "--time", "10",
                       "run.seed=0,1", "--output", str(tmp_path / "submitit" / "%j")]) == 0
    deadline = time.monotonic() + 300
    while not all((out / f"seed-{s}" / "final.pt").exists() for s in (0, 1)):
        errors = "".join(p.read_text() for p in (tmp_path / "submitit").rglob("*.err"))
        assert "Traceback" not in errors, errors[-3000:]
        assert time.monotonic() < deadline, errors[-3000:]
        time.sleep(1)
    assert [row["round"] for row in metrics(out / "seed-1")] == [1, 2, 3]
    assert sorted(os.listdir(out)) == ["base.toml", "logs", "seed-0", "seed-1"]  # logs/sweep.log: provenance


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "sweeps", "*.toml"))),
                         ids=os.path.basename)
def test_paper_sweep_files_are_headed_and_every_combination_is_valid(path, tmp_path):
    with open(path) as fh:
        header = [line for line in fh if line.startswith("#")]
    for field in ("# Paper:", "# Hardware:", "python -m fedddp.study.sweep " + os.path.relpath(path, REPO)):
        assert any(field in line for line in header), f"{path}: header lacks {field!r}"
    assert any(line.startswith(("# Table:", "# Figure:")) for line in header)
    _, _, points = sweep.plan(path, [], str(tmp_path))
    assert len(points) > 1 and all(p.status == "new" for p in points)


def test_a_tuned_plugin_rule_is_swept_against_fedavg_in_one_file(tmp_path):
    """Parameters belong to their rule: [algorithm.params."module:RULE"] is ignored by fedavg, so
    one sweep file runs the tuned plugin and the baseline side by side, and an axis may tune it."""
    rule = "examples.my_plugin:TRIMMED_MEAN"
    path = tmp_path / "sweep.toml"
    path.write_text(
        '[run]\nrounds = 2\n[data]\nname = "examples.my_plugin:blobs"\nnum_clients = 12\npartition = "natural"\n'
        '[model]\nname = "examples.my_plugin:SmallCNN"\n[algorithm]\nlocal = "examples.my_plugin:ClippedSGD"\n'
        f'[algorithm.params."{rule}"]\ntrim = 0.2\n[algorithm.params."examples.my_plugin:ClippedSGD"]\nclip = 5.0\n'
        f'[sweep]\n"algorithm.name" = ["fedavg", "{rule}"]\n')
    _, _, points = sweep.plan(str(path), [], str(tmp_path / "out"))
    assert [p.cfg.algorithm.params for p in points] == [{"clip": 5.0}, {"trim": 0.2, "clip": 5.0}]
    _, _, points = sweep.plan(str(path), [f"algorithm.params.{rule}.trim=0.1,0.3"], str(tmp_path / "out2"))
    assert sorted((p.cfg.algorithm.name, p.cfg.algorithm.params.get("trim")) for p in points) == [
        ("examples.my_plugin:TRIMMED_MEAN", 0.1), ("examples.my_plugin:TRIMMED_MEAN", 0.3),
        ("fedavg", None), ("fedavg", None)]
