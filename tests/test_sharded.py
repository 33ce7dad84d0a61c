"""The sharded server (run.aggregation = sharded): the same bits as the gathered rule, on any
number of ranks.

In process: every built-in rule's range form (``aggregate_span``) on W = 1..4 simulated ranks
(one thread each, their block rows and ranges exchanged through a barrier) against its gathered
form, in the fused and the torch-op forms; the blocks; the checkpoint's server shards. In
processes: real torchruns of every rule (dropouts, side by side, per-client state, a plugin that
runs gathered; the DP rules with Poisson and fixed sampling, adaptive clipping, the noise cohort
and a round without reports) on 1-4 ranks against the gathered run, and resumes across world
sizes and modes. Only the torchruns of the selected tests run (``-k dpfed``: the DP rules').
Legend: K clients, P flat elements, W ranks.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from fedddp import blocks, checkpoint, strategies
from fedddp.config import AlgorithmConfig
from fedddp.flat import runs_R3, runs_within
from fedddp.report import ALIGN, RangeRow
from fedddp.sharded import cut_static
from fedddp.strategies import Span, kernels
from fedrun import QUICKSTART, REPO, assert_same_state, final_state, metrics, run_fedddp, run_fedddp_each, run_here
from test_strategies import hp_of

PLUGIN = os.path.join(REPO, "examples", "my_plugin.toml")

K, P, WIDTH, LAYERS = 7, 1000, 64, 3
RULES = ["fedavg", "fedmom", "fedcong", "fedgma", "cgw", "feder", "scaffold", "fedgam_cv", "fednova", "fedsmoo",
         "dpfedavg", "dpfedmom", "fedadam", "fedyogi", "fedadagrad", "fedmedian", "fedtrimmedavg", "krum", "bulyan"]
# a rule's own settings on top of _inputs' (DP-FedMom: adaptive clipping from a clip that some of
# the updates exceed, and the noise cohort)
RULE_PARAMS = {"dpfedmom": {"dp_clip": 3.16, "dp_adaptive_quantile": 0.5, "dp_adaptive_count_noise": 2.0,
                            "dp_noise_cohort": 20},
               "krum": {"krum_m": 3}}
# diagnostics whose bits the range form keeps from the gathered one (the others are per-block sums)
SAME_DIAGNOSTICS = {"cgw_x_K", "cgw_weight_K", "cgw_grad_norm_K", "cgw_c", "cgw_zero_grad_clients", "tau_eff",
                    "control_norm", "dual_norm", "clipped_fraction", "feder_alpha_KL", "cong_positive",
                    "cong_negative", "mask_density", "unclipped_fraction_noised", "krum_score_K", "krum_selected_K",
                    "bulyan_selected_K", "bulyan_f"}


# -- blocks -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("numel,width", [(610, 64), (64, 64), (1000, 64), (5, 64), (4340, 128)])
def test_ranges_are_whole_blocks_in_rank_order(numel, width):
    for world in range(1, 9):
        ranges = blocks.column_ranges(numel, width, world)
        assert ranges[0][0] == 0 and ranges[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        for c0, c1 in ranges:
            assert c0 % width == 0 and (c1 % width == 0 or c1 == numel)
            sizes = [s.stop - s.start for s in blocks.block_slices(c0, c1, width)]
            assert sum(sizes) == c1 - c0 and all(s == width for s in sizes[:-1])


def test_runs_within_cut_and_counted_from_the_start():
    runs = runs_R3(torch.tensor([-1, -1, 0, 0, 0, 1, 1, 2, 2, 2]))
    assert runs_within(runs, 3, 8).tolist() == [[0, 2, 0], [2, 4, 1], [4, 5, 2]]
    assert runs_within(runs, 5, 7).tolist() == [[0, 2, 1]]


def test_range_rows_align_and_carry_the_scalars():
    from fedddp.report import ReportLayout
    report = ReportLayout(frozenset({"params_KP", "last_grad_KP", "num_samples_K", "train_loss_K", "eff_rank_KL"}),
                          P, LAYERS)
    whole = RangeRow(report, 0, P)   # one rank: the report's own row, taken as it is
    assert whole.slices == report.slices and whole.width == report.width
    row_F = torch.arange(report.width, dtype=torch.float32)
    for c0, c1 in blocks.column_ranges(P, WIDTH, 3):
        row = RangeRow(report, c0, c1)
        assert row.width % ALIGN == 0 and all(sl.start % ALIGN == 0 for s, sl in row.slices.items() if s.endswith("_KP"))
        range_X = torch.full((row.width,), float("nan"))
        for full, piece in row.pieces:
            range_X[piece] = row_F[full]
        cut, whole = row.unpack(range_X[None]), report.unpack(row_F[None])
        for stack in whole:
            expect = whole[stack][:, c0:c1] if stack.endswith("_KP") else whole[stack]
            assert torch.equal(cut[stack], expect), stack


# -- every rule's range form on simulated ranks -----------------------------------------------------

def _inputs(seed: int, **params):
    g = torch.Generator().manual_seed(seed)
    global_P = torch.randn(P, generator=g)
    group_P = torch.cat([torch.full((30,), -1), torch.sort(torch.randint(0, LAYERS, (P - 30,), generator=g)).values])
    stacks = {"params_KP": global_P + 0.1 * torch.randn(K, P, generator=g),
              "num_samples_K": torch.randint(1, 100, (K,), generator=g).float(),
              "train_loss_K": torch.rand(K, generator=g), "full_loss_K": 0.5 + torch.rand(K, generator=g),
              "num_steps_K": torch.randint(1, 9, (K,), generator=g).float(),
              "eff_rank_KL": 3 * torch.rand(K, LAYERS, generator=g), "conv_runs_R3": runs_R3(group_P),
              "param_mask_P": torch.rand(P, generator=g) < 0.8, "num_clients": torch.tensor(30.0),
              "client_momentum": torch.tensor(0.5), "num_sampled": torch.tensor(float(K + 1)),
              "noise_seed": torch.tensor(3), "aggregation_block": torch.tensor(WIDTH)}
    for name in ("last_grad_KP", "full_grad_KP", "control_delta_KP", "perturb_dual_KP"):
        stacks[name] = torch.randn(K, P, generator=g)
    hp = hp_of(**{"server_momentum": 0.9, "cong_alpha": 0.6, "gma_threshold": 0.6, "cgw_alpha": 0.1, "dp_clip": 0.5,
                  "dp_noise": 0.5, "server_lr": 0.7, "sam_rho": 0.1, "eta": 1e-2, "beta1": 0.9, "beta2": 0.99,
                  "tau": 1e-3} | params)
    return global_P, stacks, hp


class _Threads:
    """W simulated ranks: all_gather(rank, tensor) -> every rank's tensor, in rank order. A rank
    computes only while it holds ``lock`` (released while it waits for the others): the ranks'
    torch and kernel calls never run at once, which once aborted the process (the ranks are
    threads of one process here, unlike a run's)."""

    def __init__(self, world: int):
        self.barrier, self.slots, self.lock = threading.Barrier(world), [None] * world, threading.Lock()

    def all_gather(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.lock.release()
        try:
            self.barrier.wait()
            self.slots[rank] = tensor
            self.barrier.wait()
            every = list(self.slots)
            self.barrier.wait()
        finally:
            self.lock.acquire()
        return every


def _on_ranks(strategy, global_P, stacks, state, hp, world: int, width: int = WIDTH):
    """The range form on ``world`` threads: (the whole new vector, state, every rank's diagnostics)."""
    ranges, threads, out = blocks.column_ranges(P, width, world), _Threads(world), [None] * world

    def rank(r: int) -> None:
        c0, c1 = ranges[r]
        span = Span(c0, c1, P, width, global_P.device,
                    lambda rows: torch.cat(threads.all_gather(r, rows)),
                    lambda part: torch.cat(threads.all_gather(r, part)))
        cut = {k: (v[:, c0:c1] if k.endswith("_KP") else v) for k, v in stacks.items()}
        cut |= cut_static({k: v for k, v in stacks.items() if k in ("param_mask_P", "conv_runs_R3")}, c0, c1)
        view = {k: v[c0:c1].clone() if v.shape == (P,) else v for k, v in state.items()}
        with threads.lock:
            out[r] = strategy.aggregate_span(global_P[c0:c1], cut, view, hp, span)

    workers = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    new_P, new_state = torch.cat([o[0] for o in out]), {}
    for k, first in out[0][1].items():
        # a [P] entry comes back as ranges, but a client-visible one may come back whole
        ranged = state.get(k, first).shape == (P,) and (first.shape != (P,) or k not in strategy.client_visible)
        new_state[k] = torch.cat([o[1][k] for o in out]) if ranged and world > 1 else first
    return new_P, new_state, [o[2] for o in out]


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), f"{what}: {k}"


@pytest.mark.parametrize("form", ["c", "torch"])
@pytest.mark.parametrize("rule", RULES)
def test_range_form_is_the_gathered_rule_on_any_number_of_ranks(rule, form):
    torch.set_num_threads(1)
    strategy = strategies.get(rule)
    global_P, stacks, hp = _inputs(seed=RULES.index(rule), **RULE_PARAMS.get(rule, {}))
    with kernels.forced(form):
        state = strategy.init_state(global_P, hp)
        if state:   # a state that is not round 1's: one gathered round first
            global_P, state, _ = strategy.aggregate(global_P, stacks, state, hp)
        want_P, want_state, want_diag = strategy.aggregate(global_P, stacks, state, hp)
        seen = None
        for world in (1, 2, 3, 4):
            new_P, new_state, diag_R = _on_ranks(strategy, global_P, stacks, state, hp, world)
            assert torch.equal(new_P, want_P), f"{rule} on {world} ranks"
            _assert_same(new_state, want_state, f"{rule} state on {world} ranks")
            for d in diag_R[1:]:   # every rank's diagnostics are the round's
                _assert_same(d, diag_R[0], f"{rule} diagnostics across ranks")
            _assert_same({k: v for k, v in diag_R[0].items() if k in SAME_DIAGNOSTICS},
                         {k: v for k, v in want_diag.items() if k in SAME_DIAGNOSTICS}, f"{rule} diagnostics")
            seen = seen or diag_R[0]
            _assert_same(diag_R[0], seen, f"{rule} diagnostics on {world} ranks")


@pytest.mark.parametrize("rule", ["dpfedavg", "dpfedmom"])
def test_a_private_round_without_reports_is_the_gathered_one_on_any_number_of_ranks(rule):
    """Poisson's empty cohort: the noise alone moves the model (and the clip), the same bits."""
    strategy = strategies.get(rule)
    global_P, stacks, hp = _inputs(seed=11, **RULE_PARAMS.get(rule, {}))
    stacks = {k: v[:0] if k.endswith(("_KP", "_K", "_KL")) else v for k, v in stacks.items()}
    state = strategy.init_state(global_P, hp)
    want_P, want_state, _ = strategy.aggregate(global_P, stacks, state, hp)
    assert not torch.equal(want_P, global_P)
    for world in (1, 2, 3, 4):
        new_P, new_state, _ = _on_ranks(strategy, global_P, stacks, state, hp, world)
        assert torch.equal(new_P, want_P), f"{rule} on {world} ranks"
        _assert_same(new_state, want_state, f"{rule} state on {world} ranks")


def test_a_rank_without_blocks_still_takes_part():
    """Fewer blocks than ranks: ranks 1 and 3 own none, and every sum still comes out whole."""
    strategy = strategies.get("cgw")
    global_P, stacks, hp = _inputs(seed=5)
    stacks["aggregation_block"] = torch.tensor(512)
    want_P, _, want_diag = strategy.aggregate(global_P, stacks, {}, hp)
    assert blocks.column_ranges(P, 512, 4) == [(0, 0), (0, 512), (512, 512), (512, P)]
    new_P, _, diag_R = _on_ranks(strategy, global_P, stacks, {}, hp, 4, width=512)
    assert torch.equal(new_P, want_P)
    assert torch.equal(diag_R[1]["cgw_x_K"], want_diag["cgw_x_K"])


def test_one_block_keeps_the_gathered_sums_of_before():
    """Without aggregation_block (one block) CGW and DP-FedAvg sum as they did before blocks."""
    global_P, stacks, hp = _inputs(seed=7)
    del stacks["aggregation_block"]
    from fedddp.strategies.cgw import norms_and_agreement_K
    from fedddp.strategies.dpfedavg import update_norms_K
    span = Span.whole(P, P, global_P.device)
    sq_K, m_K = norms_and_agreement_K(stacks["full_grad_KP"])
    total = span.total([torch.cat([sq_K, m_K])], 2 * K)
    assert torch.equal(total, torch.cat([sq_K, m_K]))
    before = torch.linalg.vector_norm(stacks["params_KP"] - global_P, dim=1, dtype=torch.float64)
    assert torch.equal(update_norms_K(stacks["params_KP"], global_P, span), before)


# -- checkpoint shards --------------------------------------------------------------------------

def test_server_shards_read_back_over_any_columns(tmp_path):
    whole = torch.randn(P)
    names = []
    for r, (c0, c1) in enumerate(blocks.column_ranges(P, WIDTH, 3)):
        torch.save({"start": c0, "stop": c1, "numel": P, "state": {"m_P": whole[c0:c1].clone()}},
                   tmp_path / f"server_rank{r}.pt")
        names.append(f"server_rank{r}.pt")

    def read(name):
        return torch.load(tmp_path / name, weights_only=True)

    assert torch.equal(checkpoint._columns_of(read, names, None)["m_P"], whole)
    for world in (1, 2, 4):
        for c0, c1 in blocks.column_ranges(P, WIDTH, world):
            assert torch.equal(checkpoint._columns_of(read, names, (c0, c1))["m_P"], whole[c0:c1])


# -- real runs ---------------------------------------------------------------------------------

BASE = ["run.rounds=2", "run.eval_every=2", "run.ckpt_every=0", "run.aggregation_block=64"]
CNN = ["data.name=examples.my_plugin:blobs", "data.num_clients=12", "data.partition=natural",
       "model.name=examples.my_plugin:SmallCNN", "run.clients_per_round=6", "train.batch_size=16", "train.lr=0.05"]
DPFEDMOM = ["algorithm.name=dpfedmom", "algorithm.dp_clip=1.0", "algorithm.dp_noise=0.5",
            "algorithm.params.dp_adaptive_quantile=0.5", "algorithm.params.dp_noise_cohort=20"]
# name -> overrides of configs/quickstart.toml (P = 610: 10 blocks of 64; the CNN: 4340, 68 blocks)
RUNS = {
    "fedavg": ["algorithm.name=fedavg", "algorithm.server_lr=0.5"],
    "fedmom": ["algorithm.name=fedmom"],
    "fedcong": ["algorithm.name=fedcong"],
    "fedgma": ["algorithm.name=fedgma", "algorithm.server_lr=0.5"],
    "cgw": ["algorithm.name=cgw"],
    "feder": CNN + ["algorithm.name=feder"],
    "scaffold-dropout": ["algorithm.name=scaffold", "run.dropout=0.3"],
    "fedgam_cv": ["algorithm.name=fedgam_cv"],
    "fednova": ["algorithm.name=fednova", "train.momentum=0.5", "train.local_work_min=1", "train.local_epochs=3"],
    "fedsmoo": ["algorithm.name=fedsmoo"],
    "dpfedavg": ["algorithm.name=dpfedavg", "algorithm.dp_clip=1.0", "algorithm.dp_noise=0.5"],   # Poisson
    "dpfedavg-fixed-dropout": ["algorithm.name=dpfedavg", "algorithm.dp_clip=1.0", "algorithm.dp_noise=0.5",
                               "run.sampling=fixed", "algorithm.params.dp_accountant=rdp", "run.dropout=0.3"],
    "dpfedmom-adaptive-cohort": DPFEDMOM,
    # q N = 0.9: round 4's Poisson cohort is empty, and the mechanism still runs (noise alone)
    "dpfedmom-empty-round": DPFEDMOM + ["run.clients_per_round=0", "run.participation=0.03", "run.rounds=4"],
    "fedadam": ["algorithm.name=fedadam"],
    "participation": ["algorithm.name=fedmom", "run.dropout=0.2", "train.local_work_min=1", "train.local_epochs=3",
                      "run.deadline_steps=20"],
    "parallel-b3-scaffold": ["algorithm.name=scaffold", "run.parallel_clients=3"],
    "plugin": [],   # examples/my_plugin.toml: its trimmed mean has no range form and runs gathered
}
# also run on 3 ranks (an odd split of the blocks) as real torchruns: the rules with sums over the
# whole vector or ranged state, client state, side by side and the plugin. Every rule's range form
# runs on 1-4 simulated ranks above (test_range_form_is_the_gathered_rule_on_any_number_of_ranks);
# the others' torchruns take 1, 2 and 4 ranks, which keeps the suite within its time.
AT_THREE = {"cgw", "fedgma", "feder", "dpfedavg", "dpfedmom-adaptive-cohort", "scaffold-dropout",
            "parallel-b3-scaffold", "plugin"}
# resumed across world sizes and modes: (stopping run's ranks and mode, resuming run's ranks and mode)
RESUMES = {"fedadam": ((3, "sharded"), (2, "sharded")), "fedsmoo": ((4, "sharded"), (1, "gather")),
           "fedmom": ((4, "gather"), (3, "sharded")), "scaffold-dropout": ((1, "sharded"), (2, "sharded")),
           "dpfedmom-adaptive-cohort": ((4, "sharded"), (2, "sharded")),
           "dpfedavg-fixed-dropout": ((1, "gather"), (2, "sharded"))}
# the torchruns in order; a resume runs in the first one of its world size after its stop's
SCHEDULE = (4, 3, 2, 1, 2)


def _args(name: str, out, mode: str, extra=()) -> list[str]:
    config = PLUGIN if name == "plugin" else QUICKSTART
    return [config] + BASE + RUNS[name] + [f"run.aggregation={mode}", f"run.out_dir={out}", *extra]


def _batches(root, names) -> list[list[list[str]]]:
    batches = [[] for _ in SCHEDULE]
    first = {w: SCHEDULE.index(w) for w in SCHEDULE}
    for world in (1, 2, 3, 4):
        batches[first[world]] += [_args(n, root / f"{n}-sharded{world}", "sharded") for n in RUNS
                                  if n in names and (world != 3 or n in AT_THREE)]
    batches[first[1]] += [_args(n, root / f"{n}-gather", "gather") for n in RUNS if n in names]
    four = ["run.rounds=4", "run.ckpt_every=1"]
    for name, ((w_stop, m_stop), (w_resume, m_resume)) in RESUMES.items():
        if name not in names:
            continue
        batches[first[1]].append(_args(name, root / f"{name}-whole", "gather", four))
        at = first[w_stop]
        batches[at].append(_args(name, root / f"{name}-resume", m_stop, four + ["run.stop_after=2"]))
        after = SCHEDULE.index(w_resume, at + 1)
        batches[after].append(_args(name, root / f"{name}-resume", m_resume, four + ["run.resume=true"]))
    return batches


def _selected(session) -> set[str]:
    """The RUNS names that this module's selected tests take (``-k dpfed`` runs only theirs)."""
    return {item.callspec.params["name"] for item in session.items
            if getattr(item, "module", None) is not None and item.module.__name__ == __name__
            and "name" in getattr(getattr(item, "callspec", None), "params", {})}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    """Every selected RUNS config sharded on 1, 2, 4 ranks (3 too: AT_THREE) and gathered on 1, and the selected
    RESUMES stopped after round 2 (4 rounds, a checkpoint every round) and resumed on another
    world size or mode."""
    root = tmp_path_factory.mktemp("sharded")
    for world, batch in zip(SCHEDULE, _batches(root, _selected(request.session))):
        if batch:
            run_fedddp_each(batch, world, config=None, env={"FEDDDP_KERNELS": "c"}, timeout=1500)
    return root


@pytest.mark.processes
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_sharded_runs_equal_the_gathered_run_on_1_to_4_ranks(runs, name):
    gathered = final_state(runs / f"{name}-gather")
    worlds = (1, 2, 3, 4) if name in AT_THREE else (1, 2, 4)
    for world in worlds:
        assert_same_state(final_state(runs / f"{name}-sharded{world}"), gathered)
    rows = [metrics(runs / f"{name}-sharded{w}") for w in worlds]
    for other in rows[1:]:  # the same clients, reports and train losses on every world size
        assert [(r["num_reports"], r["train_loss"]) for r in other] == [(r["num_reports"], r["train_loss"])
                                                                        for r in rows[0]]
    # the state's own rows (DP: the clip, moving with adaptive clipping, and epsilon) as gathered
    ledger = [{k: r.get(k) for k in ("dp_clip", "epsilon")} for r in metrics(runs / f"{name}-gather")]
    for other in rows:
        assert [{k: r.get(k) for k in ("dp_clip", "epsilon")} for r in other] == ledger


@pytest.mark.processes
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_across_world_sizes_and_modes_is_exact(runs, name):
    assert_same_state(final_state(runs / f"{name}-resume"), final_state(runs / f"{name}-whole"))


@pytest.mark.processes
@pytest.mark.e2e
def test_a_plugin_rule_without_a_range_form_runs_gathered_and_says_so(tmp_path):
    proc = run_fedddp(BASE + ["run.rounds=1", "run.aggregation=sharded", "run.progress=true",
                              f"run.out_dir={tmp_path / 'p'}"], nproc=2, config=PLUGIN)
    assert "gathered on rank 0 (the server rule examples.my_plugin:TRIMMED_MEAN has no sharded form)" in proc.stderr


@pytest.mark.e2e
def test_the_start_line_names_the_blocks(tmp_path, capsys):
    run_here(BASE + ["run.rounds=1", "run.aggregation=sharded", "run.progress=true", f"run.out_dir={tmp_path}"])
    assert "aggregation: sharded over 1 rank(s), 10 block(s) of 64 columns; " in capsys.readouterr().err


@pytest.mark.e2e
def test_divergence_stops_a_sharded_run_with_status_4(tmp_path, capsys):
    """The ranges' verdict (not finite, or the train loss) ends the run as in the gathered path."""
    status = run_here(BASE + ["run.rounds=3", "model.name=mlp", "train.lr=3", "run.aggregation=sharded",
                              f"run.out_dir={tmp_path}"], check=False)
    assert status == 4 and "the run diverged" in capsys.readouterr().err


def test_aggregation_block_must_be_a_multiple_of_64(tmp_path):
    from fedddp import config
    cfg = config.Config(run=config.RunConfig(aggregation_block=100))
    assert any("run.aggregation_block" in e for e in config.check_fields(cfg))
    assert "run.aggregation" in config.RESUME_MAY_CHANGE and "run.aggregation_block" not in config.RESUME_MAY_CHANGE



@pytest.mark.processes
@pytest.mark.slow
def test_the_benchmark_runs(tmp_path):
    """bench/aggregation_scale.py --smoke: a tiny model on 1 and 2 ranks, both modes, one row each."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "aggregation_scale.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[:3] for row in rows] == [["| 1", "4", "gather"], ["| 1", "4", "sharded"],
                                                      ["| 2", "4", "gather"], ["| 2", "4", "sharded"]]
