"""Ranks sharing a GPU (run.device = cuda with more ranks on a node than GPUs, the thesis's 4
ranks on a one-GPU workstation): they take the GPUs round-robin over gloo, whose collectives
other than broadcast and all_reduce take host tensors, so those move through host memory. On
CPU the same staged path runs under FEDDDP_HOST_STAGING=1 (its twin) and must leave a run's bits
as one rank's; on a GPU, 2 and 4 ranks on one GPU must equal one rank."""

from __future__ import annotations

import pytest
import torch

from fedddp import comm as comm_mod
from fedddp.env import ProcessEnv, resolve
from fedrun import assert_same_state, final_state, run_fedddp


def test_the_ranks_on_a_node_come_from_the_launcher():
    base = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}
    assert resolve(dict(base, LOCAL_WORLD_SIZE="4")).local_world_size == 4
    assert resolve(base).local_world_size == 4  # at least local rank + 1
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "MASTER_ADDR": "h"}
    assert resolve(dict(slurm, SLURM_NTASKS_PER_NODE="4")).local_world_size == 4
    assert resolve(dict(slurm, SLURM_NTASKS_PER_NODE="4(x2)")).local_world_size == 2


@pytest.mark.parametrize("ranks,gpus,backend,index", [(4, 1, "gloo", 0), (4, 2, "gloo", 1), (2, 2, "nccl", 1)])
def test_more_ranks_than_gpus_share_them_over_gloo(monkeypatch, ranks, gpus, backend, index):
    """The choice alone (one process, no group): a device round-robin, gloo where GPUs are
    shared, NCCL where each rank has its own, and the start line's words."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    comm = comm_mod.Comm(ProcessEnv(3, ranks, 3, "127.0.0.1", 0, "single", ranks), "cuda")
    assert comm.backend == backend and comm.device == torch.device("cuda", index)
    assert comm.staged == (backend == "gloo")
    assert ("round-robin over gloo" in comm.describe()) == (backend == "gloo")


ARGS = ["run.rounds=2", "run.eval_every=2", "run.ckpt_every=0", "algorithm.name=scaffold"]


@pytest.mark.processes
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["gather", "sharded"])
def test_collectives_through_host_memory_leave_the_bits(tmp_path, aggregation):
    """Two ranks whose gathers, point to point (SCAFFOLD's client state travels) and sharded
    exchanges move through host copies end with one rank's model."""
    args = ARGS + [f"run.aggregation={aggregation}", "run.aggregation_block=64"]
    run_fedddp(args + [f"run.out_dir={tmp_path / 'one'}"])
    run_fedddp(args + [f"run.out_dir={tmp_path / 'two'}"], nproc=2, env={"FEDDDP_HOST_STAGING": "1"})
    assert_same_state(final_state(tmp_path / "one"), final_state(tmp_path / "two"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.processes
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_sharing_one_cuda_gpu_equal_one_rank(tmp_path, ranks):
    args = ARGS + ["run.device=cuda", "run.aggregation=sharded", "run.aggregation_block=64",
                   "run.parallel_clients=2"]
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    run_fedddp(args + [f"run.out_dir={tmp_path / 'one'}"], env=env)
    proc = run_fedddp(args + [f"run.out_dir={tmp_path / 'many'}"], nproc=ranks, env=env)
    assert "round-robin over gloo" in proc.stderr
    assert_same_state(final_state(tmp_path / "one"), final_state(tmp_path / "many"))
