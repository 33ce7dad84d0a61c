"""Who am I: rank, world size, local rank and rendezvous, from torchrun, Slurm, or nothing.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. A Slurm task started by
``srun`` (or by submitit) has SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_JOB_NODELIST;
the master is the first node of the list. With neither, this is a single process. A half-set
environment (some of a family's variables but not all) is refused: guessing would silently run
N independent copies of the experiment.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

from .errors import ConfigError

STATUS_FILE_VAR = "FEDDDP_STATUS_FILE"
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class ProcessEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"
    local_world_size: int = 1  # ranks on this node (run.device = cuda: more than its GPUs share them)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _ints(environ, names) -> list[int]:
    try:
        return [int(environ[n]) for n in names]
    except ValueError as exc:
        raise ConfigError(f"environment: {', '.join(names)} must be integers ({exc})") from None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[03-05,07],cpu1' -> 'gpu03'. Uses
    ``scontrol show hostnames`` when available, else expands the first entry itself."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=10, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    match = re.match(r"([^,\[]+)(?:\[([^\],]+))?", nodelist)
    if not match:
        raise ConfigError(f"environment: cannot read SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split("-")[0]


def _local_world(environ, name: str, local_rank: int) -> int:
    """The ranks on this node from the launcher's variable ``name`` where it is one number (Slurm
    writes "4(x2)" for uneven nodes), else at least this rank's local rank + 1."""
    value = environ.get(name, "")
    return max(int(value) if value.isdigit() else 0, local_rank + 1)


def resolve(environ=None) -> ProcessEnv:
    environ = os.environ if environ is None else environ
    have_torchrun = [n for n in TORCHRUN_VARS if n in environ]
    if have_torchrun:
        if len(have_torchrun) != len(TORCHRUN_VARS):
            missing = [n for n in TORCHRUN_VARS if n not in environ]
            raise ConfigError(f"environment: {', '.join(have_torchrun)} set but {', '.join(missing)} "
                              "missing; launch with torchrun, or unset them for a single process")
        rank, world, local = _ints(environ, TORCHRUN_VARS)
        addr = environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(environ.get("MASTER_PORT", DEFAULT_PORT))
        return ProcessEnv(rank, world, local, addr, port, "torchrun", _local_world(environ, "LOCAL_WORLD_SIZE", local))
    have_slurm = [n for n in SLURM_VARS if n in environ]
    # SLURM_NTASKS alone appears inside an sbatch script before srun: that is not a task yet.
    if have_slurm and "SLURM_PROCID" in environ:
        if len(have_slurm) != len(SLURM_VARS):
            missing = [n for n in SLURM_VARS if n not in environ]
            raise ConfigError(f"environment: {', '.join(have_slurm)} set but {', '.join(missing)} "
                              "missing; start each task with srun")
        rank, world, local = _ints(environ, SLURM_VARS)
        addr = environ.get("MASTER_ADDR") or first_host(environ.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        # A port derived from the job id keeps two jobs sharing a node from colliding.
        default_port = 20000 + int(environ.get("SLURM_JOB_ID", "9500")) % 20000
        port = int(environ.get("MASTER_PORT", default_port))
        return ProcessEnv(rank, world, local, addr, port, "slurm", _local_world(environ, "SLURM_NTASKS_PER_NODE", local))
    return ProcessEnv(0, 1, 0, "127.0.0.1", DEFAULT_PORT, "single")


VERBOSE_VAR = "FEDDDP_VERBOSE"  # "1": the start line's long form (python -m fedddp --verbose)


def verbose(environ=None) -> bool:
    return (os.environ if environ is None else environ).get(VERBOSE_VAR) == "1"


def write_status(code: int, line: str, order: int, environ=None) -> None:
    """Leave a failed rank's exit status and one-line message where a launcher finds them:
    torchrun reports any failed worker as status 1 inside its own banner, so fedddp.launch (and
    launch/local.sh over it), fedddp.slurm and the sbatch templates name a file in
    FEDDDP_STATUS_FILE and read it back (``read_status``; ``STATUS<TAB>ORDER<TAB>LINE`` per line,
    appended by each rank that failed; the line of the lowest ORDER is the run's).
    ORDER is the rank, plus the world size for a line that only relays another rank's error."""
    path = (os.environ if environ is None else environ).get(STATUS_FILE_VAR)
    if not path:
        return
    record = f"{code}\t{order}\t{' '.join(line.splitlines())}\n".encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, record)  # one write on an O_APPEND file: ranks never interleave
        finally:
            os.close(fd)
    except OSError:
        pass  # the line is on stderr already; the launcher then reports torchrun's status


def read_status(path: str) -> list[tuple[int, int, str]]:
    """The records ``write_status`` left in ``path``: (status, order, line), the run's own (the
    lowest order) first; [] without a file or a record."""
    try:
        with open(path) as fh:
            rows = [line.rstrip("\n").split("\t", 2) for line in fh]
    except OSError:
        return []
    records = [(int(row[0]), int(row[1]), row[2]) for row in rows
               if len(row) == 3 and row[0].isdigit() and row[1].isdigit()]
    return sorted(records, key=lambda record: record[1])
