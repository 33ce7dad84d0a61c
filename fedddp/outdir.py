"""One run per ``run.out_dir``: the folder is checked and locked before any data is loaded.

``open_out_dir`` (rank 0) makes sure the folder is usable (a folder, creatable, writable) and
takes an exclusive ``fcntl.flock`` on ``out_dir/.lock`` for the run's life; the lock file holds
the holder's pid and host, so a second run into the folder can say who has it. The OS drops a
flock when its process dies, so a killed run (and a group that torchrun restarts) never leaves
a stale lock behind. ``check_out_dir`` makes its refusals without making or locking anything
(``python -m fedddp --check``). ``disk_full_is_one_line`` turns a full disk into one line naming
the file system and the last complete checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import socket
import sys

from .errors import ConfigError, DiskFullError, os_error_in

LOCK = ".lock"
# What a finished or interrupted run leaves; a fresh run into a folder holding any is refused.
RESULTS = ("metrics.jsonl", "final.pt", "checkpoints")


class OutDirLock:
    def __init__(self, fh):
        self.fh = fh

    def release(self) -> None:
        if self.fh is not None:
            self.fh.close()  # closing the file drops the flock
            self.fh = None


def open_out_dir(out_dir: str) -> OutDirLock:
    """Create ``out_dir`` if needed and lock it, or one ConfigError saying why not."""
    check_out_dir(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
        fh = open(os.path.join(out_dir, LOCK), "a+")
    except OSError as exc:  # what check_out_dir cannot foresee (a full disk), or a change since
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"{exc.strerror}: cannot create {out_dir} or its lock file") from None
        raise _unwritable(out_dir, exc.strerror) from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # a run that took the folder since check_out_dir looked
        fh.seek(0)
        holder = fh.read().strip() or "unknown pid"
        fh.close()
        raise _in_use(out_dir, holder) from None
    except OSError as exc:  # a file system without locks (some NFS setups): run, but say so
        print(f"fedddp: warning: cannot lock {out_dir} ({exc.strerror}); make sure no other run uses it",
              file=sys.stderr, flush=True)
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    fh.flush()
    return OutDirLock(fh)


def check_out_dir(out_dir: str) -> None:
    """open_out_dir's refusals, making and locking nothing, so ``python -m fedddp --check`` makes
    them too: an empty name, a file, a folder that cannot be made or written, one that a run
    holds."""
    if not out_dir.strip():
        raise ConfigError("run.out_dir: empty; name the run's output folder, e.g. run.out_dir=runs/x")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"run.out_dir: {out_dir} is a file, not a folder; pick another run.out_dir")
    existing = _existing(out_dir)  # the folder, or where os.makedirs would start making it
    if not os.path.isdir(existing):
        raise _unwritable(out_dir, os.strerror(errno.ENOTDIR))
    if not os.access(existing, os.W_OK | os.X_OK):
        read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        raise _unwritable(out_dir, os.strerror(errno.EROFS if read_only else errno.EACCES))
    holder = _holder(out_dir)
    if holder is not None:
        raise _in_use(out_dir, holder)


def _holder(out_dir: str) -> str | None:
    """Who holds ``out_dir``'s lock ("pid N on HOST"), or None where no run does. A shared lock,
    dropped at once, conflicts only with a run's exclusive one."""
    try:
        fh = open(os.path.join(out_dir, LOCK))
    except OSError:
        return None  # no lock file: no run has held the folder
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return fh.read().strip() or "unknown pid"
        except OSError:
            return None  # a file system without locks: the run warns and runs
    return None


def _unwritable(out_dir: str, why: str) -> ConfigError:
    return ConfigError(f"run.out_dir: cannot write to {out_dir} ({why}); pick a writable run.out_dir")


def _in_use(out_dir: str, holder: str) -> ConfigError:
    return ConfigError(f"run.out_dir: {out_dir} is in use by another run ({holder}); wait for it to end or pick "
                       "another run.out_dir")


def results_in(out_dir: str) -> list[str]:
    """The names in ``out_dir`` that an earlier run left (an empty checkpoints/ does not count)."""
    found = []
    for name in RESULTS:
        path = os.path.join(out_dir, name)
        if name == "checkpoints":
            if os.path.isdir(path) and any(n.startswith("round_") for n in os.listdir(path)):
                found.append(name + "/")
        elif os.path.exists(path):
            found.append(name)
    return found


def refuse_fresh_run(out_dir: str, overwrite: bool) -> list[str]:
    """The earlier results a fresh run would replace; a ConfigError if it may not (no
    run.overwrite). Also run by ``python -m fedddp --check``, so a launcher refuses before any
    rank starts (and before torchrun --max-restarts could restart the refused run as a resume)."""
    found = results_in(out_dir)
    if found and not overwrite:
        raise ConfigError(f"run.out_dir: {out_dir} already holds a run's results ({', '.join(found)}); "
                          "continue it with run.resume=true, replace it with run.overwrite=true, or pick "
                          "another run.out_dir")
    return found


def refuse_or_clear(out_dir: str, overwrite: bool) -> None:
    """A fresh run never mixes with, or silently deletes, an earlier run's results."""
    if not refuse_fresh_run(out_dir, overwrite):
        return
    for name in RESULTS + ("config.toml",):
        path = os.path.join(out_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def _full_disk(exc: BaseException) -> OSError | None:
    error = os_error_in(exc)
    return error if error is not None and error.errno in (errno.ENOSPC, errno.EDQUOT) else None


def _mount_point(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def _existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


@contextlib.contextmanager
def disk_full_is_one_line(what: str, where: str, last_checkpoint: str | None):
    """A full disk (or quota) while writing ``what`` under ``where`` becomes one DiskFullError."""
    try:
        yield
    except Exception as exc:
        full = _full_disk(exc)
        if full is None:
            raise
        dev = os.stat(_existing(where)).st_dev
        # Without a complete checkpoint a plain rerun is refused (the folder holds results);
        # run.resume=true starts from round 1, removing round folders whose save never finished.
        resume = (f"the last complete checkpoint is {last_checkpoint}: free space and continue with "
                  "run.resume=true") if last_checkpoint else \
            "no complete checkpoint yet: free space and rerun with run.resume=true (it starts from round 1)"
        raise DiskFullError(f"{full.strerror} on the file system at {_mount_point(_existing(where))} (device "
                            f"{os.major(dev)}:{os.minor(dev)}) while writing {what} in {where}; "
                            f"{resume}") from None
