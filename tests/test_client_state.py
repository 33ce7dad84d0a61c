"""Per-client persistent state: the memory and memory-mapped stores, and the runtime invariants
with state (world-size invariance with 1, 2 and 4 ranks, resume across a stop) through real
processes."""

from __future__ import annotations

import pytest
import torch

from fedddp import checkpoint, checks, config, env
from fedddp.client.state import MmapStore, open_store
from fedddp.comm import Comm
from fedddp.env import ProcessEnv
from fedddp.round import run

from fedrun import QUICKSTART, assert_same_state, final_state, metrics, run_fedddp, run_fedddp_each, run_here, selected

SINGLE = ProcessEnv(0, 1, 0, "127.0.0.1", 0, "single")
CPU = torch.device("cpu")


# -- the stores ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["memory", "mmap"])
def test_store_round_trip(tmp_path, kind):
    store = open_store(kind, [1, 3, 5, 7], str(tmp_path / "cs"), CPU)
    assert store.items() == []
    a = store.client(3)
    assert "c" not in a and a.get("c") is None and len(a) == 0
    a["c"] = torch.arange(6.0).view(2, 3)
    a["n"] = torch.tensor([4], dtype=torch.int64)
    store.client(7)["c"] = torch.full((2, 3), -1.0)
    assert torch.equal(store.client(3)["c"], torch.arange(6.0).view(2, 3))
    assert store.client(3)["n"].dtype == torch.int64 and int(store.client(3)["n"]) == 4
    assert sorted(store.client(3)) == ["c", "n"] and len(store.client(7)) == 1
    a["c"] = torch.zeros(2, 3)  # overwrite
    assert torch.equal(store.client(3)["c"], torch.zeros(2, 3))
    saved = {c: {k: v.clone() for k, v in s.items()} for c, s in store.items()}
    assert sorted(saved) == [3, 7]
    other = open_store(kind, [1, 3, 5, 7], str(tmp_path / "cs2"), CPU)
    other.restore(saved)
    assert {c: sorted(s) for c, s in other.items()} == {3: ["c", "n"], 7: ["c"]}
    assert torch.equal(other.client(7)["c"], torch.full((2, 3), -1.0))
    assert store.nbytes() == other.nbytes() == 2 * 6 * 4 + 8


def test_mmap_store_is_sparse_scratch_and_checks_shapes(tmp_path):
    folder = tmp_path / "cs"
    store = MmapStore(str(folder), list(range(0, 4000, 2)), CPU)
    store.client(1998)["c"] = torch.ones(100_000)
    path = folder / "c.bin"
    assert path.stat().st_size == 2000 * 100_000 * 4
    assert path.stat().st_blocks * 512 < 4 * 100_000 * 4  # only the written row takes disk
    with pytest.raises(ValueError, match="same shape"):
        store.client(0)["c"] = torch.ones(5)
    with pytest.raises(KeyError):
        store.client(1)  # owned by another rank
    again = MmapStore(str(folder), list(range(0, 4000, 2)), CPU)  # a new run starts empty
    assert again.items() == [] and not path.exists()
    again.close()
    assert not folder.exists()


def test_checkpoint_captures_mmap_state(tmp_path):
    store = MmapStore(str(tmp_path / "cs"), [0, 2, 4], CPU)
    store.client(2)["c"] = torch.randn(1000)
    store.client(4)["prev"] = torch.randn(10)
    checkpoint.save(Comm(env.resolve({}), "cpu"), str(tmp_path / "ck"), 1, {"round": 1}, store)
    _, loaded = checkpoint.load(checkpoint.latest(str(tmp_path / "ck")), {0, 2, 4}, CPU)
    assert sorted(loaded) == [2, 4]
    assert torch.equal(loaded[2]["c"], store.client(2)["c"])
    assert torch.equal(loaded[4]["prev"], store.client(4)["prev"])


# -- in-process runs: memory and mmap give the same model ------------------------------------

@pytest.mark.parametrize("name", ["scaffold", "moon", "fedsmoo"])
@pytest.mark.e2e
def test_mmap_and_memory_runs_agree(tmp_path, name):
    results = []
    for kind in ("memory", "mmap"):
        cfg = checks.load(QUICKSTART, [f"algorithm.name={name}", "run.rounds=4", "run.eval_every=4",
                                       "run.clients_per_round=12",
                                       f"run.out_dir={tmp_path / kind}", "run.progress=false",
                                       f"run.client_state={kind}"])
        results.append(run(cfg, Comm(SINGLE, "cpu"))["global_P"])
    assert torch.equal(results[0], results[1])
    assert not (tmp_path / "mmap" / "client_state").exists()  # scratch removed at the end


# -- real processes: world-size invariance and resume with per-client state -----------------

FEW = ["run.rounds=4", "run.clients_per_round=10", "run.eval_every=5", "run.ckpt_every=0"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["scaffold", "moon"])
@pytest.mark.processes
@pytest.mark.e2e
def test_world_size_invariance_with_client_state(tmp_path, name, several_ranks):
    run_here(FEW + [f"algorithm.name={name}", "run.client_state=memory", f"run.out_dir={tmp_path / 'w1'}"])
    one = final_state(tmp_path / "w1")
    for nproc, kind in WORLDS[1:]:
        assert_same_state(one, final_state(several_ranks[name, nproc]))


WORLDS = ((1, "memory"), (2, "memory"), (4, "mmap"))  # (ranks, run.client_state)


@pytest.fixture(scope="module")
def several_ranks(request, tmp_path_factory) -> dict:
    """{(rule, ranks): out_dir}: the selected rules' runs on 2 and on 4 ranks, one torchrun for
    each world size, each run in a process group of its own."""
    names, root, outs = selected(request, "test_world_size_invariance_with_client_state", "name"), \
        tmp_path_factory.mktemp("ranks"), {}
    for nproc, kind in WORLDS[1:]:
        outs |= {(name, nproc): root / f"{name}_w{nproc}" for name in names}
        if names:
            run_fedddp_each([FEW + [f"algorithm.name={name}", f"run.client_state={kind}",
                                    f"run.out_dir={outs[name, nproc]}"] for name in names], nproc=nproc)
    return outs


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_resume_equivalence_scaffold_mmap(tmp_path):
    """Stop after round 3 on 2 ranks (c_k in each rank's shard, read from the memory-mapped
    files; c in the server state), resume on 4: the same model as never stopping."""
    full, part = tmp_path / "full", tmp_path / "part"
    args = ["algorithm.name=scaffold", "run.rounds=6", "run.clients_per_round=12", "run.ckpt_every=3",
            "run.eval_every=1", "run.client_state=mmap"]
    run_here(args + [f"run.out_dir={full}"])
    run_fedddp(args + [f"run.out_dir={part}", "run.stop_after=3"], nproc=2)
    assert not (part / "final.pt").exists()
    shards = sorted(p.name for p in (part / "checkpoints" / "round_000003").iterdir())
    assert shards == ["clients_rank0.pt", "clients_rank1.pt", "manifest.json", "server.pt"]
    saved = torch.load(part / "checkpoints" / "round_000003" / "clients_rank1.pt", weights_only=True)
    assert saved and all(cid % 2 == 1 and set(s) == {"control_P"} for cid, s in saved.items())
    run_fedddp(args + [f"run.out_dir={part}", "run.resume=true"], nproc=4)
    assert_same_state(final_state(full), final_state(part))
    assert [m["test_accuracy"] for m in metrics(part)] == [m["test_accuracy"] for m in metrics(full)]
