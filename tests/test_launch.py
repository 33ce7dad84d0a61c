"""The launchers, run for real on this machine: submitit's LocalExecutor (one task per rank,
requeue on preemption), the sbatch templates with a stand-in for srun, and the rank/master
resolution of a multi-node Slurm layout."""

import os
import signal
import stat
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import submitit
import torch

from fedddp import env, slurm
from fedddp.sampling import layout_rows, owned_clients, owner, sample_clients
from fedrun import QUICKSTART, REPO, assert_same_state, final_state, free_port, metrics, run_here
from fedrun import SLOW, descendants, environ_of, wait_for_rounds

ARGS = ["run.rounds=4", "run.clients_per_round=7", "run.eval_every=2", "run.ckpt_every=2",
        "run.progress=false"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted one-rank run that every launcher must reproduce bitwise (in this process:
    the launchers are what the tests start)."""
    out = tmp_path_factory.mktemp("reference")
    run_here(ARGS + [f"run.out_dir={out}"])
    return out


@pytest.fixture
def local_job_env(monkeypatch):
    # The LocalExecutor copies this process's environment into its tasks.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


def wait_job(job, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while not job.done():
        if time.monotonic() > deadline:
            job.cancel()
            raise AssertionError(f"job {job.job_id} still running after {timeout} s:\n{job.stderr()}")
        time.sleep(0.5)
    return job.results()


def local_submit(tmp_path, run_args, tasks=2):
    job, _ = slurm.submit([QUICKSTART, *run_args, "--local", "--gpus-per-node", "0",
                           "--tasks-per-node", str(tasks), "--time", "10",
                           "--output", str(tmp_path / "submitit" / "%j")])
    return job


# -- submitit ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_submitit_local_executor_runs_one_rank_per_task(tmp_path, reference, local_job_env):
    out = tmp_path / "out"
    job = local_submit(tmp_path, ARGS + [f"run.out_dir={out}"])
    assert wait_job(job) == [0, 0]
    assert [m["round"] for m in metrics(out)] == [1, 2, 3, 4]
    # Two ranks really ran: each wrote the client-state shard of the clients it owns.
    shards = sorted(os.listdir(out / "checkpoints" / "round_000004"))
    assert shards == ["clients_rank0.pt", "clients_rank1.pt", "manifest.json", "server.pt"]
    assert_same_state(final_state(reference), final_state(out))


def test_checkpoint_hook_resubmits_the_same_run_resuming():
    task = slurm.Trainer(["exp.toml", "run.rounds=3", "run.resume=false"])
    assert isinstance(task, submitit.helpers.Checkpointable)
    again = task.checkpoint()
    assert isinstance(again, submitit.helpers.DelayedSubmission)
    assert again.function.argv == ["exp.toml", "run.rounds=3", "run.resume=true"]
    assert again.function.checkpoint().function.argv == again.function.argv  # idempotent
    # submitit pickles the resubmission into the job folder; the task must survive that.
    import cloudpickle
    assert cloudpickle.loads(cloudpickle.dumps(again)).function.argv == again.function.argv


@pytest.mark.e2e
def test_preempted_task_resumes_exactly_through_its_checkpoint_hook(tmp_path, reference):
    """The requeue path without a scheduler: a task stopped after round 3 (its last checkpoint),
    then the DelayedSubmission its checkpoint() returns, as submitit would requeue it."""
    out = tmp_path / "out"
    task = slurm.Trainer([QUICKSTART, *ARGS, f"run.out_dir={out}", "run.stop_after=3"])
    assert task() == 0
    first = (out / "metrics.jsonl").read_text().splitlines()
    assert len(first) == 3 and not (out / "final.pt").exists()
    assert task.checkpoint().result() == 0
    assert (out / "metrics.jsonl").read_text().splitlines()[:3] == first  # resumed, not redone
    assert [m["round"] for m in metrics(out)] == [1, 2, 3, 4]
    assert_same_state(final_state(reference), final_state(out))


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_submitit_requeue_on_preemption_signal_resumes_exactly(tmp_path, local_job_env, slow_reference):
    """The real path: the scheduler signals every task (USR2, as Slurm does before preemption
    or the time limit); submitit calls checkpoint() on rank 0 and requeues; the requeued tasks
    resume from the last checkpoint."""
    ref, out = slow_reference, tmp_path / "out"
    job = local_submit(tmp_path, SLOW + ["run.progress=false", f"run.out_dir={out}"])
    controller = job._process
    wait_for_rounds(out, 3, controller, log=None)
    saved = int((out / "checkpoints" / "LATEST").read_text().split("_")[1])
    kept = (out / "metrics.jsonl").read_text().splitlines()[:saved]
    tasks = [p for p in descendants(controller.pid) if "SUBMITIT_LOCAL_GLOBALID" in environ_of(p)]
    assert len(tasks) == 2 and not (out / "final.pt").exists()
    for pid in tasks:
        os.kill(pid, signal.SIGUSR2)
    assert wait_job(job) == [0, 0]
    assert "Requeued job" in job.stdout()
    resubmitted = submitit.helpers.DelayedSubmission.load(job.paths.submitted_pickle)
    assert resubmitted.function.argv[-1] == "run.resume=true"
    assert (out / "metrics.jsonl").read_text().splitlines()[:saved] == kept
    assert [m["round"] for m in metrics(out)] == list(range(1, 11))
    assert_same_state(final_state(ref), final_state(out))


def test_submit_rejects_a_bad_config_before_queueing(tmp_path, capsys):
    logs = tmp_path / "logs"
    status = slurm.main([QUICKSTART, "run.rounds=0", "--local", "--output", str(logs / "%j")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "run.rounds" in err[0]
    assert not logs.exists()


def test_submit_rejects_missing_data_before_queueing_with_status_3(tmp_path, capsys):
    """submit.py checked the config alone: a run whose data was missing was queued and failed
    on the nodes. The data layout is checked too, with fedddp's line and status."""
    logs = tmp_path / "logs"
    status = slurm.main([QUICKSTART, *cmapss_missing(tmp_path), "--local", "--output", str(logs / "%j")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 3 and len(err) == 1 and err[0].startswith("fedddp: error: ") and "CMAPSS" in err[0], err
    assert not logs.exists()


@pytest.mark.processes
def test_submit_wait_returns_the_ranks_status_and_line(tmp_path, local_job_env, capsys):
    """With --wait, a task that failed came back as status 1 and submitit's traceback; now it is
    fedddp's status and line (the data check skipped, so the ranks meet the missing data)."""
    status = slurm.main([QUICKSTART, *cmapss_missing(tmp_path), "run.progress=false", "--local",
                         "--gpus-per-node", "0", "--tasks-per-node", "2", "--time", "10", "--wait",
                         "--no-data-check", "--output", str(tmp_path / "submitit" / "%j")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 3, err
    assert err[-1].startswith("fedddp: error: ") and "CMAPSS files missing" in err[-1], err


def cmapss_missing(tmp_path):
    """A run whose data is missing: the ranks exit 3 (no torchrun, no GPU needed)."""
    return ["data.name=cmapss", "model.name=ffnn", "data.num_clients=4", "run.clients_per_round=2",
            f"data.root={tmp_path / 'nodata'}", f"run.out_dir={tmp_path / 'out'}"]


def test_submit_without_slurm_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch anywhere
    assert slurm.main([QUICKSTART, f"run.out_dir={tmp_path / 'out'}", "--output", str(tmp_path / "logs" / "%j")]) == 2
    assert "sbatch not found" in capsys.readouterr().err and not (tmp_path / "logs").exists()


def no_submitting(monkeypatch):
    """Any submitit executor made, local or Slurm, fails the test: a dry run submits nothing."""
    def refuse(*args, **kwargs):
        raise AssertionError("a dry run made a submitit executor")
    monkeypatch.setattr(submitit, "AutoExecutor", refuse)
    monkeypatch.setattr(slurm, "make_executor", refuse)


def test_dry_run_prints_the_resources_and_sbatch_script_and_submits_nothing(tmp_path, monkeypatch, capsys):
    """--dry-run: the task's command, submitit's parameters and the sbatch script submitit would
    write, on a machine without sbatch, and nothing queued, written or run."""
    no_submitting(monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch: a preview needs none
    logs, out = tmp_path / "logs", tmp_path / "out"
    status = slurm.main([QUICKSTART, "run.rounds=5", f"run.out_dir={out}", "--dry-run", "--partition", "gpu",
                         "--account", "lab", "--time", "2:00:00", "--gpus-per-node", "2", "--mem-gb", "64",
                         "--output", str(logs / "%j")])
    text = capsys.readouterr().out
    assert status == 0, text
    assert text.startswith("dry run: nothing submitted; would submit one job to Slurm through submitit\n")
    assert f"each rank runs: python -m fedddp {QUICKSTART} run.rounds=5 run.out_dir={out}\n" in text
    assert "submitit parameters: name=quickstart, nodes=1, gpus_per_node=2, tasks_per_node=2, " in text
    for line in ("#SBATCH --partition=gpu", "#SBATCH --account=lab", "#SBATCH --time=120",
                 "#SBATCH --gpus-per-node=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --mem=64GB",
                 "#SBATCH --signal=USR2@120", f"#SBATCH --output={logs}/%j/%j_0_log.out"):
        assert line + "\n" in text, line
    assert "srun --unbuffered" in text and f"-m submitit.core._submit {logs}/%j" in text
    assert not logs.exists() and not out.exists()
    local = slurm.main([QUICKSTART, f"run.out_dir={out}", "--dry-run", "--local", "--gpus-per-node", "0",
                        "--tasks-per-node", "2", "--output", str(logs / "%j")])
    text = capsys.readouterr().out
    assert local == 0 and "LocalExecutor" in text and "tasks_per_node=2" in text and "#SBATCH" not in text
    assert slurm.main([QUICKSTART, "run.rounds=0", "--dry-run"]) == 2  # checked as a submission is
    assert "run.rounds" in capsys.readouterr().err


def submit_command(command: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """``python launch/submit.py ...`` (the script in a checkout) or ``python -m fedddp.slurm
    ...`` (what an installed fedddp has), run from another folder, with this checkout's fedddp."""
    cmd = [sys.executable, os.path.join(REPO, "launch", "submit.py")] if command == "script" else \
        [sys.executable, "-m", "fedddp.slurm"]
    environ = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=environ,
                          cwd=os.path.dirname(REPO))


@pytest.mark.parametrize("command", ["script", "module"])
@pytest.mark.processes
def test_submit_commands_keep_the_interface_and_statuses(tmp_path, command):
    """launch/submit.py is a thin script over fedddp.slurm (the package's module, which
    fedddp.study.sweep --slurm uses too): the same flags, lines and statuses through either."""
    usage = submit_command(command, "--help")
    prog = "launch/submit.py" if command == "script" else "python -m fedddp.slurm"
    assert usage.returncode == 0 and usage.stdout.startswith(f"usage: {prog} ") and "--gpus-per-node" in usage.stdout
    logs = tmp_path / "logs"
    bad = submit_command(command, QUICKSTART, "run.rounds=0", "--local", "--output", str(logs / "%j"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "run.rounds" in bad.stderr
    missing = submit_command(command, QUICKSTART, *cmapss_missing(tmp_path), "--local", "--output", str(logs / "%j"))
    assert missing.returncode == 3 and missing.stderr.startswith("fedddp: error: "), missing.stderr
    assert not logs.exists()


@pytest.mark.slow
@pytest.mark.processes
def test_module_command_job_runs_in_a_worker(tmp_path):
    """``python -m fedddp.slurm`` runs as __main__: the task it submits must still be
    fedddp.slurm.Trainer, which submitit's worker can unpickle (not __main__.Trainer)."""
    out = tmp_path / "out"
    done = submit_command("module", QUICKSTART, "run.rounds=1", "run.progress=false", f"run.out_dir={out}",
                          "--local", "--gpus-per-node", "0", "--tasks-per-node", "1", "--time", "10", "--wait",
                          "--output", str(tmp_path / "submitit" / "%j"), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done" in done.stdout.splitlines()[-1] and (out / "final.pt").exists()


def test_launcher_flags_stay_out_of_the_experiment_config():
    args = slurm.parse_args([QUICKSTART, "run.rounds=3", "--nodes", "2", "--gpus-per-node", "4",
                             "--partition", "p", "--account", "a", "--time", "1-02:30:00"])
    assert args.overrides == ["run.rounds=3"]
    assert slurm.minutes(args.time) == (24 + 2) * 60 + 30
    assert [slurm.minutes(t) for t in ("90", "1:30:00", "0:0:30")] == [90, 90, 1]


# -- who am I on a multi-node job ----------------------------------------------------------------

def slurm_task(procid: int, nodes: int, per_node: int) -> dict:
    return {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(nodes * per_node),
            "SLURM_LOCALID": str(procid % per_node), "SLURM_NODEID": str(procid // per_node),
            "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_NODELIST": "gpu[03-04]" if nodes > 1 else "gpu03",
            "SLURM_JOB_ID": "4242"}


@pytest.mark.usefixtures("without_scontrol")
def test_two_node_slurm_layout_resolves_rank_world_and_master():
    resolved = [env.resolve(slurm_task(p, nodes=2, per_node=4)) for p in range(8)]
    assert [(p.rank, p.world_size, p.local_rank) for p in resolved] == [(r, 8, r % 4) for r in range(8)]
    assert {(p.master_addr, p.master_port, p.source) for p in resolved} == {("gpu03", 24242, "slurm")}


def test_submitit_task_exports_the_same_rendezvous_as_slurm(monkeypatch):
    for procid in range(8):
        for key, value in slurm_task(procid, nodes=2, per_node=4).items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
        monkeypatch.delenv("MASTER_PORT", raising=False)
        exported = slurm.rendezvous_env(submitit.JobEnvironment(), {})
        via_torchrun_vars = env.resolve(exported)
        assert (via_torchrun_vars.rank, via_torchrun_vars.world_size, via_torchrun_vars.local_rank) == \
            (procid, 8, procid % 4)
        assert (via_torchrun_vars.master_addr, via_torchrun_vars.master_port) == ("gpu03", 24242)
    # One node (and submitit's LocalExecutor, which sets no SLURM_* at all): loopback.
    local = SimpleNamespace(hostnames=["vm"], num_nodes=1, raw_job_id="123", global_rank=1,
                            num_tasks=2, local_rank=1)
    assert slurm.rendezvous_env(local, {}) == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "20123"}


@pytest.mark.parametrize("nodes,per_node", [(1, 8), (2, 4), (4, 2)])
@pytest.mark.usefixtures("without_scontrol")
def test_client_ownership_and_report_order_ignore_node_layout(nodes, per_node):
    """The same 8 ranks on 1, 2 or 4 nodes own the same clients and gather reports in the
    same order: both depend on the global rank and world size only."""
    num_clients, world = 30, 8
    ranks = [env.resolve(slurm_task(p, nodes, per_node)).rank for p in range(world)]
    owned = {r: owned_clients(num_clients, r, world) for r in ranks}
    assert owned == {r: range(r, num_clients, world) for r in range(world)}
    assert sorted(c for cs in owned.values() for c in cs) == list(range(num_clients))
    sampled = sample_clients(num_clients, 10, seed=0, round_idx=1)
    assert all(owner(c, world) in ranks for c in sampled)
    assert layout_rows(sampled, world) == layout_rows(sampled, nodes * per_node)


# -- sbatch templates, with srun and scontrol stand-ins -----------------------------------------

SRUN = '''#!{python}
"""srun stand-in: --ntasks copies of the command on this machine, with the SLURM_* variables
srun gives each task; waits for all and returns the worst exit status."""
import os, subprocess, sys
args, opts = sys.argv[1:], {{}}
while args and args[0].startswith("-"):
    key, _, value = args.pop(0).partition("=")
    opts[key] = value
with open(os.environ["SRUN_LOG"], "a") as fh:
    fh.write(" ".join(sys.argv[1:]) + "\\n")
ntasks = int(opts.get("--ntasks", os.environ.get("SLURM_NTASKS", "1")))
per_node = int(opts.get("--ntasks-per-node", ntasks))
procs = [subprocess.Popen(args, env=dict(os.environ, SLURM_PROCID=str(i), SLURM_LOCALID=str(i % per_node),
                                          SLURM_NODEID=str(i // per_node), SLURM_NTASKS=str(ntasks),
                                          SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_STEPID="0"))
         for i in range(ntasks)]
codes = [p.wait() for p in procs]
sys.exit(max(c if c >= 0 else 128 - c for c in codes))
'''

SCONTROL = '''#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] && tr ',' '\\n' <<< "$3"
'''


@pytest.fixture
def slurm_job(tmp_path):
    """Run an sbatch template the way sbatch would (bash, job variables set), with srun and
    scontrol stood in for on PATH."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("srun", SRUN.format(python=sys.executable)), ("scontrol", SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod((stubs / name).stat().st_mode | stat.S_IEXEC)
    srun_log = tmp_path / "srun.log"

    def sbatch(template, args, nodes, gpus_per_node, expect=0, **extra):
        job_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        job_env.update(PATH=f"{stubs}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
                       SLURM_JOB_ID="4242", SLURM_NNODES=str(nodes), SLURM_JOB_NUM_NODES=str(nodes),
                       SLURM_JOB_NODELIST="localhost", SLURM_SUBMIT_DIR=REPO,
                       GPUS_PER_NODE=str(gpus_per_node), MASTER_PORT=str(free_port()),
                       OMP_NUM_THREADS="1", SRUN_LOG=str(srun_log), **extra)
        proc = subprocess.run(["bash", os.path.join(REPO, "slurm", template), *args], env=job_env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-4000:]
        return proc, srun_log.read_text().splitlines()[-1] if srun_log.exists() else None

    return sbatch


@pytest.mark.slow
@pytest.mark.processes
def test_thesis_template_one_node_one_rank_per_gpu(tmp_path, reference, slurm_job):
    out = tmp_path / "out"
    _, srun_line = slurm_job("thesis_4gpu.sbatch", [QUICKSTART, *ARGS, "run.device=cpu", f"run.out_dir={out}"],
                             nodes=1, gpus_per_node=2)
    assert "--ntasks=1 " in srun_line and "--nnodes=1 --nproc_per_node=2" in srun_line
    assert_same_state(final_state(reference), final_state(out))
    assert sorted(os.listdir(out / "checkpoints" / "round_000004"))[:2] == ["clients_rank0.pt", "clients_rank1.pt"]


@pytest.mark.slow
@pytest.mark.processes
def test_multinode_template_two_nodes_and_requeue(tmp_path, reference, slurm_job):
    """Two nodes (one torchrun each, one rank per node, c10d rendezvous on the first node);
    stopped after round 2, then requeued by Slurm (SLURM_RESTART_COUNT=1): the template adds
    run.resume=true and the run ends as if never stopped."""
    out = tmp_path / "out"
    args = [QUICKSTART, *ARGS, "run.device=cpu", f"run.out_dir={out}"]
    _, srun_line = slurm_job("multinode.sbatch", args + ["run.stop_after=2"], nodes=2, gpus_per_node=1)
    assert "--ntasks=2 --ntasks-per-node=1" in srun_line and "--nnodes=2 --nproc_per_node=1" in srun_line
    assert "--rdzv-backend=c10d --rdzv-endpoint=localhost:" in srun_line
    first = (out / "metrics.jsonl").read_text().splitlines()
    assert len(first) == 2
    _, srun_line = slurm_job("multinode.sbatch", args, nodes=2, gpus_per_node=1, SLURM_RESTART_COUNT="1")
    assert srun_line.endswith("run.resume=true")
    assert (out / "metrics.jsonl").read_text().splitlines()[:2] == first
    assert [m["round"] for m in metrics(out)] == [1, 2, 3, 4]
    assert_same_state(final_state(reference), final_state(out))


@pytest.mark.parametrize("template", ["thesis_4gpu.sbatch", "multinode.sbatch"])
@pytest.mark.processes
def test_templates_exit_2_for_a_config_error_before_srun(tmp_path, slurm_job, template):
    """The templates returned torchrun's 1 inside its banner; a config error is now fedddp's one
    line and status 2, found before srun starts anything."""
    proc, srun_line = slurm_job(template, [QUICKSTART, "run.rounds=0"], nodes=1, gpus_per_node=2, expect=2)
    assert srun_line is None, srun_line
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "run.rounds: must be > 0" in proc.stderr


@pytest.mark.parametrize("template", ["thesis_4gpu.sbatch", "multinode.sbatch"])
@pytest.mark.processes
def test_templates_keep_a_ranks_data_error_status(tmp_path, slurm_job, template):
    """Check skipped (CHECK=0): the ranks meet the missing data under torchrun, which says 1;
    the template reads the ranks' status file and ends with fedddp's line and status 3."""
    proc, srun_line = slurm_job(template, [QUICKSTART, *cmapss_missing(tmp_path), "run.device=cpu"], nodes=1,
                                gpus_per_node=2, expect=3, CHECK="0", MAX_RESTARTS="0")
    assert srun_line is not None
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fedddp: error: ") and "CMAPSS files missing" in last, proc.stderr[-3000:]
    assert not list(tmp_path.glob(".fedddp-status*")), "the status file is removed at the end"


# -- the torchrun wrapper ------------------------------------------------------------------------

def local_sh(args, **env):
    job_env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "MAX_RESTARTS", "CHECK")}
    return subprocess.run(["bash", os.path.join(REPO, "launch", "local.sh"), QUICKSTART, *args],
                          capture_output=True, text=True, timeout=240, cwd=REPO,
                          env=dict(job_env, OMP_NUM_THREADS="1", PYTHON=sys.executable, NPROC="2", **env))


@pytest.mark.parametrize("args,status,fragment", [
    (["run.rounds=0"], 2, "run.rounds: must be > 0"),
    (["data.name=cmapss", "model.name=ffnn", "data.root=/nonexistent"], 3, "CMAPSS files missing"),
])
@pytest.mark.processes
def test_local_wrapper_exits_with_fedddps_status_and_line(args, status, fragment, tmp_path):
    """Under torchrun a config or data error came back as status 1 inside torchrun's failure
    banner; launch/local.sh checks first: fedddp's one line, fedddp's status, no rank started."""
    proc = local_sh(args + [f"run.out_dir={tmp_path / 'out'}"])
    assert proc.returncode == status, proc.stderr[-4000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedddp: error: ") and fragment in lines[0], proc.stderr[-4000:]


@pytest.mark.processes
def test_local_wrapper_keeps_a_ranks_status_after_torchrun(tmp_path):
    """CHECK=0: the ranks meet the missing data themselves; torchrun says 1, the wrapper reads the
    status the ranks left in FEDDDP_STATUS_FILE and ends with fedddp's line and status 3."""
    proc = local_sh(cmapss_missing(tmp_path), CHECK="0")
    assert proc.returncode == 3, proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fedddp: error: ") and "CMAPSS files missing" in last, proc.stderr[-4000:]

@pytest.mark.slow
@pytest.mark.processes
def test_local_wrapper_starts_two_ranks_without_gpus(tmp_path, reference):
    assert torch.cuda.device_count() == 0 or pytest.skip("this machine has GPUs")
    out = tmp_path / "out"
    job_env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "MAX_RESTARTS")}
    proc = subprocess.run(["bash", os.path.join(REPO, "launch", "local.sh"), QUICKSTART, *ARGS,
                           f"run.out_dir={out}"], capture_output=True, text=True, timeout=240, cwd=REPO,
                          env=dict(job_env, OMP_NUM_THREADS="1", PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(os.listdir(out / "checkpoints" / "round_000004"))[:2] == ["clients_rank0.pt", "clients_rank1.pt"]
    assert_same_state(final_state(reference), final_state(out))


@pytest.mark.processes
def test_local_wrapper_names_the_rank_whose_data_failed(tmp_path):
    """Only rank 1's client has a NaN pixel: rank 1 names the file, rank 0 only relays that
    another rank failed. The wrapper ends with rank 1's line, not the relay."""
    import json
    from test_data_femnist import write_leaf

    write_leaf(tmp_path / "data")
    path = tmp_path / "data" / "FEMNIST" / "train" / "all_data_0_niid_0_keep_0_train_9.json"
    blob = json.loads(path.read_text())
    blob["user_data"]["f0004_11"]["x"][0][7] = float("nan")  # client 1: rank 1's of 2
    path.write_text(json.dumps(blob))
    proc = local_sh(["data.name=femnist", "data.partition=natural", "data.num_clients=5", "run.clients_per_round=2",
                     f"data.root={tmp_path / 'data'}", f"run.out_dir={tmp_path / 'out'}"], CHECK="0")
    assert proc.returncode == 3, proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"fedddp: error: {path}: writer f0004_11's image 0 has non-finite pixels"), proc.stderr[-4000:]
