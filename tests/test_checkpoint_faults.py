"""Fault injection on checkpoints: every way a round folder or LATEST can be damaged, and every
changed config key, against one uninterrupted reference run. For each case the resumed run
either ends bitwise equal to the reference or refuses, with its exit status and one line.

SCAFFOLD, so the client shards carry state (c_k) that decides the model: a lost or stale shard
changes the bits. Checkpoints at rounds 2 and 4 of a run stopped after round 4; every case
damages a copy of that folder and resumes it to round 6."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from fedddp.__main__ import main as fedddp_main
from fedrun import QUICKSTART, assert_same_state, final_state, metrics, run_fedddp

ARGS = [QUICKSTART, "algorithm.name=scaffold", "run.rounds=6", "run.clients_per_round=7", "run.eval_every=2",
        "run.ckpt_every=2", "run.progress=false"]
R2, R4 = "checkpoints/round_000002", "checkpoints/round_000004"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "reference"
    assert fedddp_main(ARGS + [f"run.out_dir={out}"]) == 0
    return out


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "stopped"
    assert fedddp_main(ARGS + [f"run.out_dir={out}", "run.stop_after=4"]) == 0
    assert sorted(os.listdir(out / "checkpoints")) == ["LATEST", "round_000002", "round_000004"]
    return out


def _flip_bit(path, where=0.5):
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# (case, damage(out), round resumed from, words the line must hold); round None: refused.
CASES = [
    ("server missing", lambda o: (o / R4 / "server.pt").unlink(), 2, "round_000004: server.pt is missing"),
    ("shard missing", lambda o: (o / R4 / "clients_rank0.pt").unlink(), 2, "clients_rank0.pt is missing"),
    ("manifest missing (save interrupted)", lambda o: (o / R4 / "manifest.json").unlink(), 2, "no manifest"),
    ("manifest garbled", lambda o: (o / R4 / "manifest.json").write_text('{"files": [1'), 2, "manifest is unreadable"),
    ("server truncated", lambda o: _truncate(o / R4 / "server.pt"), 2, "server.pt has"),
    ("shard truncated", lambda o: _truncate(o / R4 / "clients_rank0.pt"), 2, "clients_rank0.pt has"),
    ("server bit flipped", lambda o: _flip_bit(o / R4 / "server.pt"), 2, "server.pt fails its checksum"),
    ("shard bit flipped", lambda o: _flip_bit(o / R4 / "clients_rank0.pt", 0.9), 2,
     "clients_rank0.pt fails its checksum"),
    # an older run with 2 ranks left its rank-1 shard (of round 2) in the folder
    ("stale shard of another world size",
     lambda o: shutil.copy(o / R2 / "clients_rank0.pt", o / R4 / "clients_rank1.pt"), 4, ""),
    ("extra files", lambda o: ((o / R4 / "clients_rank7.pt").write_bytes(b"garbage"),
                               (o / R4 / "notes.txt").write_text("x")), 4, ""),
    ("LATEST missing", lambda o: (o / "checkpoints" / "LATEST").unlink(), 4, ""),
    ("LATEST garbled", lambda o: (o / "checkpoints" / "LATEST").write_bytes(b"round_00\x00\xff"), 4, ""),
    ("LATEST points at the older round", lambda o: (o / "checkpoints" / "LATEST").write_text("round_000002"), 4, ""),
    ("newest complete, older damaged", lambda o: _flip_bit(o / R2 / "server.pt"), 4, ""),
]


def _resume(stopped, tmp_path, capsys, damage=None, extra=(), nproc=1):
    out = tmp_path / "o"
    shutil.copytree(stopped, out)
    if damage is not None:
        damage(out)
    capsys.readouterr()
    args = ARGS + [f"run.out_dir={out}", "run.resume=true", *extra]
    if nproc == 1:
        status, err = fedddp_main(args), capsys.readouterr().err
    else:
        proc = run_fedddp(args[1:], nproc=nproc, check=False)
        status, err = proc.returncode, proc.stderr
    return out, status, [line for line in err.splitlines() if line.startswith("fedddp:")]


@pytest.mark.parametrize("case,damage,from_round,words", CASES, ids=[c[0] for c in CASES])
@pytest.mark.e2e
def test_damaged_checkpoint_resumes_bitwise_from_the_newest_complete_round(
        case, damage, from_round, words, reference, stopped, tmp_path, capsys):
    """Regression: a missing or stale shard was accepted (other client states, another model),
    a truncated server.pt was a traceback, a flipped bit loaded silently, a missing or garbled
    LATEST restarted from round 1."""
    out, status, lines = _resume(stopped, tmp_path, capsys, damage)
    assert status == 0, lines
    assert len(lines) == 1 and lines[0].startswith(f"fedddp: resuming from round {from_round} ("), lines
    assert words in lines[0]
    assert_same_state(final_state(reference), final_state(out))
    assert [m["round"] for m in metrics(out)] == list(range(1, 7))
    assert [m["test_accuracy"] for m in metrics(out)] == [m["test_accuracy"] for m in metrics(reference)]


@pytest.mark.e2e
def test_no_complete_round_folder_refuses_with_status_3(stopped, tmp_path, capsys):
    """Round folders exist but none is complete: nothing to resume from, and starting over
    silently would throw the user's rounds away."""
    def damage(out):
        _truncate(out / R4 / "server.pt")
        (out / R2 / "manifest.json").unlink()
    out, status, lines = _resume(stopped, tmp_path, capsys, damage)
    assert status == 3 and len(lines) == 1, lines
    assert "none is complete" in lines[0] and "round_000004: server.pt has" in lines[0]
    assert "round_000002: no manifest" in lines[0]
    assert not (out / "final.pt").exists() and len(metrics(out)) == 4


def _damage_line(path, number):
    """Line ``number`` of a metrics file begins with a stray byte where its round was."""
    lines = path.read_bytes().split(b"\n")
    lines[number - 1] = b"#" + lines[number - 1][1:]
    path.write_bytes(b"\n".join(lines))


@pytest.mark.parametrize("name,number", [("metrics.jsonl", 3), ("clients.jsonl", 5), ("metrics.csv", 2)])
@pytest.mark.e2e
def test_a_damaged_row_refuses_the_resume_in_one_line_naming_it(name, number, stopped, tmp_path, capsys):
    """Regression: one damaged line in metrics.jsonl made the resume a JSONDecodeError traceback.
    The checkpoint says which rows stay, but not what a damaged one held: the resume is refused
    (exit 3) naming the file and the line, before any data loads, and no file is rewritten."""
    out, status, lines = _resume(stopped, tmp_path, capsys, lambda o: _damage_line(o / name, number))
    assert status == 3 and len(lines) == 1, lines
    assert lines[0].startswith(f"fedddp: error: {out / name}: line {number} is damaged ("), lines
    assert "repair that line and resume again, or start over with run.resume=false run.overwrite=true" in lines[0]
    for other in ("metrics.jsonl", "clients.jsonl", "metrics.csv"):
        if other != name:
            assert (out / other).read_bytes() == (stopped / other).read_bytes(), other


CHANGES = [
    ("data.num_clients=20", "data.num_clients 30 -> 20"),
    ("run.seed=7", "run.seed 0 -> 7"),
    ("model.name=mlp", "model.name 'logistic' -> 'mlp'"),
    ("algorithm.name=fedavg", "algorithm.name 'scaffold' -> 'fedavg'"),
    ("train.lr=0.02", "train.lr 0.01 -> 0.02"),
]


@pytest.mark.parametrize("override,words", CHANGES, ids=[c[0] for c in CHANGES])
@pytest.mark.e2e
def test_resume_with_another_run_identity_is_refused_and_touches_nothing(
        override, words, stopped, tmp_path, capsys):
    """Regression: a resume with another num_clients or seed ran rounds 5-6 on other data and
    overwrote config.toml; another model or algorithm was a traceback (size mismatch,
    KeyError)."""
    def snapshot(root):
        return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}
    out = tmp_path / "o"
    shutil.copytree(stopped, out)
    before = snapshot(out)
    shutil.rmtree(out)
    out, status, lines = _resume(stopped, tmp_path, capsys, extra=[override])
    assert status == 2 and len(lines) == 1, lines
    assert "is of another run" in lines[0] and words in lines[0]
    after = snapshot(out)
    assert [p.relative_to(out) for p in after] == [p.relative_to(out) for p in before]
    assert list(after.values()) == list(before.values())  # config.toml, metrics, checkpoints


@pytest.mark.e2e
def test_keys_that_may_change_on_resume_keep_the_bits(reference, stopped, tmp_path, capsys):
    out, status, lines = _resume(stopped, tmp_path, capsys,
                                 extra=["run.eval_every=3", "run.ckpt_every=3", "run.client_state=mmap"])
    assert status == 0 and lines == [f"fedddp: resuming from round 4 ({out / R4})"], lines
    assert_same_state(final_state(reference), final_state(out))


@pytest.mark.e2e
def test_rounds_below_the_checkpoint_is_refused(stopped, tmp_path, capsys):
    """Regression: run.rounds=3 with a round-4 checkpoint exited 0 and wrote nothing."""
    out, status, lines = _resume(stopped, tmp_path, capsys, extra=["run.rounds=3"])
    assert status == 2 and len(lines) == 1, lines
    assert "run.rounds: 3 is below" in lines[0] and "run.rounds >= 4" in lines[0]


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_stale_shard_is_ignored_when_resuming_on_another_world_size(reference, stopped, tmp_path, capsys):
    """Regression: a stale clients_rank1.pt in the round folder (left by an older 2-rank run)
    overwrote the saved client states of a 1-rank run that resumed on 2 ranks."""
    out, status, lines = _resume(
        stopped, tmp_path, capsys, nproc=2,
        damage=lambda o: shutil.copy(o / R2 / "clients_rank0.pt", o / R4 / "clients_rank1.pt"))
    assert status == 0 and lines == [f"fedddp: resuming from round 4 ({out / R4})"], lines
    assert_same_state(final_state(reference), final_state(out))


def test_manifest_lists_every_file_with_size_and_checksum(stopped):
    import json
    import zlib
    manifest = json.loads((stopped / R4 / "manifest.json").read_text())
    assert manifest["round"] == 4 and manifest["world_size"] == 1
    assert set(manifest["files"]) == {"server.pt", "clients_rank0.pt"}
    for name, entry in manifest["files"].items():
        data = (stopped / R4 / name).read_bytes()
        assert entry == {"size": len(data), "crc32": zlib.crc32(data)}
    assert manifest["identity"]["algorithm.name"] == "scaffold" and "run.rounds" not in manifest["identity"]
    server = torch.load(stopped / R4 / "server.pt", weights_only=True)
    assert server["round"] == 4
