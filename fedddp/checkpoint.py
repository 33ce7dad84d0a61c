"""Checkpoints that prove themselves: a crash, a full disk or a damaged file can never make a
resumed run continue from anything but a complete checkpoint of the same run.

Layout under ``out_dir/checkpoints/``:
  round_000010/server.pt          rank 0: round, global_P, server state, RNG state, the simulated
                                  clock (async mode: its training clients and their model versions)
  round_000010/clients_rank1.pt   rank r: the persistent state of the clients rank r owns
  round_000010/server_rank1.pt    rank r, run.aggregation = sharded: its range of the server
                                  state's [P] entries that clients do not see (fedddp.sharded)
  round_000010/manifest.json      rank 0, written last: round, world size, run identity, and
                                  every file of the checkpoint with its size and CRC-32
  LATEST                          the name of the newest round folder written (a hint for
                                  people and scripts; resume never relies on it)

Each file is written to a temporary name and renamed (rename is atomic on POSIX), checksummed
as it is written. The manifest is written only after every rank has finished its files, so a
round folder is complete exactly when its manifest exists and every file it lists has the
listed size and checksum; files it does not list (a shard of an older run with another world
size) are ignored. Resume scans the round folders from the newest and takes the first complete
one. The checksum is zlib's CRC-32 over the file bytes: the fastest in the standard library
(figures in docs/architecture.md), and it catches every flipped bit and every burst of up to 32
damaged bits; the manifest's sizes catch truncation. It guards against accidents, not against
someone forging a checkpoint.

Client shards are keyed by client id, so a run may resume on a different number of ranks: each
rank reads every shard the manifest lists and keeps the clients it owns. Server shards carry
their columns [start, stop) of the flat vector: a resume reads them into whatever columns it
needs (its own range, or the whole vector for a gathered run), on any number of ranks. The run identity is
every config key that decides the run's bits (all but ``config.RESUME_MAY_CHANGE``); a resume
whose identity differs is refused. Everything is loaded with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import zlib

import torch

from . import config
from .atomic import atomic_save, atomic_write_text  # noqa: F401 - the run folder's writers
from .errors import DataError, os_error_in

LATEST = "LATEST"
MANIFEST = "manifest.json"
_ROUND = re.compile(r"round_(\d+)")
_FILE = re.compile(r"server\.pt|clients_rank\d+\.pt|server_rank\d+\.pt")


def round_dir(ckpt_root: str, round_idx: int) -> str:
    return os.path.join(ckpt_root, f"round_{round_idx:06d}")


def round_folders(ckpt_root: str) -> list[tuple[int, str]]:
    """(round, folder) of every round_* folder, oldest first."""
    try:
        names = os.listdir(ckpt_root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(int(m.group(1)), os.path.join(ckpt_root, n)) for n in names if (m := _ROUND.fullmatch(n))]
    return sorted(f for f in found if os.path.isdir(f[1]))


def identity(cfg: config.Config) -> dict:
    """The run identity: every resolved key (dotted) that decides the bits of a round."""
    keys = {}
    for section in config.SECTIONS:
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            if f"{section}.{f.name}" not in config.RESUME_MAY_CHANGE:
                keys[f"{section}.{f.name}"] = getattr(obj, f.name)
    return keys


def identity_changes(saved: dict, now: dict) -> list[str]:
    """'key old -> new' for every key whose value differs. A key the checkpoint does not name
    (added to fedddp after it was written) is no change while it keeps its default: a new key's
    default is the behaviour fedddp had before it. ``auto`` now takes what the checkpoint resolved
    it to (config.same_setting: run.parallel_clients), which the resumed run then uses."""
    unset, defaults = "(unset)", identity(config.Config())
    saved = translated(saved, now)
    # a table (algorithm.params) is compared entry by entry: its changed names, not two whole dicts
    saved, now = _flat_tables(saved), _flat_tables(now)
    same = config.same_setting
    return [f"{key} {saved.get(key, unset)!r} -> {now.get(key, unset)!r}"
            for key in sorted(saved.keys() | now.keys()) if not same(key, saved.get(key, unset), now.get(key, unset))
            and not (key not in saved and key in defaults and now.get(key) == defaults[key])]


def translated(saved: dict, now: dict) -> dict:
    """An identity written while the built-in rules' hyperparameters were flat keys
    (algorithm.cong_alpha: config.ALIASES) as it reads today: each becomes the algorithm.params
    entry of that name when the run's rules declare it (``now``'s params hold every declared name),
    and is dropped otherwise, since no rule of that run read it. Keys added since it was written
    (config.BEFORE_THE_KEY) take the value that stands for what fedddp did then."""
    flat = [k for k in saved if k.startswith("algorithm.") and k.removeprefix("algorithm.") in config.ALIASES]
    declared = now.get("algorithm.params") or {}
    if flat:
        params = dict(saved.get("algorithm.params") or {})
        for key in flat:
            name = key.removeprefix("algorithm.")
            if name in declared:
                params.setdefault(name, saved[key])
        saved = {**{k: v for k, v in saved.items() if k not in flat}, "algorithm.params": params}
    return _before_the_keys(saved, now)


def _before_the_keys(saved: dict, now: dict) -> dict:
    """``saved`` with each key added to fedddp after it was written (config.BEFORE_THE_KEY) at the
    value that stands for what the code did then: run.sampling fixed, DP-FedAvg's RDP accountant."""
    saved, declared = dict(saved), now.get("algorithm.params") or {}
    params = dict(saved.get("algorithm.params") or {})
    for key, value in config.BEFORE_THE_KEY.items():
        name = key.removeprefix("algorithm.params.")
        if name != key:
            if name in declared and "algorithm.params" in saved:
                params.setdefault(name, value)
        elif key in now:
            saved.setdefault(key, value)
    if "algorithm.params" in saved:
        saved["algorithm.params"] = params
    return saved


def identity_of(folder: str) -> dict:
    """The run identity a round folder's manifest records ({} without a readable manifest)."""
    manifest, _ = _read_manifest(folder)
    return manifest["identity"] if manifest else {}


def _flat_tables(keys: dict) -> dict:
    flat = {}
    for key, value in keys.items():
        flat.update({f"{key}.{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value})
    return flat


def save(comm, ckpt_root: str, round_idx: int, server: dict | None,
         clients: dict[int, dict[str, torch.Tensor]], identity: dict | None = None, keep: int = 2,
         server_shard: dict | None = None) -> str:
    """Every rank calls this. ``server`` is rank 0's payload (None elsewhere). Returns the folder."""
    return complete(comm, write_files(comm, ckpt_root, round_idx, server, clients, identity, server_shard), keep)


def write_files(comm, ckpt_root: str, round_idx: int, server: dict | None,
                clients: dict[int, dict[str, torch.Tensor]], identity: dict | None = None,
                server_shard: dict | None = None) -> dict:
    """The first half of ``save``: every rank's files of the round, but no manifest yet, so the
    folder is not complete. Returns what ``complete`` needs (the manifest on rank 0). The round
    loop writes the round's metrics rows between the two halves. ``server_shard`` (every rank, or
    none): this rank's {"start", "stop", "numel", "state"} of the server state's ranged entries."""
    folder = round_dir(ckpt_root, round_idx)
    os.makedirs(folder, exist_ok=True)
    if comm.is_main:
        # Rewriting a round (after resuming from an older one): not complete until the new manifest.
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, MANIFEST))
    # Row r: rank r's failure (errno, or -1), its client shard's size and CRC-32, and its server
    # shard's. One all-reduce brings every rank's entry to rank 0, tells every rank whether any
    # failed, and is the barrier before the manifest. The numbers are below 2**53, exact in float64.
    entry_R5 = torch.zeros(comm.world_size, 5, dtype=torch.float64, device=comm.device)
    error = None
    try:
        shard = atomic_save({int(c): s for c, s in clients.items()},
                            os.path.join(folder, f"clients_rank{comm.rank}.pt"))
        entry_R5[comm.rank, 1:3] = torch.tensor([shard["size"], shard["crc32"]], dtype=torch.float64)
        if server_shard is not None:
            part = atomic_save(server_shard, os.path.join(folder, f"server_rank{comm.rank}.pt"))
            entry_R5[comm.rank, 3:] = torch.tensor([part["size"], part["crc32"]], dtype=torch.float64)
        if comm.is_main:
            files = {"server.pt": atomic_save(server, os.path.join(folder, "server.pt"))}
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the others know
        error = exc
        entry_R5[comm.rank, 0] = getattr(os_error_in(exc), "errno", None) or -1
    comm.all_reduce_sum_(entry_R5)
    if error is not None:
        raise error
    failed = entry_R5[:, 0].nonzero().flatten().tolist()
    if failed:
        code = int(entry_R5[failed[0], 0].item())
        if code > 0:
            raise OSError(code, f"{os.strerror(code)} (rank {failed[0]}, writing its part of {folder})")
        raise RuntimeError(f"rank {failed[0]} could not write its part of {folder}")
    manifest = None
    if comm.is_main:
        for r in range(comm.world_size):
            files[f"clients_rank{r}.pt"] = {"size": int(entry_R5[r, 1].item()), "crc32": int(entry_R5[r, 2].item())}
            if server_shard is not None:
                files[f"server_rank{r}.pt"] = {"size": int(entry_R5[r, 3].item()),
                                               "crc32": int(entry_R5[r, 4].item())}
        manifest = {"round": round_idx, "world_size": comm.world_size, "identity": identity or {}, "files": files}
    return {"root": ckpt_root, "folder": folder, "round": round_idx, "manifest": manifest}


def complete(comm, written: dict, keep: int = 2) -> str:
    """The second half of ``save``: rank 0 writes the manifest (the round folder is complete from
    here on), LATEST, and prunes; every rank waits for it. Returns the folder."""
    folder, ckpt_root = written["folder"], written["root"]
    if comm.is_main:
        atomic_write_text(json.dumps(written["manifest"], indent=1, sort_keys=True) + "\n",
                          os.path.join(folder, MANIFEST))
        atomic_write_text(os.path.basename(folder), os.path.join(ckpt_root, LATEST))
        _prune(ckpt_root, written["round"], keep)
    comm.barrier()
    return folder


def _prune(ckpt_root: str, round_idx: int, keep: int) -> None:
    """Keep the ``keep`` newest folders with a manifest up to this round (the one just written,
    complete and finite, is always among them) and drop every folder older than those. Folders
    newer than this round are leftovers (an interrupted save, a copied-in run) and are left
    alone: they must never push out the checkpoint just written."""
    upto = [(r, f) for r, f in round_folders(ckpt_root) if r <= round_idx]
    kept = [r for r, f in upto if os.path.exists(os.path.join(f, MANIFEST))][-keep:]
    for r, f in upto:
        if r < kept[0]:
            shutil.rmtree(f, ignore_errors=True)


def _file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _read_manifest(folder: str) -> tuple[dict | None, str | None]:
    try:
        with open(os.path.join(folder, MANIFEST)) as fh:
            manifest = json.load(fh)
        files = manifest["files"]
        world = int(manifest["world_size"])
        ok = (isinstance(manifest["round"], int) and isinstance(manifest["identity"], dict)
              and all(_FILE.fullmatch(n) and isinstance(e["size"], int) and isinstance(e["crc32"], int)
                      for n, e in files.items())
              and set(files) - {f"server_rank{r}.pt" for r in range(world)}
              == {"server.pt", *(f"clients_rank{r}.pt" for r in range(world))}
              and len({n for n in files if n.startswith("server_rank")}) in (0, world))
    except FileNotFoundError:
        return None, "no manifest (its save did not finish)"
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    return (manifest, None) if ok else (None, "its manifest is unreadable")


def verify(folder: str) -> tuple[dict | None, str | None]:
    """(manifest, None) if the round folder is complete, else (None, why not)."""
    manifest, why = _read_manifest(folder)
    if manifest is None:
        return None, why
    for name, entry in sorted(manifest["files"].items()):
        path = os.path.join(folder, name)
        try:
            size = os.path.getsize(path)
            if size != entry["size"]:
                return None, f"{name} has {size} bytes, its manifest {entry['size']}"
            if _file_crc32(path) != entry["crc32"]:
                return None, f"{name} fails its checksum"
        except FileNotFoundError:
            return None, f"{name} is missing"
    return manifest, None


def newest_complete(ckpt_root: str) -> tuple[str | None, dict | None, list[str]]:
    """(folder, manifest, skipped): the newest complete round folder, and 'name: why' for every
    newer one that is not complete. (None, None, skipped) if none is."""
    skipped = []
    for _, folder in reversed(round_folders(ckpt_root)):
        manifest, why = verify(folder)
        if manifest is not None:
            return folder, manifest, skipped
        skipped.append(f"{os.path.basename(folder)}: {why}")
    return None, None, skipped


def latest(ckpt_root: str) -> str | None:
    """The newest complete round folder, or None."""
    return newest_complete(ckpt_root)[0]


def how_to_continue(out_dir: str | None) -> str:
    """What a stopped run's line says after its cause: how the same command continues it, from
    the newest complete checkpoint in ``out_dir/checkpoints``."""
    found = latest(os.path.join(out_dir, "checkpoints")) if out_dir else None
    if found:
        return (f"the same command with run.resume=true continues from the checkpoint of round "
                f"{int(os.path.basename(found).split('_')[1])}")
    if out_dir:
        return "before its first checkpoint (run.ckpt_every); the same command with run.resume=true starts over"
    return "the same command with run.resume=true continues from the last checkpoint"


def load(folder: str, owned: set[int], device,
         columns: tuple[int, int] | None = None) -> tuple[dict, dict[int, dict[str, torch.Tensor]]]:
    """The server payload and the states of the ``owned`` clients, from the files the manifest
    lists (each checked again: the folder was verified by rank 0, maybe on another node). A
    sharded run's server shards join the payload's state cut to ``columns`` (None: whole)."""
    manifest, why = _read_manifest(folder)
    if manifest is None:
        raise DataError(f"checkpoint {folder}: {why}; resume again to fall back to an older round")

    def read(name: str):
        path, entry = os.path.join(folder, name), manifest["files"][name]
        if not os.path.exists(path) or os.path.getsize(path) != entry["size"] or _file_crc32(path) != entry["crc32"]:
            raise DataError(f"checkpoint {path} changed after it was checked; resume again to fall back "
                            "to an older round")
        return torch.load(path, map_location=device, weights_only=True)

    server = read("server.pt")
    shards = [f"server_rank{r}.pt" for r in range(manifest["world_size"]) if f"server_rank{r}.pt" in manifest["files"]]
    if shards:
        server["state"] = dict(server["state"]) | _columns_of(read, shards, columns)
    clients: dict[int, dict[str, torch.Tensor]] = {}
    for r in range(manifest["world_size"]):
        for cid, state in read(f"clients_rank{r}.pt").items():
            if cid in owned:
                clients[cid] = state
    return server, clients


def _columns_of(read, names: list[str], columns: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """The ranged state entries over ``columns`` (None: the whole vector), from server shards that
    each hold [start, stop) of them: one shard read at a time, only its overlap kept."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        part = read(name)
        start, stop = part["start"], part["stop"]
        c0, c1 = columns if columns is not None else (0, part["numel"])
        lo, hi = max(start, c0), min(stop, c1)
        for key, range_n in part["state"].items():
            if key not in out:
                out[key] = torch.empty(c1 - c0, dtype=range_n.dtype, device=range_n.device)
            if hi > lo:
                out[key][lo - c0:hi - c0] = range_n[lo - start:hi - start]
    return out
