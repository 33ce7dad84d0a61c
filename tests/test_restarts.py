"""Restarts without a human: torchrun --max-restarts after a rank is killed, workers that know
they were restarted, and checkpoints that survive a save killed half-way."""

import csv
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from fedddp import checkpoint, env, logs
from fedddp.__main__ import main as fedddp_main
from fedddp.comm import Comm, _group_prefix
from fedddp.errors import StalledError
from fedrun import (QUICKSTART, REPO, SLOW, assert_same_state, client_rows, descendants, final_state, metrics,
                    rank_pid, run_here, wait_for_rounds)



@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_sigkill_of_a_rank_under_torchrun_max_restarts_resumes_exactly(tmp_path, slow_reference):
    """launch/local.sh runs torchrun --max-restarts; a rank killed mid-run brings the group back
    from the last checkpoint, and the run ends as if nothing had happened."""
    ref, out = slow_reference, tmp_path / "killed"
    cmd = ["bash", os.path.join(REPO, "launch", "local.sh"), QUICKSTART, "run.progress=false", *SLOW,
           f"run.out_dir={out}"]
    log = open(tmp_path / "torchrun.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env=dict(os.environ, OMP_NUM_THREADS="1", NPROC="2", MAX_RESTARTS="1",
                                     PYTHON=sys.executable))
    try:
        wait_for_rounds(out, 3, proc, log)  # a checkpoint exists; the rounds after it are redone
        victim = rank_pid(proc.pid, rank=1)
        saved = int((out / "checkpoints" / "LATEST").read_text().split("_")[1])
        kept = (out / "metrics.jsonl").read_text().splitlines()[:saved]
        assert not (out / "final.pt").exists()
        os.kill(victim, signal.SIGKILL)
        status = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    text = log.read()
    assert status == 0, text[-4000:]
    assert "restarted by torchrun: resuming from the last checkpoint" in text, text[-4000:]
    # Resumed, not started over: the rounds up to the checkpoint keep their first lines.
    assert (out / "metrics.jsonl").read_text().splitlines()[:saved] == kept
    assert_same_state(final_state(ref), final_state(out))
    assert [m["round"] for m in metrics(out)] == list(range(1, 11))
    assert [m["test_accuracy"] for m in metrics(out)] == [m["test_accuracy"] for m in metrics(ref)]


RESTARTED = ["run.rounds=8", "run.seed=5", "run.ckpt_every=1", "run.progress=false"]


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_plain_torchrun_restart_after_a_killed_rank_resumes_exactly_every_time(tmp_path):
    """Regression: under a plain ``torchrun --standalone --max-restarts=1`` (the agent's store
    shared with the workers, torch's default) the restarted ranks read the previous attempt's
    gloo addresses from the store, which outlives them: in 7 of 10 tries they exited 6 at once
    with "did not all meet ... within 1800 s", naming a timeout that never ran, and some waited
    out the whole timeout. Three kills, three restarts: each resumes and ends bitwise as the
    uninterrupted run."""
    ref = tmp_path / "ref"
    run_here(RESTARTED + [f"run.out_dir={ref}"])
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0: torchrun's default, what launch/local.sh opts out of
    run_env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="0")
    run_env.pop("FEDDDP_STATUS_FILE", None)
    for attempt in range(3):
        out = tmp_path / f"killed{attempt}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--max-restarts=1", "-m", "fedddp", QUICKSTART, *RESTARTED, f"run.out_dir={out}"]
        log = open(tmp_path / f"torchrun{attempt}.log", "w+")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=run_env)
        try:
            victim = rank_pid(proc.pid, rank=1)
            deadline = time.monotonic() + 120
            while not (out / "checkpoints" / "LATEST").exists():
                assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint written"
                time.sleep(0.01)
            assert not (out / "final.pt").exists()
            os.kill(victim, signal.SIGKILL)
            status = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:  # a restart that hangs: its ranks too, not only torchrun
                for pid in descendants(proc.pid):
                    os.kill(pid, signal.SIGKILL)
                proc.kill()
                proc.wait()
        log.seek(0)
        text = log.read()
        log.close()
        assert status == 0, f"restart {attempt + 1} of 3:\n{text[-4000:]}"
        assert "restarted by torchrun: resuming from the last checkpoint" in text, text[-4000:]
        assert [m["round"] for m in metrics(out)] == list(range(1, 9))
        assert_same_state(final_state(ref), final_state(out))


def _meet(store, world_size: int, late=(), timeout_s: float = 10) -> dict:
    """What _group_prefix gives each of ``world_size`` ranks (threads), the ``late`` ones 0.2 s late."""
    prefixes = {}

    def rank(r):
        if r in late:
            time.sleep(0.2)
        try:
            prefixes[r] = _group_prefix(store, r, world_size, timeout_s)
        except RuntimeError as exc:
            prefixes[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return prefixes


def test_each_group_meets_under_keys_no_earlier_process_wrote():
    """The ranks of a group agree on a prefix that no earlier group in the same store had, though
    the store holds an earlier rank's request and the ranks come in any order (torchrun's
    restart count is no such number: it is kept per node)."""
    store = dist.HashStore()
    first = _meet(store, 3)
    assert len(set(first.values())) == 1 and isinstance(first[0], str), first
    store.add("fedddp/hello/1", 1)  # a rank 1 that asked, then died before the answer
    for late in ({1, 2}, {0}, ()):
        again = _meet(store, 3, late)
        assert len(set(again.values())) == 1 and isinstance(again[0], str), again
        assert again[0] != first[0]
        first = again
    alone = _meet(dist.HashStore(), 2, late={1}, timeout_s=0.05)  # rank 1 comes after rank 0 gave up
    assert str(alone[0]) == "timed out: 1/2 ranks arrived", alone
    alone = _meet(dist.HashStore(), 2, late={0}, timeout_s=0.05)
    assert str(alone[1]).startswith("timed out: rank 0 did not answer"), alone


class _FakeStoreRendezvous:
    """dist.rendezvous's answer, as rank 0 of 2 sees it once rank 1 has taken the group's number."""

    def __init__(self):
        self.store = dist.HashStore()
        self.store.add("fedddp/joined/1", 1)

    def __call__(self, url, rank, world_size, timeout):
        yield self.store, rank, world_size


@pytest.mark.parametrize("fails_after_s", [0.0, 0.3])
def test_a_failed_mesh_connection_is_not_reported_as_a_timeout(monkeypatch, fails_after_s):
    """Regression: gloo's connectFullMesh refused at once ("timed out connecting" is its few quick
    retries) was reported as "did not all meet ... within 1800 s", a timeout that never ran. A
    failure before run.collective_timeout_s says how long it took; one after it, the timeout."""
    monkeypatch.setattr(dist, "rendezvous", _FakeStoreRendezvous())

    def refused(*args, **kwargs):
        time.sleep(fails_after_s)
        raise RuntimeError("Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:152] "
                           "timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:28588$1")

    monkeypatch.setattr(dist, "init_process_group", refused)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    timeout_s = 1800 if fails_after_s == 0 else 0.2
    with pytest.raises(StalledError) as caught:
        Comm(env.ProcessEnv(0, 2, 0, "127.0.0.1", 29500, "torchrun"), "cpu", timeout_s=timeout_s)
    line = str(caught.value)
    reason = "Gloo connectFullMesh failed with timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:28588$1"
    assert line.endswith(reason + ("; check that every rank can reach the others' addresses (GLOO_SOCKET_IFNAME or "
                                   "NCCL_SOCKET_IFNAME names the network interface to use)" if fails_after_s == 0 else
                                   "; start every rank, with the same MASTER_ADDR and MASTER_PORT")), line
    if fails_after_s == 0:
        assert line.startswith("rank 0: the 2 ranks met at 127.0.0.1:29500 but could not connect to each other, "
                               "after 0.0 s of the 1800 s allowed (run.collective_timeout_s): "), line
        assert "within" not in line
    else:
        assert line.startswith("rank 0: the 2 ranks did not all meet at 127.0.0.1:29500 within 0.2 s "
                               "(run.collective_timeout_s): "), line


ARGS = [QUICKSTART, "run.rounds=6", "run.clients_per_round=7", "run.eval_every=2", "run.ckpt_every=2",
        "run.progress=false"]


@pytest.mark.e2e
def test_restarted_worker_resumes_without_being_told(tmp_path, monkeypatch, capsys):
    """torchrun restarts workers with the same command line; TORCHELASTIC_RESTART_COUNT > 0 is
    what tells them to continue instead of starting over."""
    full, part = tmp_path / "full", tmp_path / "part"
    assert fedddp_main(ARGS + [f"run.out_dir={full}"]) == 0
    assert fedddp_main(ARGS + [f"run.out_dir={part}", "run.stop_after=3"]) == 0
    first_lines = (part / "metrics.jsonl").read_text().splitlines()
    capsys.readouterr()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert fedddp_main(ARGS + [f"run.out_dir={part}"]) == 0
    assert "restarted by torchrun: resuming" in capsys.readouterr().err
    # Rounds 1-3 were not run again: their lines (timings included) are the first run's.
    assert (part / "metrics.jsonl").read_text().splitlines()[:3] == first_lines
    assert [m["round"] for m in metrics(part)] == list(range(1, 7))
    assert_same_state(final_state(full), final_state(part))


TIMINGS = {"time_s", "train_s", "train_imbalance_s", "communicate_s", "aggregate_s", "evaluate_s", "checkpoint_s",
           "train_time_s"}


def _rows_without_timings(out) -> tuple[list[dict], ...]:
    """metrics.jsonl, clients.jsonl and metrics.csv, row by row, the seconds left out."""
    with open(out / "metrics.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    return tuple([{k: v for k, v in row.items() if k not in TIMINGS} for row in rows]
                 for rows in (metrics(out), client_rows(out), table))


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.e2e
def test_run_interrupted_between_a_checkpoint_and_its_rows_resumes_with_every_row(tmp_path, monkeypatch, when):
    """Regression: round 4's checkpoint was complete before round 4's rows were written, so a
    run interrupted in between resumed at round 5, and round 4 was missing from metrics.jsonl,
    metrics.csv and clients.jsonl for good. The interruption (KeyboardInterrupt, what SIGINT
    raises) comes after round 4's checkpoint files are written, just before or just after its
    rows: either way the resumed files read as the uninterrupted run's."""
    full, part = tmp_path / "full", tmp_path / "part"
    assert fedddp_main(ARGS + [f"run.out_dir={full}"]) == 0
    write_round = logs.RunLogs.write_round

    def interrupted(self, line, *args, **kwargs):
        if line["round"] == 4 and when == "before":
            raise KeyboardInterrupt
        written = write_round(self, line, *args, **kwargs)
        if line["round"] == 4:
            raise KeyboardInterrupt
        return written

    monkeypatch.setattr(logs.RunLogs, "write_round", interrupted)
    assert fedddp_main(ARGS + [f"run.out_dir={part}"]) == 130
    monkeypatch.setattr(logs.RunLogs, "write_round", write_round)
    assert (part / "checkpoints" / "round_000004" / "server.pt").exists()
    assert fedddp_main(ARGS + [f"run.out_dir={part}", "run.resume=true"]) == 0
    assert _rows_without_timings(part) == _rows_without_timings(full)
    assert_same_state(final_state(full), final_state(part))


@pytest.mark.e2e
def test_fresh_run_into_an_older_runs_folder_is_refused_or_replaces_it(tmp_path, capsys):
    """A fresh run in a used out_dir silently deleted the older run's metrics and could be
    resumed from its checkpoints (a torchrun restart before the fresh run's first checkpoint
    continued the wrong run). Now it is refused, or with run.overwrite=true replaces them all."""
    out = tmp_path / "o"
    assert fedddp_main([QUICKSTART, "run.rounds=2", "run.ckpt_every=2", "run.progress=false",
                        f"run.out_dir={out}"]) == 0
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    second = [QUICKSTART, "run.rounds=1", "run.ckpt_every=0", "run.progress=false", f"run.out_dir={out}"]
    assert fedddp_main(second) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{out} already holds" in err[0], err
    assert "run.resume=true" in err[0] and "run.overwrite=true" in err[0] and "run.out_dir" in err[0]
    assert (out / "metrics.jsonl").read_text() == before
    assert fedddp_main(second + ["run.overwrite=true"]) == 0
    assert not (out / "checkpoints").exists()  # nothing of the older run can be resumed
    assert [m["round"] for m in metrics(out)] == [1]


def _payload(round_idx: int) -> dict:
    return {"round": round_idx, "global_P": torch.full((1000,), float(round_idx)), "state": {}}


def test_checkpoint_killed_mid_save_leaves_previous_intact(tmp_path, monkeypatch):
    comm = Comm(env.resolve({}), "cpu")
    root = str(tmp_path / "checkpoints")
    clients = {3: {"c_P": torch.arange(10.0)}}
    checkpoint.save(comm, root, 1, _payload(1), clients)

    real_save = torch.save
    calls = []

    def dying_save(obj, fh, *args, **kwargs):
        # The second file of the checkpoint (server.pt) gets half its bytes, then the process
        # "dies" (an exception stands in for the kill: nothing after it runs).
        calls.append(1)
        if len(calls) == 2:
            fh.write(b"PK\x03\x04 half a zip archive")
            fh.flush()
            raise RuntimeError("killed mid-save")
        return real_save(obj, fh, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(RuntimeError, match="killed mid-save"):
        checkpoint.save(comm, root, 2, _payload(2), clients)
    monkeypatch.setattr(torch, "save", real_save)

    assert len(calls) == 2
    assert open(os.path.join(root, "LATEST")).read() == "round_000001"
    folder = checkpoint.latest(root)
    server, loaded = checkpoint.load(folder, {3}, "cpu")
    assert server["round"] == 1 and torch.equal(server["global_P"], _payload(1)["global_P"])
    assert torch.equal(loaded[3]["c_P"], clients[3]["c_P"])
    # The half-written file never took the real name.
    assert not os.path.exists(os.path.join(checkpoint.round_dir(root, 2), "server.pt"))

    # Saving again after the failure works, and older folders are pruned to `keep`.
    checkpoint.save(comm, root, 2, _payload(2), clients)
    checkpoint.save(comm, root, 3, _payload(3), clients)
    assert checkpoint.latest(root) == checkpoint.round_dir(root, 3)
    assert not os.path.exists(checkpoint.round_dir(root, 1))


def test_leftover_newer_folders_do_not_prune_the_new_checkpoint(tmp_path):
    """Regression: pruning kept the `keep` highest round folders, so leftovers of an older run
    (round_000009, round_000010) deleted the checkpoint just written and LATEST dangled."""
    comm = Comm(env.resolve({}), "cpu")
    root = str(tmp_path / "checkpoints")
    for stale in (9, 10):
        os.makedirs(checkpoint.round_dir(root, stale))
    for r in (1, 2, 3):
        checkpoint.save(comm, root, r, _payload(r), {})
        assert checkpoint.latest(root) == checkpoint.round_dir(root, r)
    server, _ = checkpoint.load(checkpoint.latest(root), set(), "cpu")
    assert server["round"] == 3
    assert os.path.isdir(checkpoint.round_dir(root, 2)) and not os.path.isdir(checkpoint.round_dir(root, 1))

