"""The simulated clock and async mode (run.mode = async, FedBuff): the schedule as pure functions
against a plain event loop and small examples worked by hand, the speed profiles, the FedBuff
update, the configuration errors, and end to end: 1 against 2 ranks bitwise, a stopped and
resumed run against an uninterrupted one, sync rows with the simulated clock."""

from __future__ import annotations

import json
import math
import os
import shutil
import zlib

import pytest
import torch

from fedddp import asynchrony, checks
from fedddp.__main__ import check, main
from fedddp.asynchrony import Clock, Flight, Schedule
from fedddp.errors import ConfigError
from fedddp.strategies import fedavg
from fedddp.strategies.base import client_weights_K
from fedrun import QUICKSTART, assert_same_state, client_rows, final_state, metrics, run_fedddp_each, run_here


def schedule(n, c, b, speeds, steps=lambda cid, start: 1, seed=0) -> Schedule:
    return Schedule(n, c, b, seed, tuple(speeds), steps)


def updates(sched: Schedule, count: int, clock: Clock = Clock()) -> list[tuple[list[Flight], Clock]]:
    out = []
    for _ in range(count):
        arrived, clock = asynchrony.next_update(clock, sched)
        out.append((arrived, clock))
    return out


# -- the schedule, by hand ----------------------------------------------------------------------

def test_all_clients_training_by_hand():
    """N = C = 3, B = 2, one step each at 1, 2 and 3 s/step: every idle client starts at once, so
    who arrives when follows from the speeds alone (worked on paper in the comments)."""
    (u1, c1), (u2, c2), (u3, c3) = updates(schedule(3, 3, 2, [1.0, 2.0, 3.0]), 3)
    # t = 0: all three start from version 0; clients 0 and 1 arrive at 1 and 2: update 1 at t = 2
    assert [(f.client, f.version, f.start_s, f.finish_s) for f in u1] == [(0, 0, 0.0, 1.0), (1, 0, 0.0, 2.0)]
    assert (c1.now_s, c1.version, c1.starts) == (2.0, 1, 3)
    assert [(f.client, f.version, f.finish_s) for f in c1.flights] == [(2, 0, 3.0)]
    # t = 2: clients 0 and 1 start again from version 1 (0 ends at 3, 1 at 4); at t = 3 client 2
    # (started earlier: start number 3) arrives before client 0 (4 or 5): update 2 at t = 3
    assert [(f.client, f.version, f.start_s, f.finish_s) for f in u2] == [(2, 0, 0.0, 3.0), (0, 1, 2.0, 3.0)]
    assert (c2.now_s, c2.version, c2.starts) == (3.0, 2, 5)
    # t = 3: clients 0 and 2 start from version 2 (0 ends at 4, 2 at 6); at t = 4 client 1
    # (started at t = 2) comes before client 0 (started at t = 3): update 3 at t = 4
    assert [(f.client, f.version, f.start_s, f.finish_s) for f in u3] == [(1, 1, 2.0, 4.0), (0, 2, 3.0, 4.0)]
    assert (c3.now_s, c3.version) == (4.0, 3)
    assert [(f.client, f.version, f.finish_s) for f in c3.flights] == [(2, 2, 6.0)]
    # staleness = the update's version before it - the version a client started from
    assert [c2.version - f.version for f in u3] == [1, 0]


def test_one_at_a_time_follows_the_draws():
    """C = B = 1: each update starts one client, drawn uniformly from all N (the one that just
    arrived is idle again after the update) by start number n, and waits for it."""
    speeds, steps = [0.5, 1.0, 2.0, 4.0], lambda cid, start: start  # start n takes n steps
    sched = schedule(4, 1, 1, speeds, steps, seed=7)
    now = 0.0
    for n, (arrived, clock) in enumerate(updates(sched, 8), 1):
        cid = asynchrony.pick(7, n, 4)  # all four are idle: the k-th idle client is client k
        now += n * speeds[cid]
        assert [(f.client, f.start, f.version) for f in arrived] == [(cid, n, n - 1)]
        assert clock.now_s == now and clock.flights == () and clock.starts == n


def test_a_client_reports_once_per_update():
    """N = 2, C = 1, B = 2: after client a arrives the other is the only idle one, however fast
    a is; the update holds both."""
    for seed in range(5):
        for arrived, _ in updates(schedule(2, 1, 2, [0.01, 100.0], seed=seed), 4):
            assert sorted(f.client for f in arrived) == [0, 1]


def test_kth_idle():
    assert [asynchrony._kth_idle(k, [1, 2, 5]) for k in range(5)] == [0, 3, 4, 6, 7]
    assert asynchrony._kth_idle(0, []) == 0


# -- the schedule against its slow twin ---------------------------------------------------------

def twin(n, c, b, seed, speeds, steps, count):
    """A plain event loop written from the rules in words: one list of training clients, idle
    clients recomputed from scratch, starts numbered in order, arrivals by (time, start)."""
    now, version, starts = 0.0, 0, 0
    training = []  # [finish, start number, client, version, start time]
    out = []
    for _ in range(count):
        buffer = []

        def fill(at):
            nonlocal starts
            while len(training) < c:
                busy = [t[2] for t in training] + [a[2] for a in buffer]
                idle = [x for x in range(n) if x not in busy]
                if not idle:
                    return
                starts += 1
                cid = idle[asynchrony.pick(seed, starts, len(idle))]
                training.append([at + steps(cid, starts) * speeds[cid], starts, cid, version, at])

        fill(now)
        while len(buffer) < b:
            training.sort()
            first = training.pop(0)
            buffer.append(first)
            now = first[0]
            if len(buffer) < b:
                fill(now)
        version += 1
        out.append(([(a[2], a[1], a[3], a[4], a[0]) for a in buffer], now, sorted(t[1] for t in training)))
    return out


@pytest.mark.parametrize("n,c,b,seed", [(5, 2, 1, 0), (6, 3, 2, 1), (10, 4, 6, 2), (8, 8, 3, 3), (12, 5, 12, 4),
                                        (3, 1, 3, 5)])
def test_schedule_matches_the_plain_event_loop(n, c, b, seed):
    gen = torch.Generator().manual_seed(seed)
    speeds = torch.exp(torch.randn(n, generator=gen, dtype=torch.float64)).tolist()
    work = torch.randint(1, 6, (n, 400), generator=gen).tolist()
    steps = lambda cid, start: work[cid][start % 400]  # noqa: E731
    got = updates(schedule(n, c, b, speeds, steps, seed), 40)
    want = twin(n, c, b, seed, speeds, steps, 40)
    for (arrived, clock), (w_arrived, w_now, w_flying) in zip(got, want):
        assert [(f.client, f.start, f.version, f.start_s, f.finish_s) for f in arrived] == w_arrived
        assert clock.now_s == w_now and sorted(f.start for f in clock.flights) == w_flying
        assert len({f.client for f in arrived}) == b  # distinct clients in an update


def test_schedule_resumes_from_its_saved_form(tmp_path):
    """A clock written as a checkpoint writes it (torch.save, weights_only load) continues alike."""
    sched = schedule(7, 4, 2, [0.3, 1.7, 0.9, 2.2, 1.1, 0.6, 3.0], lambda cid, start: 1 + (cid + start) % 3, 11)
    straight = updates(sched, 12)
    versions = {f.version: torch.full((3,), float(f.version)) for f in straight[5][1].flights}
    torch.save(asynchrony.saved(straight[5][1], versions), tmp_path / "s.pt")
    clock, back = asynchrony.restored(torch.load(tmp_path / "s.pt", weights_only=True), "cpu")
    assert clock == straight[5][1]
    assert back.keys() == versions.keys() and all(torch.equal(back[v], versions[v]) for v in versions)
    assert updates(sched, 6, clock) == straight[6:]


# -- speeds and the FedBuff step ----------------------------------------------------------------

def test_speeds_drawn_per_client_and_seed(tmp_path):
    ten = asynchrony.client_speeds("lognormal:1.5", 10, 3)
    assert asynchrony.client_speeds("lognormal:1.5", 4, 3) == ten[:4]  # a client's speed does not depend on N
    assert asynchrony.client_speeds("lognormal:1.5", 10, 4) != ten
    assert asynchrony.client_speeds("lognormal:1.5:2", 10, 3) == [2 * s for s in ten]
    assert asynchrony.client_speeds("lognormal:0", 3, 0) == [1.0, 1.0, 1.0]
    assert asynchrony.client_speeds("constant", 3, 0) == [1.0] * 3
    assert asynchrony.client_speeds("constant:0.25", 2, 0) == [0.25] * 2
    uniform = asynchrony.client_speeds("uniform:2:3", 50, 0)
    assert all(2 <= s <= 3 for s in uniform) and len(set(uniform)) == 50
    (tmp_path / "s.csv").write_text("client_id,seconds_per_step\n0,0.5\n1, 2\n2,1e-1\n3,9\n")
    (tmp_path / "s.json").write_text(json.dumps({"0": 0.5, "1": 2, "2": 0.1, "3": 9}))
    for name in ("s.csv", "s.json"):
        assert asynchrony.client_speeds(f"file:{tmp_path / name}", 3, 0) == [0.5, 2.0, 0.1]
        assert asynchrony.client_speeds(str(tmp_path / name), 4, 0) == [0.5, 2.0, 0.1, 9.0]
    with pytest.raises(ValueError, match="no speed for client"):
        asynchrony.client_speeds(f"file:{tmp_path / 's.csv'}", 6, 0)


@pytest.mark.parametrize("spec,why", [("gamma:2", "is not constant"), ("uniform:3:2", "0 < A <= B"),
                                      ("lognormal:-1", "SIGMA >= 0"), ("constant:0", "S > 0"),
                                      ("uniform:1:x", "must be numbers"), ("file:", "needs a path")])
def test_bad_speed_specs(spec, why):
    with pytest.raises(ValueError, match=why):
        asynchrony.parse_speed(spec)


def test_staleness_weights():
    assert asynchrony.staleness_weight(3, "polynomial", 0.5) == 0.5
    assert asynchrony.staleness_weight(0, "polynomial", 2.0) == 1.0
    assert asynchrony.staleness_weight(7, "constant", 0.5) == 1.0


@pytest.mark.parametrize("weighting,server_lr", [("samples", 1.0), ("uniform", 0.7)])
def test_fedavg_over_buffered_rows_is_fedbuff(weighting, server_lr):
    """FedAvg's server step over the rewritten rows is w + eta sum_k p_k s(tau_k) (w_k - w_{v_k}),
    a loop written from FedBuff's update (uniform p_k = 1/K: the paper's own)."""
    gen = torch.Generator().manual_seed(0)
    P, tau = 37, [0, 2, 1, 5]
    w = torch.randn(P, generator=gen)
    bases = [torch.randn(P, generator=gen) for _ in tau]
    trained = torch.stack([b + 0.1 * torch.randn(P, generator=gen) for b in bases])
    n_K = torch.tensor([10.0, 30.0, 5.0, 55.0])
    s = [asynchrony.staleness_weight(t, "polynomial", 0.5) for t in tau]
    hp = type("HP", (), {"weighting": weighting, "server_lr": server_lr, "name": "fedavg"})()
    p = client_weights_K({"num_samples_K": n_K, "params_KP": trained}, hp)
    want = w.double().clone()
    for k in range(len(tau)):
        want += server_lr * p[k].double() * s[k] * (trained[k].double() - bases[k].double())
    rows = trained.clone()
    asynchrony.buffered_rows_(rows, bases, w, s)
    got, _, _ = fedavg.aggregate(w, {"params_KP": rows, "num_samples_K": n_K}, {}, hp)
    assert torch.allclose(got.double(), want, atol=1e-6)


# -- configuration ------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,says", [
    (["run.mode=async", "algorithm.name=fedmom"], "run.mode: async runs FedBuff's rule on FedAvg's server step; "
     "algorithm.name = fedmom has the fedmom server rule; async runs fedavg, fedgam, fedprox, fedsam, moon"),
    (["run.mode=async", "run.parallel_clients=2"], "run.parallel_clients: async mode trains each client"),
    (["run.mode=async", "run.dropout=0.1"], "not by run.dropout or run.deadline_steps"),
    (["run.mode=async", "run.sampling=poisson"], "run.sampling: async mode starts a client whenever a slot frees"),
    (["run.mode=async", "run.async_buffer=31"], "run.async_buffer: must be in [1, data.num_clients = 30]"),
    (["run.mode=async", "run.async_concurrency=-1"], "run.async_concurrency: must be in [0, data.num_clients = 30]"),
    (["run.async_staleness=linear"], "run.async_staleness: 'linear' is not one of polynomial, constant"),
    (["run.mode=asynch"], "did you mean async?"),
    (["data.client_speed=lognormal"], "data.client_speed: 'lognormal' is not constant[:S]"),
    (["data.client_speed=file:/nonexistent/speeds.csv"], "data.client_speed: cannot read /nonexistent/speeds.csv"),
])
def test_config_errors_are_one_line(overrides, says):
    with pytest.raises(ConfigError) as info:
        checks.load(os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.toml"), overrides)
    assert says in str(info.value) and "\n" not in str(info.value)


# Speed files with an entry that is no usable seconds per step (huge.json: an integer past a float).
SPEED_FILES = {"inf.csv": "0,1\n1,inf\n", "nan.csv": "0,1\n1,nan\n", "zero.csv": "0,0\n1,1\n",
               "negative.csv": "0,-1\n1,1\n", "e400.csv": "0,1\n1,1e400\n",
               "huge.json": '{"0": 1%s, "1": 1}' % ("0" * 400)}

UNUSABLE_SPEEDS = [
    # the draws leave a float's range: exp(800 z) raised OverflowError (a traceback, exit 1), the
    # others gave a speed of inf or 0, and --check said OK to all three
    ("lognormal:800", "'lognormal:800' draws client 0 MEDIAN x exp(SIGMA z) = 1 x exp(800 x 1.23) seconds per "
                      "step, past a float's range; lower SIGMA (or bring MEDIAN nearer 1)"),
    ("lognormal:1:1e308", "past a float's range"),
    ("lognormal:5:1e-320", "draws client 9 MEDIAN x exp(SIGMA z) = 9.99989e-321 x exp(5 x -2.14) seconds per step, "
                           "below a float's range"),
    ("constant:inf", "its numbers must be finite"), ("constant:nan", "its numbers must be finite"),
    ("constant:0", "needs S > 0"), ("constant:-1", "needs S > 0"), ("constant:1e-400", "needs S > 0"),
    ("uniform:0:1e400", "its numbers must be finite"), ("uniform:0:1", "needs 0 < A <= B"),
    ("lognormal:inf", "its numbers must be finite"), ("lognormal:1:0", "MEDIAN > 0"),
    ("file:inf.csv", "inf.csv: client 1 has inf seconds per step; each must be finite and > 0"),
    ("file:nan.csv", "nan.csv: client 1 has nan seconds per step; each must be finite and > 0"),
    ("file:e400.csv", "e400.csv: client 1 has inf seconds per step; each must be finite and > 0"),
    ("file:zero.csv", "zero.csv: client 0 has 0.0 seconds per step; each must be finite and > 0"),
    ("file:negative.csv", "negative.csv: client 0 has -1.0 seconds per step; each must be finite and > 0"),
    ("file:huge.json", "huge.json: client 0 has inf seconds per step; each must be finite and > 0"),
]


@pytest.mark.parametrize("spec,says", UNUSABLE_SPEEDS, ids=[spec for spec, _ in UNUSABLE_SPEEDS])
def test_unusable_speeds_are_one_line_exit_2_and_check_says_so(tmp_path, monkeypatch, capsys, spec, says):
    """Any unusable data.client_speed: one line naming it, exit 2 (ConfigError), nothing written
    in run.out_dir, and --check refuses it with the same line."""
    for name, text in SPEED_FILES.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    args = ["run.mode=async", f"data.client_speed={spec}", f"run.out_dir={out}"]
    assert run_here(args, check=False) == ConfigError.exit_code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("fedddp: error: ") and "data.client_speed: " in err[0], err
    assert says in err[0], err
    assert not out.exists()
    with pytest.raises(ConfigError) as info:
        check(QUICKSTART, args)
    assert f"fedddp: error: {info.value}" == err[0]
    assert main(["--check", QUICKSTART, *args]) == 2 and capsys.readouterr().err.splitlines() == err


# -- end to end -------------------------------------------------------------------------------

ASYNC = ["run.mode=async", "run.rounds=6", "run.eval_every=3", "run.async_concurrency=6", "run.async_buffer=3",
         "data.client_speed=lognormal:1.0", "train.local_work_min=1", "train.local_epochs=2"]


def _rows_without_timings(out) -> list[dict]:
    timed = ("time_s", "train_s", "train_imbalance_s", "communicate_s", "aggregate_s", "evaluate_s", "checkpoint_s")
    return [{k: v for k, v in row.items() if k not in timed} for row in metrics(out)]


def _clients_without_timings(out) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in ("train_time_s", "rank")} for row in client_rows(out)]


@pytest.mark.e2e
def test_async_rows_and_resume_exact(tmp_path):
    """A run stopped after update 3 and resumed equals the uninterrupted run bit for bit, rows
    included: the clock, its training clients and the model versions they started from are in
    the checkpoint. The rows carry the simulated clock and staleness."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_here(ASYNC + [f"run.out_dir={whole}"])
    run_here(ASYNC + [f"run.out_dir={parts}", "run.stop_after=3"])
    saved = torch.load(parts / "checkpoints" / "round_000003" / "server.pt", weights_only=True)
    assert saved["async"]["flights"] and len(saved["async"]["version_ids"]) <= 6
    run_here(ASYNC + [f"run.out_dir={parts}", "run.resume=true"])
    assert_same_state(final_state(whole), final_state(parts))
    assert _rows_without_timings(whole) == _rows_without_timings(parts)
    assert _clients_without_timings(whole) == _clients_without_timings(parts)
    rows, clients = metrics(whole), client_rows(whole)
    assert [r["num_reports"] for r in rows] == [3] * 6
    times = [r["sim_time_s"] for r in rows]
    assert times == sorted(times) and all(r["sim_round_s"] >= 0 for r in rows)
    assert max(r["staleness_max"] for r in rows) > 0  # the lognormal tail makes some clients stale
    for row in clients:
        assert row["staleness"] == row["round"] - 1 - row["start_version"] >= 0
        assert row["start_s"] < row["arrive_s"] <= rows[row["round"] - 1]["sim_time_s"]


@pytest.mark.e2e
def test_sync_rows_carry_the_simulated_clock(tmp_path):
    """Sync mode: sim_round_s is the slowest reporting client's steps x seconds per step, and
    sim_time_s their running sum, also across a resume; a checkpoint written before the clock was
    kept replays the rounds' plans to the same time."""
    args = ["run.rounds=4", "run.eval_every=4", "data.client_speed=uniform:0.5:2", "run.ckpt_every=2"]
    run_here(args + [f"run.out_dir={tmp_path / 'a'}"])
    speeds = asynchrony.client_speeds("uniform:0.5:2", 30, 0)
    rows, clients = metrics(tmp_path / "a"), client_rows(tmp_path / "a")
    total = 0.0
    for row in rows:
        mine = [c for c in clients if c["round"] == row["round"]]
        assert row["sim_round_s"] == max(c["num_steps"] * speeds[c["client"]] for c in mine)
        total += row["sim_round_s"]
        assert row["sim_time_s"] == total
    # the round-2 checkpoint as an older fedddp wrote it: no sim_time_s in server.pt
    folder = tmp_path / "a" / "checkpoints" / "round_000002"
    server = torch.load(folder / "server.pt", weights_only=True)
    del server["sim_time_s"]
    torch.save(server, folder / "server.pt")
    manifest = json.loads((folder / "manifest.json").read_text())
    data = (folder / "server.pt").read_bytes()
    manifest["files"]["server.pt"] = {"size": len(data), "crc32": zlib.crc32(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(tmp_path / "a" / "checkpoints" / "round_000004")
    run_here(args + [f"run.out_dir={tmp_path / 'a'}", "run.resume=true"])
    assert [r["sim_time_s"] for r in metrics(tmp_path / "a")] == [r["sim_time_s"] for r in rows]


@pytest.mark.processes
@pytest.mark.e2e
@pytest.mark.slow
def test_async_same_bits_on_one_and_two_ranks(tmp_path):
    """The schedule is computed alike on every rank and each client trains from the same version
    with the same seed whichever rank trains it: 2 ranks give 1 rank's final.pt and rows. FedAvg
    with uneven work, FedProx (its local rule reads the model a client started from) and MOON (its
    per-client state, the previous model, travels to the rank that trains the client)."""
    runs = {"fedavg": ASYNC, "fedprox": ASYNC + ["algorithm.name=fedprox", "data.client_speed=uniform:0.2:3"],
            "moon": ASYNC + ["algorithm.name=moon", "run.rounds=4"]}
    for name, args in runs.items():
        run_here(args + [f"run.out_dir={tmp_path / name / 'one'}"])
    run_fedddp_each([args + [f"run.out_dir={tmp_path / name / 'two'}"] for name, args in runs.items()], nproc=2)
    for name in runs:
        one, two = tmp_path / name / "one", tmp_path / name / "two"
        assert_same_state(final_state(one), final_state(two))
        # test loss is all-reduced in float64 from per-rank sums: its last digits may differ (docs)
        strip = lambda rows: [{k: v for k, v in r.items() if k != "test_loss"} for r in rows]  # noqa: E731
        assert strip(_rows_without_timings(one)) == strip(_rows_without_timings(two))
        assert _clients_without_timings(one) == _clients_without_timings(two)
        assert {c["rank"] for c in client_rows(two)} == {0, 1}
        assert all(math.isclose(a["test_loss"], b["test_loss"], rel_tol=1e-5) for a, b in
                   zip(metrics(one), metrics(two)) if a["test_loss"] is not None)


@pytest.mark.parametrize("overrides,words", [
    ([], "10 of 30 clients a round"),
    (["algorithm.name=dpfedavg", "algorithm.params.dp_clip=1"],
     "each of 30 clients a round with probability 0.333333 (Poisson sampling)"),
    (["run.mode=async", "run.async_buffer=4"], "async (FedBuff): 10 of 30 clients training at once on the simulated "
     "clock, a server update every 4 arrivals, staleness weight (1 + tau)^-0.5"),
])
def test_the_start_line_says_who_trains_when(overrides, words):
    from fedddp import plan
    cfg = checks.load(os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.toml"), overrides)
    assert plan.describe(cfg.run, cfg.cohort()) == words
