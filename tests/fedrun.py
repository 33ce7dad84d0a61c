"""Helpers for tests that run real experiments: ``python -m fedddp`` and real ``torchrun``."""

from __future__ import annotations

import gzip
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.toml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _argv(config: str | None, args) -> list[str]:
    """``[config] + args`` with run.progress=false after the config file (a config file may also
    be the first of ``args``); a later run.progress in ``args`` wins."""
    argv = ([config] if config else []) + list(args)
    at = 1 if argv and "=" not in argv[0] else 0
    return argv[:at] + ["run.progress=false"] + argv[at:]


def run_fedddp(args: list[str], nproc: int = 1, config: str | None = QUICKSTART, env=None,
               timeout: int = 300, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m fedddp`` for one rank, real ``torchrun`` for several."""
    cmd = [sys.executable, "-m", "fedddp"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "fedddp"]
    cmd += _argv(config, args)
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def run_fedddp_each(runs: list[list[str]], nproc: int, config: str | None = QUICKSTART, env=None,
                    timeout: int = 600) -> None:
    """Several runs on ``nproc`` ranks under one real ``torchrun`` (tests/torchrun_runs.py): each
    rank runs them one after another, as ``python -m fedddp`` each, in a process group of its
    own each time. For tests that compare many configurations across world sizes: the ranks,
    the gloo collectives and the checkpoints are those of separate torchruns; only the start of
    the Python processes, each importing torch, is shared."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="runs-")
    with os.fdopen(fd, "w") as fh:
        json.dump([_argv(config, args) for args in runs], fh)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_runs.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", script, path]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
        done = open(path + ".status").read().split() if os.path.exists(path + ".status") else []
    finally:
        for leftover in (path, path + ".status"):
            if os.path.exists(leftover):
                os.remove(leftover)
    if proc.returncode != 0 or done != ["0"] * len(runs):
        at = len(done) - 1 if done and done[-1] != "0" else len(done)  # the run that failed or never ended
        which = f"run {at + 1} of {len(runs)} ({' '.join(runs[at])})" if at < len(runs) else "after the runs"
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}, statuses {done}: failed at {which}:\n"
                             f"{proc.stderr[-4000:]}")


def run_here(args: list[str], config: str | None = QUICKSTART, check: bool = True) -> int:
    """``python -m fedddp`` for one rank, in this process: ``fedddp.__main__.main``, the function
    the module runs (the results are bitwise the same: the run pins its thread count and seeds).
    It saves starting a Python and importing torch where the test is about the run, not the
    process; torch's global settings are restored afterwards, as ``fedddp.run`` does."""
    from fedddp.__main__ import main
    from fedddp.api import _TorchGlobals

    saved = _TorchGlobals()
    try:
        status = main(_argv(config, args))
    finally:
        saved.restore()
    if check and status != 0:
        raise AssertionError(f"fedddp {' '.join(args)} exited {status}")
    return status


def selected(request, test_name: str, argname: str) -> list:
    """The values of ``argname`` of the selected tests named ``test_name`` in the requesting
    module, in order: what a module-scoped fixture that starts one process for several
    parametrized tests has to run (all of them for the whole suite, one for ``-k``)."""
    values = []
    for item in request.session.items:
        if getattr(item, "originalname", None) == test_name and item.module is request.module:
            value = item.callspec.params[argname]
            if value not in values:
                values.append(value)
    return values


def is_selected(request, test_name: str) -> bool:
    """Whether a test named ``test_name`` in the requesting module is selected to run."""
    return any(getattr(item, "originalname", None) == test_name and item.module is request.module
               for item in request.session.items)


def final_state(out_dir) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(out_dir, "final.pt"), weights_only=True)


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs: max |diff| {(a[key].float() - b[key].float()).abs().max()}"


def metrics(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def client_rows(out_dir) -> list[dict]:
    """clients.jsonl: one row per (round, reporting client)."""
    with open(os.path.join(out_dir, "clients.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def write_idx(path: str, array: np.ndarray) -> None:
    """An IDX file as MNIST ships it (gzip, big-endian dims, uint8 data)."""
    magic = struct.pack(">HBB", 0, 0x08, array.ndim)
    dims = struct.pack(">" + "I" * array.ndim, *array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(magic + dims + array.astype(np.uint8).tobytes())


def make_mnist_like(root: str, num: int = 600, seed: int = 0, splits=("t10k",)) -> None:
    """A learnable stand-in for MNIST in the torchvision layout: each class is a fixed sparse
    random stroke pattern (mostly black, like digits) with pixels dropped and noise added, so a
    CNN gets well above chance in a few rounds."""
    rng = np.random.default_rng(seed)
    patterns = (rng.random((10, 28, 28)) < 0.2) * 255.0
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    for split in splits:
        labels = rng.integers(0, 10, num)
        keep = rng.random((num, 28, 28)) > 0.2
        images = np.clip(patterns[labels] * keep + rng.integers(0, 40, (num, 28, 28)), 0, 255)
        write_idx(os.path.join(raw, f"{split}-images-idx3-ubyte.gz"), images)
        write_idx(os.path.join(raw, f"{split}-labels-idx1-ubyte.gz"), labels)


# Slow enough rounds (an MLP, 2 local epochs, 10 clients) that a rank can be killed mid-run.
SLOW = ["model.name=mlp", "model.hidden=128", "train.local_epochs=2", "run.rounds=10",
        "run.clients_per_round=10", "run.eval_every=5", "run.ckpt_every=2"]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc, no psutil needed)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def environ_of(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            items = fh.read().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def rank_pid(root_pid: int, rank: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in descendants(root_pid):
            if environ_of(pid).get("RANK") == str(rank):
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no process with RANK={rank} under {root_pid}")


def wait_for_rounds(out, count: int, proc: subprocess.Popen, log, timeout: float = 120) -> None:
    path = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = "" if log is None else (log.seek(0), log.read()[-4000:])[1]
            raise AssertionError(f"the run ended (status {proc.returncode}) before round {count}:\n{text}")
        if os.path.exists(path):
            with open(path) as fh:
                if sum(1 for line in fh if line.strip()) >= count:
                    return
        time.sleep(0.05)
    raise AssertionError(f"round {count} not reached in {timeout} s")
