"""Per-client state travels with its client: every local rule is balanced over ranks, the owner
rank stays the state's home (store, checkpoint shard), and a client trained on another rank gets
its state there for the round and sends the new one back (fedddp.client.state.fetch/send_home).

The end-to-end runs use the synthetic clients of the quickstart (12 clients of 47 to 2,199
samples), a small MLP and 3 rounds, with dropouts and uneven local work, so a round's clients
differ in cost and the balanced assignment puts many away from their owner."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from fedddp.client.state import fetch, open_store, send_home
from fedddp.sampling import travelling

from fedrun import assert_same_state, client_rows, final_state, is_selected, metrics, run_fedddp_each, run_here
from fedrun import selected

CPU = torch.device("cpu")
BASE = ["data.num_clients=12", "run.clients_per_round=8", "model.name=mlp", "model.hidden=16",
        "train.batch_size=50", "train.lr=0.05", "train.local_epochs=2", "train.local_work_min=1",
        "run.dropout=0.2", "run.rounds=3", "run.eval_every=3", "run.ckpt_every=0"]
STATEFUL = [("scaffold", []), ("moon", ["algorithm.moon_proj_dim=8"]), ("fedsmoo", []),
            ("fedgam_cv", ["algorithm.gam_rho=0.1"])]


# -- the order of the transfers and the stores' round trip ---------------------------------------

def test_travelling_lists_clients_away_from_their_owner_in_id_order():
    """Every rank must walk the same transfers in the same order (client id), or a blocking send
    could wait on a rank that is itself waiting on another transfer."""
    per_rank = [[1, 4, 6], [0, 3], [2, 5]]  # owners (id % 3): 1, 4 -> 1; 6, 0, 3 -> 0; 2, 5 -> 2
    assert travelling([6, 5, 4, 3, 2, 1, 0], per_rank, 3) == [(0, 0, 1), (1, 1, 0), (3, 0, 1), (4, 1, 0)]
    assert travelling([4, 6], per_rank, 3) == [(4, 1, 0)]  # stragglers, left out by the caller, stay
    assert travelling([0, 1, 2], [[0, 1, 2]], 1) == []


class QueueComm:
    """Point-to-point between threads standing for ranks: one queue per (source, destination)."""

    def __init__(self, rank: int, boxes: dict):
        self.rank, self.boxes = rank, boxes

    def send_tensors(self, tensors, dst):
        self.boxes[self.rank, dst].put({k: v.clone() for k, v in tensors.items()})

    def recv_tensors(self, src):
        return self.boxes[src, self.rank].get(timeout=60)


@pytest.mark.parametrize("kind", ["memory", "mmap"])
def test_state_goes_to_the_trainer_and_comes_back(tmp_path, kind):
    """The trainer sees the owner's state (nothing for a client that never trained), holds it for
    the round only, and the owner's store ends with exactly what the rule left: new values, new
    names, and no name the rule dropped (a store that kept a stale name would resume it)."""
    boxes = {(s, d): queue.Queue() for s in range(2) for d in range(2)}
    stores = [open_store(kind, [0, 2], str(tmp_path / "r0"), CPU), open_store(kind, [1, 3], str(tmp_path / "r1"), CPU)]
    stores[1].client(1).update(c=torch.arange(4.0), n=torch.tensor([7]))
    stores[0].client(2)["c"] = torch.full((4,), 2.0)
    moves = [(1, 1, 0), (2, 0, 1), (3, 1, 0)]  # 1 and 3 (no state yet) train on rank 0, 2 on rank 1
    seen, left = {}, {}

    def rank(r):
        comm = QueueComm(r, boxes)
        visiting = fetch(comm, stores[r], moves)
        seen[r] = {cid: {k: v.clone() for k, v in s.items()} for cid, s in visiting.items()}
        for state in visiting.values():  # what a rule's end hook does: new tensors, a name dropped
            state["c"] = state.get("c", torch.zeros(4)) + 1
            state.pop("n", None)
        send_home(comm, stores[r], moves, visiting)
        left[r] = visiting

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen[0]) == [1, 3] and sorted(seen[1]) == [2]
    assert torch.equal(seen[0][1]["c"], torch.arange(4.0)) and int(seen[0][1]["n"]) == 7 and seen[0][3] == {}
    assert left == {0: {}, 1: {}}
    assert torch.equal(stores[1].client(1)["c"], torch.arange(4.0) + 1) and sorted(stores[1].client(1)) == ["c"]
    assert torch.equal(stores[1].client(3)["c"], torch.ones(4))
    assert torch.equal(stores[0].client(2)["c"], torch.full((4,), 3.0))


# -- one rank in this process, two under real torchrun ------------------------------------

# Each rule once, each B for two of them: the travel is the round loop's and the same for every
# rule (what differs is the state's names and sizes), so the full 4 x 2 grid would double the
# multi-process runs, the suite's slowest part, for no path it does not already take.
CASES = [(*STATEFUL[0], 1), (*STATEFUL[3], 1), (*STATEFUL[1], 3), (*STATEFUL[2], 3)]
STRAGGLERS = BASE + ["algorithm.name=scaffold", "run.clients_per_round=12", "train.local_epochs=3",
                     "run.deadline_steps=10", "run.ckpt_every=1"]


def stateful_args(name, extra, parallel) -> tuple[list[str], tuple[str, str]]:
    """A case's overrides, and its stores on 1 and 2 ranks: memory on one side, mmap on the other."""
    stores = ("memory", "mmap") if parallel == 1 else ("mmap", "memory")
    return BASE + [f"algorithm.name={name}", f"run.parallel_clients={parallel}", *extra], stores


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory) -> dict:
    """{case: out_dir} of the selected tests' runs on 2 ranks, all under one torchrun: each
    stateful case, FedAvg (no client state) at each B they use, and the stragglers' SCAFFOLD."""
    root, runs = tmp_path_factory.mktemp("two_ranks"), {}
    cases = selected(request, "test_stateful_rules_are_balanced_and_world_size_invariant", "name")
    for name, extra, parallel in CASES:
        if name in cases:
            args, stores = stateful_args(name, extra, parallel)
            runs[name] = args + [f"run.client_state={stores[1]}"]
            runs[f"fedavg_B{parallel}"] = BASE + ["algorithm.name=fedavg", f"run.parallel_clients={parallel}"]
    if is_selected(request, "test_stragglers_and_dropouts_keep_their_state"):
        runs["stragglers"] = STRAGGLERS
    outs = {key: root / key for key in runs}
    if runs:
        run_fedddp_each([args + [f"run.out_dir={outs[key]}"] for key, args in runs.items()], nproc=2)
    return outs


def stateless_ranks(two_ranks, parallel: int) -> dict:
    """{(round, client): rank} of FedAvg (no client state) on 2 ranks with BASE: the balanced
    assignment a stateful rule must now match (it depends only on sampling, dropouts and costs)."""
    return {(r["round"], r["client"]): r["rank"] for r in client_rows(two_ranks[f"fedavg_B{parallel}"])}


@pytest.mark.slow
@pytest.mark.parametrize("name,extra,parallel", CASES, ids=[f"{n}-B{b}" for n, _, b in CASES])
@pytest.mark.processes
@pytest.mark.e2e
def test_stateful_rules_are_balanced_and_world_size_invariant(tmp_path, two_ranks, name, extra, parallel):
    """1 rank and 2 ranks give the same final.pt bit for bit, sequentially and side by side
    (B = 3), with the memory store on one side and the mmap store on the other. Guards against
    stateful rules trained on their owner rank (clients.jsonl's ranks would differ from FedAvg's),
    groups cut per rank at B > 1 (their bits depend on the world size) and a travelling state
    lost or not written back (rounds 2 and 3 would start from another state)."""
    args, stores = stateful_args(name, extra, parallel)
    run_here(args + [f"run.client_state={stores[0]}", f"run.out_dir={tmp_path / '1'}"])
    assert_same_state(final_state(tmp_path / "1"), final_state(two_ranks[name]))
    rank_of = {(r["round"], r["client"]): r["rank"] for r in client_rows(two_ranks[name])}
    assert rank_of == stateless_ranks(two_ranks, parallel)
    assert any(rank != client % 2 for (_, client), rank in rank_of.items())  # some states did travel


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_resume_on_any_world_size_equals_an_uninterrupted_run(tmp_path):
    """FedSMOO (two state tensors a client) stopped after round 2 and resumed: on 2 ranks then
    1, on 1 then 2, on 2 and 2, each the uninterrupted run's final.pt bit for bit (the shards stay
    keyed by owner, whichever rank trained the client)."""
    args = BASE + ["algorithm.name=fedsmoo", "run.rounds=4", "run.ckpt_every=2"]
    run_here(args + [f"run.out_dir={tmp_path / 'full'}"])
    cases = ((2, 1, "mmap"), (1, 2, "memory"), (2, 2, "mmap"))
    parts = {(stop_n, resume_n): tmp_path / f"{stop_n}to{resume_n}" for stop_n, resume_n, _ in cases}

    def on(world: int, runs: list[list[str]]) -> None:  # the 2-rank ones under one torchrun
        if world == 1:
            for run in runs:
                run_here(run)
        elif runs:
            run_fedddp_each(runs, nproc=world)

    for world in (1, 2):  # every stop, then its shard checked before any resume
        on(world, [args + [f"run.out_dir={parts[s, r]}", "run.stop_after=2", f"run.client_state={store}"]
                   for s, r, store in cases if s == world])
    for (stop_n, _), part in parts.items():
        shard = torch.load(part / "checkpoints" / "round_000002" / "clients_rank0.pt", weights_only=True)
        assert shard and all(cid % stop_n == 0 for cid in shard)
    for world in (1, 2):
        on(world, [args + [f"run.out_dir={parts[s, r]}", "run.resume=true"] for s, r, _ in cases if r == world])
    for part in parts.values():
        assert_same_state(final_state(tmp_path / "full"), final_state(part))


def client_states(out_dir, round_idx: int, world_size: int) -> dict[int, dict[str, torch.Tensor]]:
    folder = out_dir / "checkpoints" / f"round_{round_idx:06d}"
    states = {}
    for r in range(world_size):
        states |= torch.load(folder / f"clients_rank{r}.pt", weights_only=True)
    return states


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.e2e
def test_stragglers_and_dropouts_keep_their_state(tmp_path, two_ranks):
    """SCAFFOLD with dropouts and a deadline (client 0, 2,199 samples, always misses it; others
    when they draw more epochs): a client that does not report in round 3 ends it with its
    round-2 state exactly (none if it never trained), on 2 ranks as on 1, and every client's
    state after round 3 is the same bits on 1 and 2 ranks. Guards against a straggler's state
    sent away and overwritten, or a travelling state written to the wrong client."""
    run_here(STRAGGLERS + [f"run.out_dir={tmp_path / '1'}"])
    two = two_ranks["stragglers"]
    before, after = client_states(two, 2, 2), client_states(two, 3, 2)
    one_rank = client_states(tmp_path / "1", 3, 1)
    assert sorted(after) == sorted(one_rank)
    for cid in after:
        assert_same_state(after[cid], one_rank[cid])
    absent = metrics(two)[2]["dropped"]
    assert 0 in absent and 0 not in after  # never trained: no state
    kept = [c for c in absent if c in before]
    assert kept, "no client with state sat out round 3: the test would check nothing"
    for cid in kept:
        assert_same_state(before[cid], after[cid])
    moved = [c for c in after if c not in absent and c in before]
    assert any(not torch.equal(before[c]["control_P"], after[c]["control_P"]) for c in moved)
