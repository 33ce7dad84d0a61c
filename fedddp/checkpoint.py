"""Atomic checkpoints: a crash at any instant leaves the previous checkpoint intact.

Layout under ``out_dir/checkpoints/``:
  round_000010/server.pt          rank 0: round, global_P, server state, RNG state
  round_000010/clients_rank1.pt   rank r: the persistent state of the clients rank r owns
  LATEST                          the name of the newest complete round_* folder

Each file is written to a temporary name and renamed (rename is atomic on POSIX). LATEST is
rewritten only after every rank has finished its files (a barrier), so it never points at a
half-written checkpoint. Client shards are keyed by client id, so a run may resume on a
different number of ranks: each rank reads every shard and keeps the clients it owns.
Everything is loaded with ``weights_only=True``.
"""

from __future__ import annotations

import glob
import os
import shutil

import torch

LATEST = "LATEST"


def atomic_save(obj, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def atomic_write_text(text: str, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def round_dir(ckpt_root: str, round_idx: int) -> str:
    return os.path.join(ckpt_root, f"round_{round_idx:06d}")


def save(comm, ckpt_root: str, round_idx: int, server: dict | None,
         clients: dict[int, dict[str, torch.Tensor]], keep: int = 2) -> None:
    """Every rank calls this. ``server`` is rank 0's payload (None elsewhere)."""
    folder = round_dir(ckpt_root, round_idx)
    os.makedirs(folder, exist_ok=True)
    atomic_save({int(c): s for c, s in clients.items()}, os.path.join(folder, f"clients_rank{comm.rank}.pt"))
    if comm.is_main:
        atomic_save(server, os.path.join(folder, "server.pt"))
    comm.barrier()
    if comm.is_main:
        atomic_write_text(os.path.basename(folder), os.path.join(ckpt_root, LATEST))
        # Only folders up to this round: a newer one is a leftover (an interrupted save, an older
        # run in the same out_dir) and must not push the checkpoint just written out.
        complete = sorted(f for f in glob.glob(os.path.join(ckpt_root, "round_*")) if f <= folder)
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    comm.barrier()


def forget(ckpt_root: str) -> None:
    """Drop the LATEST pointer (a fresh run starts); the round folders stay on disk."""
    try:
        os.remove(os.path.join(ckpt_root, LATEST))
    except FileNotFoundError:
        pass


def latest(ckpt_root: str) -> str | None:
    try:
        with open(os.path.join(ckpt_root, LATEST)) as fh:
            name = fh.read().strip()
    except FileNotFoundError:
        return None
    folder = os.path.join(ckpt_root, name)
    return folder if os.path.isdir(folder) else None


def load(folder: str, owned: set[int], device) -> tuple[dict, dict[int, dict[str, torch.Tensor]]]:
    server = torch.load(os.path.join(folder, "server.pt"), map_location=device, weights_only=True)
    clients: dict[int, dict[str, torch.Tensor]] = {}
    for shard in sorted(glob.glob(os.path.join(folder, "clients_rank*.pt"))):
        for cid, state in torch.load(shard, map_location=device, weights_only=True).items():
            if cid in owned:
                clients[cid] = state
    return server, clients
