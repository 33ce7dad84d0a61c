"""Who-am-I resolution: torchrun, Slurm, single process; half-set environments are refused."""

import pytest

from fedddp import env
from fedddp.errors import ConfigError

# Unit tests of the resolution: no process, not even the scontrol that expands a node list.
pytestmark = pytest.mark.usefixtures("without_scontrol")


def test_single_process():
    p = env.resolve({})
    assert (p.rank, p.world_size, p.local_rank, p.source) == (0, 1, 0, "single")


def test_torchrun():
    p = env.resolve({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (p.rank, p.world_size, p.local_rank, p.master_addr, p.master_port, p.source) == (3, 4, 1, "h", 1234, "torchrun")


def test_torchrun_half_set_is_refused():
    with pytest.raises(ConfigError, match="LOCAL_RANK missing"):
        env.resolve({"RANK": "0", "WORLD_SIZE": "2"})


def test_slurm_task():
    p = env.resolve({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                     "SLURM_JOB_NODELIST": "gpu[03-05,07]", "SLURM_JOB_ID": "1234"})
    assert (p.rank, p.world_size, p.local_rank, p.source) == (5, 8, 1, "slurm")
    assert p.master_addr == "gpu03" and p.master_port == 20000 + 1234


def test_slurm_half_set_is_refused():
    with pytest.raises(ConfigError, match="SLURM_LOCALID missing"):
        env.resolve({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


def test_sbatch_shell_without_task_is_single():
    # Inside an sbatch script, before srun, only job-level variables exist.
    assert env.resolve({"SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"}).source == "single"


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("a[1-3]", "a1"), ("gpu[07,09]", "gpu07"),
                                            ("x-1,x-2", "x-1")])
def test_first_host(nodelist, first):
    assert env.first_host(nodelist) == first


def test_status_file_records_one_line_per_failed_rank(tmp_path):
    """What the launchers read back after torchrun (which itself says only 1)."""
    path = tmp_path / "status"
    env.write_status(3, "fedddp: error: a\nb", 1, {"FEDDDP_STATUS_FILE": str(path)})
    env.write_status(3, "fedddp: error: relayed", 0 + 2, {"FEDDDP_STATUS_FILE": str(path)})
    env.write_status(2, "ignored", 0, {})  # no file named: nothing written, no error
    assert path.read_text().splitlines() == ["3\t1\tfedddp: error: a b", "3\t2\tfedddp: error: relayed"]
