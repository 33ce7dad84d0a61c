"""Failures that end a run in one line with a documented status: a torchrun world of one,
a rank that stops answering, and ``python -m fedddp --check`` (what the launchers run first)."""

import os
import signal
import subprocess
import sys

import pytest

from fedddp.comm import STALLED_EXIT
from fedrun import QUICKSTART, REPO, SLOW, assert_same_state, final_state, free_port, run_here, wait_for_rounds

ARGS = ["run.rounds=3", "run.eval_every=3", "run.progress=false"]


@pytest.mark.processes
@pytest.mark.e2e
def test_torchrun_world_of_one_matches_the_single_process_run(tmp_path):
    """torchrun --nproc_per_node=1 is distributed with a world of 1: Comm.gather_rows had no
    gather buffer there and crashed ('NoneType' object has no attribute 'chunk')."""
    single, one = tmp_path / "single", tmp_path / "torchrun1"
    run_here(ARGS + [f"run.out_dir={single}"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "-m", "fedddp", QUICKSTART, *ARGS, f"run.out_dir={one}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_state(final_state(single), final_state(one))


def start_ranks(tmp_path, args, world=2):
    """``world`` ranks of one run started by hand (torchrun's variables, no agent), so a test
    can stop one and see what the others do without torchrun tearing the group down."""
    port, procs = free_port(), []
    for rank in range(world):
        log = open(tmp_path / f"rank{rank}.log", "w+")
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append((subprocess.Popen([sys.executable, "-m", "fedddp", QUICKSTART, "run.progress=false", *args],
                                       stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env), log))
    return procs


@pytest.mark.parametrize("world,stopped", [(2, 1), (3, 0)])
@pytest.mark.processes
def test_a_stopped_rank_is_named_and_ends_the_run(tmp_path, world, stopped):
    """A SIGSTOPped rank used to hang the others silently for the fixed 30-minute collective
    timeout. With run.collective_timeout_s the live ranks end the run with exit STALLED_EXIT
    and the lowest live rank names the stopped one in one line (rank 0 too, whose process
    hosts the store: the other live rank is not blamed with it)."""
    out = tmp_path / "out"
    procs = start_ranks(tmp_path, SLOW + ["run.collective_timeout_s=2", f"run.out_dir={out}"], world)
    live = [r for r in range(world) if r != stopped]
    try:
        wait_for_rounds(out, 1, procs[0][0], procs[0][1])
        os.kill(procs[stopped][0].pid, signal.SIGSTOP)
        texts = {}
        for r in live:
            status = procs[r][0].wait(timeout=120)
            procs[r][1].seek(0)
            texts[r] = procs[r][1].read()
            assert status == STALLED_EXIT, texts[r][-4000:]
        lines = [ln for ln in texts[live[0]].splitlines() if ln.strip()]
        assert lines == [f"fedddp: error: rank {stopped} stopped answering for more than 2 s "
                         "(run.collective_timeout_s); it may be stopped (SIGSTOP), swapping or hung; the run "
                         "ends here, resume it from its last checkpoint with run.resume=true"], texts[live[0]][-4000:]
        assert all(not texts[r].strip() for r in live[1:]), texts  # said once
    finally:
        for proc, log in procs:
            proc.kill()
            proc.wait()
            log.close()


@pytest.mark.processes
def test_check_mode_loads_config_and_data_and_writes_nothing(tmp_path):
    """``python -m fedddp --check``: what the launchers run before any rank starts."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "fedddp", "--check", QUICKSTART, f"run.out_dir={out}"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "configuration and data OK (synthetic, 30 clients)" in proc.stderr, proc.stderr
    assert not out.exists()
    proc = subprocess.run([sys.executable, "-m", "fedddp", "--check", QUICKSTART, "data.name=femnist",
                           "data.partition=natural", f"data.root={tmp_path}", f"run.out_dir={out}"],
                          capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 3 and proc.stderr.count("\n") == 1 and "FEMNIST not found" in proc.stderr


@pytest.mark.processes
def test_a_rank_that_never_arrives_is_one_line_exit_5(tmp_path):
    """Rank 0 of two started alone used to wait the fixed 30 minutes and end in a DistStoreError
    traceback; it now waits run.collective_timeout_s and says so in one line."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "fedddp", QUICKSTART, "run.collective_timeout_s=2",
                           f"run.out_dir={tmp_path}"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == STALLED_EXIT, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedddp: error: rank 0: the 2 ranks did not all meet at "), lines
    assert "within 2 s (run.collective_timeout_s): Timed out after" in lines[0] and "1/2 clients joined" in lines[0]
