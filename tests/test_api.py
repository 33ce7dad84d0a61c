"""fedddp.run, the Python API: the CLI's run in this process, its result, its errors as
exceptions, torch's global settings left as they were, and every rank under real torchrun."""

from __future__ import annotations

import dataclasses
import datetime
import os
import subprocess
import sys
import tomllib

import pytest
import torch
import torch.distributed as dist

import fedddp
from fedddp.comm import Comm
from fedddp.env import ProcessEnv
from fedddp.verdict import RankZeroRefused
from fedrun import QUICKSTART, REPO, assert_same_state, final_state, free_port, metrics, run_fedddp

SMALL = ["run.rounds=3", "run.ckpt_every=0", "run.progress=false"]


@pytest.mark.processes
def test_import_fedddp_stays_without_torch():
    """Guards the fast start: exporting fedddp.run eagerly would import torch (and the whole
    runtime) for every ``import fedddp``, the error classes included."""
    code = "import sys, fedddp; from fedddp import ConfigError, DataError; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_path_and_dict_configs_give_the_cli_bits(tmp_path):
    """Guards the one code path: the API's result is the run folder's (metrics.jsonl rows,
    final.pt) and bitwise the CLI's run of the same config, whether the config is a file or
    its tables as dicts."""
    by_path = fedddp.run(QUICKSTART, SMALL, out_dir=tmp_path / "path")
    assert by_path.out_dir == str(tmp_path / "path")
    assert by_path.metrics == metrics(by_path.out_dir)
    assert [row["round"] for row in by_path.metrics] == [1, 2, 3]
    assert_same_state(by_path.state_dict, final_state(by_path.out_dir))
    assert by_path.config.run.rounds == 3 and by_path.config.algorithm.weighting == "samples"  # resolved

    with open(QUICKSTART, "rb") as fh:
        tables = tomllib.load(fh)
    tables["run"].update(rounds=3, ckpt_every=0, progress=False)
    by_dict = fedddp.run(tables, ["run.seed=0"], out_dir=tmp_path / "dict")
    assert_same_state(by_dict.state_dict, by_path.state_dict)
    assert by_dict.config.run.out_dir == str(tmp_path / "dict")
    assert dataclasses.replace(by_dict.config, run=dataclasses.replace(by_dict.config.run,
                                                                       out_dir=by_path.config.run.out_dir)) == by_path.config

    run_fedddp(SMALL + [f"run.out_dir={tmp_path / 'cli'}"])
    assert_same_state(final_state(tmp_path / "cli"), by_path.state_dict)


@pytest.mark.e2e
def test_two_calls_in_one_process_leave_torch_settings_as_found(tmp_path):
    """Guards the notebook: a second call in the same process must run (no stale process group
    or lock), a caller's float64 default dtype and thread count must not change the bits, and
    every setting the run changes (threads, default dtype, the global RNG it seeds) is restored."""
    first = fedddp.run(QUICKSTART, SMALL, out_dir=tmp_path / "first")
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(3)
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(1234)
        expected_draw = torch.rand(4)
        torch.manual_seed(1234)
        second = fedddp.run(first.config, out_dir=tmp_path / "second")  # a resolved Config is a config
        assert torch.get_num_threads() == 3
        assert torch.get_default_dtype() == torch.float64
        assert torch.equal(torch.rand(4), expected_draw)
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
    assert_same_state(second.state_dict, first.state_dict)
    assert second.state_dict["head.weight"].dtype == torch.float32
    assert [r["test_accuracy"] for r in second.metrics] == [r["test_accuracy"] for r in first.metrics]


@pytest.mark.e2e
def test_mistakes_raise_their_error_not_system_exit(tmp_path):
    """Guards the API's contract: a bad key, a missing config file and missing data raise
    ConfigError / DataError (the CLI's exit statuses 2 and 3), never SystemExit, and the
    thread count the run had already pinned is restored on the way out."""
    with pytest.raises(fedddp.ConfigError, match="run.bogus: unknown key"):
        fedddp.run({"run": {"bogus": 1}}, out_dir=tmp_path / "a")
    with pytest.raises(fedddp.ConfigError, match="config file not found"):
        fedddp.run(tmp_path / "missing.toml")
    with pytest.raises(fedddp.ConfigError, match="run.rounds: expected int"):
        fedddp.run(QUICKSTART, ["run.rounds=three"])
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with pytest.raises(fedddp.DataError):
            fedddp.run({"data": {"name": "mnist", "root": str(tmp_path / "empty")}, "model": {"name": "mlp"}},
                       SMALL, out_dir=tmp_path / "b")
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
    assert {cls.__name__ for cls in (fedddp.DivergenceError, fedddp.DiskFullError, fedddp.StalledError)} == {
        "DivergenceError", "DiskFullError", "StalledError"}


@pytest.mark.parametrize("status, raised", [(2, fedddp.ConfigError), (4, fedddp.DivergenceError), (1, RankZeroRefused)])
def test_rank_zero_verdict_is_its_class_on_the_other_ranks(monkeypatch, status, raised):
    """Guards ``except fedddp.ConfigError`` on every rank: a rank that learns only rank 0's exit
    status raises that status's class, and status 1 (rank 0's bug) left a StopIteration."""
    def refused(*args, **kwargs):
        raise RankZeroRefused(status)

    monkeypatch.setattr("fedddp.api.execute", refused)
    with pytest.raises(raised, match=f"rank 0 stopped the run \\(exit status {status}\\)") as info:
        fedddp.run({})
    assert type(info.value) is raised


def test_a_process_group_of_another_world_is_refused(tmp_path):
    """Guards a script's own process group: one that does not match the launcher's world would
    leave every collective waiting; it is one ConfigError, and the group is left open."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        env = ProcessEnv(0, 2, 0, "127.0.0.1", 29500, "torchrun")
        with pytest.raises(fedddp.ConfigError, match="rank 0 of 1, but the launcher says rank 0 of 2"):
            Comm(env, "cpu")
        comm = Comm(ProcessEnv(0, 1, 0, "127.0.0.1", 29500, "torchrun"), "cpu")
        comm.close()
        assert dist.is_initialized()  # the caller's group outlives fedddp's use of it
    finally:
        dist.destroy_process_group()


RANK_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
import fedddp
out, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
results = []
for name in ("first", "second", "own"):
    if name == "own":  # the script's own process group: used and left open
        dist.init_process_group("gloo")
    results.append(fedddp.run(config, overrides, out_dir=os.path.join(out, name)))
    assert dist.is_initialized() == (name == "own")  # fedddp's own groups are closed
try:  # rank 0 refuses a folder holding results; the others learn only its exit status
    fedddp.run(config, overrides, out_dir=os.path.join(out, "first"))
    refused = None
except fedddp.ConfigError as exc:
    refused = type(exc).__name__
flag = torch.ones(1)
dist.all_reduce(flag)
assert flag.item() == dist.get_world_size() == 2
dist.destroy_process_group()
torch.save({"metrics": [r.metrics for r in results], "state": [r.state_dict for r in results],
            "refused": refused},
           os.path.join(out, f"result_rank{os.environ['RANK']}.pt"))
"""


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_every_rank_under_torchrun_gets_the_one_rank_result(tmp_path):
    """Guards fedddp.run in a user's script under torchrun: each rank calls it twice in groups
    fedddp makes (the second once read the first group's stale addresses from torchrun's store
    and could not connect), then in one the script made and keeps, and every rank's result is
    rank 0's metrics and the bitwise state of a one-rank run; rank 0's refusal is the same
    exception class on every rank."""
    script = tmp_path / "script.py"
    script.write_text(RANK_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(script), str(tmp_path),
           QUICKSTART] + SMALL
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one_rank = fedddp.run(QUICKSTART, SMALL, out_dir=tmp_path / "one")
    for rank in (0, 1):
        result = torch.load(tmp_path / f"result_rank{rank}.pt", weights_only=True)
        assert result["refused"] == "ConfigError"
        for name, rows, state in zip(("first", "second", "own"), result["metrics"], result["state"]):
            assert rows == metrics(tmp_path / name)
            assert_same_state(state, final_state(tmp_path / name))
            assert_same_state(state, one_rank.state_dict)
            assert [r["test_accuracy"] for r in rows] == [r["test_accuracy"] for r in one_rank.metrics]
