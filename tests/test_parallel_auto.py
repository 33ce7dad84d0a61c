"""run.parallel_clients = auto, and whether side by side pays on CPU (fedddp.client.parallel): the
prediction and verdict from the probe's timings, the start line's warning, the measurement that
changes no bit, the resolved B recorded and kept on resume, CUDA's footprint.
Legend: B clients side by side.
"""

from __future__ import annotations

import pytest
import torch

from fedddp import checks, config
from fedddp.client import parallel
from fedddp.comm import Comm

from fedrun import assert_same_state, final_state, run_here
from test_parallel_clients import BLOBS, DROPOUT, SINGLE


def _timings(one_step, side_one, side_many, probe=8, one_call=0.0, side_call=0.0):
    return parallel.Timings(one_call, one_step, side_call, side_one, side_many, probe)


def test_auto_is_one_after_another_on_cpu():
    """auto on CPU is 1 without measuring: every result stays what it was when 1 was the default."""
    cfg = checks.load(None, [])
    assert cfg.run.parallel_clients == "auto" and config.Config().run.parallel_clients == "auto"
    b, words = parallel.resolve(cfg, Comm(SINGLE, "cpu"), None, None, None, [], None)
    assert b == 1 and "run.parallel_clients=auto: 1 on CPU" in words
    b, words = parallel.resolve(cfg, Comm(SINGLE, "cpu"), None, None, None, [], None, resumed=3)
    assert b == 3 and "the checkpoint's B = 3" in words
    assert cfg.run.parallel_clients == "auto"  # the loaded config stays as it was: the run builds its own
    explicit = checks.load(None, ["run.parallel_clients=4"])
    assert parallel.resolve(explicit, Comm(SINGLE, "cpu"), None, None, None, [], None) == \
        (4, "clients up to 4 side by side")


def test_predict_counts_the_clients_still_stepping():
    """Side by side, a step costs what the clients still stepping cost: uneven clients leave the
    longest one stepping alone at the price of a side-by-side step of one."""
    t = _timings(one_step=1.0, side_one=3.0, side_many=10.0, probe=8)  # 3 + 1 per extra client
    assert t.side_step_s(1) == 3.0 and t.side_step_s(8) == 10.0 and t.side_step_s(4) == 6.0
    assert parallel.predict(t, [10] * 8) == (80.0, 100.0)
    assert parallel.predict(t, [2, 10]) == (12.0, 2 * 4.0 + 8 * 3.0)
    with_calls = _timings(1.0, 3.0, 10.0, one_call=0.5, side_call=2.0)
    assert parallel.predict(with_calls, [1, 1]) == (3.0, 2.0 + 4.0)
    single = _timings(1.0, 3.0, 3.0, probe=1)  # a group of one timed: no line to draw
    assert parallel.predict(single, [5, 5]) == (10.0, 30.0)


def test_verdict_warns_when_one_after_another_is_faster():
    cheap_steps = _timings(one_step=1.0, side_one=1.5, side_many=2.5, probe=8)  # 8 clients' step: 2.5 s, not 8
    even, uneven = [[10] * 8, [10] * 8], [[1, 1, 1, 1, 1, 1, 1, 60]]
    slower, words = parallel.cpu_verdict(cheap_steps, even, "rounds 1-5")
    assert not slower and words.startswith("3.2x faster than one after another (rank 0's groups of rounds 1-5")
    slower, words = parallel.cpu_verdict(cheap_steps, uneven, "round 1")
    assert slower and words.startswith("WARNING: side by side is 1.4x slower than one after another on this CPU")
    assert "run.parallel_clients=1 is faster here" in words and "\n" not in words
    slower, words = parallel.cpu_verdict(_timings(1.0, 1.0, 8.0), even, "round 1")
    assert not slower and words.startswith("about as fast as one after another")
    # run.compile: the timings are of eager steps, which the compiled run does not take: no advice
    slower, words = parallel.cpu_verdict(cheap_steps, uneven, "round 1", compiled=True)
    assert slower and words.startswith("eager side by side 1.36x the time of one after another (rank 0's groups")
    assert "WARNING" not in words and "run.parallel_clients=1" not in words and "run.compile's step is timed" in words


def test_batch_from_memory():
    gib = 2 ** 30
    # 80 GiB free, 1 GiB a client: 64 of 0.8 * 80 = 64 GiB fit; capped by the clients a rank trains
    assert parallel.batch_from_memory(80 * gib, gib, 0, 1000) == 64
    assert parallel.batch_from_memory(80 * gib, gib, 0, 50) == 50
    assert parallel.batch_from_memory(80 * gib, gib, 10 * gib, 1000) == 32  # 54 fit: a power of two
    assert parallel.batch_from_memory(2 * gib, gib, 0, 1000) == 1  # fewer than two fit
    assert parallel.batch_from_memory(80 * gib, 0, 0, 7) == 7
    cfg = checks.load(None, ["run.clients_per_round=10"])
    assert [parallel.clients_per_rank(cfg.num_sampled(), r) for r in (1, 2, 3, 16)] == [10, 5, 4, 1]


@pytest.mark.e2e
def test_the_start_line_warns_when_the_measurement_says_one_after_another_is_faster(tmp_path, monkeypatch,
                                                                                      capsys):
    """B > 1 on CPU: the start line (one line) carries the verdict of the measurement, here
    given timings; the run's bits do not depend on it (a run without the line, so without the
    measurement, ends with the same model)."""
    given = {"slow": _timings(1e-4, 1e-3, 2e-3), "fast": _timings(1e-3, 1e-4, 2e-4)}
    finals = {}
    for name, timings in given.items():
        monkeypatch.setattr(parallel, "measure_cpu", lambda *args, t=timings, **kw: t)
        # a cache of its own: no given timing reaches the machine's, nor the next case (prepare.py)
        monkeypatch.setenv("FEDDDP_CACHE", str(tmp_path / f"cache_{name}"))
        capsys.readouterr()
        out = tmp_path / name
        run_here(["run.rounds=2", "run.parallel_clients=3", f"run.out_dir={out}", "run.progress=true"])
        start = [line for line in capsys.readouterr().err.splitlines() if "rank(s) on cpu" in line]
        assert len(start) == 1
        if name == "slow":
            assert "; clients up to 3 side by side; WARNING: side by side is" in start[0], start[0]
            assert "run.parallel_clients=1 is faster here" in start[0]
        else:
            assert "side by side; " in start[0] and "x faster than one after another" in start[0]
            assert "WARNING" not in start[0]
        finals[name] = final_state(out)
    monkeypatch.undo()
    run_here(["run.rounds=2", "run.parallel_clients=3", f"run.out_dir={tmp_path / 'quiet'}"])
    assert_same_state(finals["slow"], final_state(tmp_path / "quiet"))


@pytest.mark.e2e
def test_the_measurement_changes_no_bit(tmp_path, capsys):
    """The real measurement (rank 0, on copies of the model, the global generator restored) before
    round 1: the same final model as a run that does not measure (run.progress=false), here
    with a Dropout model and uneven local work."""
    args = DROPOUT + ["run.rounds=2", "run.parallel_clients=3", "train.local_work_min=1", "train.local_epochs=2"]
    run_here(args + [f"run.out_dir={tmp_path / 'measured'}", "run.progress=true"])
    start = [line for line in capsys.readouterr().err.splitlines() if "rank(s) on cpu" in line]
    assert len(start) == 1 and "(rank 0's groups of rounds 1-2 predicted from one group timed both ways" in start[0]
    run_here(args + [f"run.out_dir={tmp_path / 'quiet'}"])
    assert_same_state(final_state(tmp_path / "measured"), final_state(tmp_path / "quiet"))


@pytest.mark.e2e
def test_auto_records_the_resolved_B_and_a_resume_keeps_the_checkpoints(tmp_path, capsys):
    """config.toml and the checkpoint's identity hold the B a run used; resuming with auto takes
    the checkpoint's B (on any machine, the same bits as the uninterrupted run), an explicit other
    B is refused, and a default (auto) run's config.toml says 1 on CPU."""
    import json

    fresh = tmp_path / "fresh"
    run_here(["run.rounds=1", f"run.out_dir={fresh}"])
    assert "parallel_clients = 1\n" in (fresh / "config.toml").read_text()
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    run_here(["run.rounds=3", "run.parallel_clients=3", f"run.out_dir={whole}"])
    run_here(["run.rounds=3", "run.parallel_clients=3", "run.stop_after=1", f"run.out_dir={stopped}"])
    manifest = json.loads((stopped / "checkpoints" / "round_000001" / "manifest.json").read_text())
    assert manifest["identity"]["run.parallel_clients"] == 3
    capsys.readouterr()
    assert run_here(["run.rounds=3", "run.parallel_clients=1", "run.resume=true", f"run.out_dir={stopped}"],
                    check=False) == 2
    assert "run.parallel_clients 3 -> 1" in capsys.readouterr().err
    run_here(["run.rounds=3", "run.resume=true", f"run.out_dir={stopped}", "run.progress=true"])  # auto
    assert "the checkpoint's B = 3" in capsys.readouterr().err
    assert "parallel_clients = 3\n" in (stopped / "config.toml").read_text()
    assert_same_state(final_state(whole), final_state(stopped))


def test_auto_on_cuda_decides_from_the_footprint_and_falls_back_to_one(monkeypatch):
    """The CUDA path's choice without a GPU: the measured footprint and the free memory given
    (cuda_footprint itself needs a GPU and is not tested here); what side by side cannot run
    makes auto 1, with the reason."""
    from types import SimpleNamespace

    from fedddp import tasks
    from fedddp.algorithms import build_model
    from fedddp.client import LocalTraining
    from fedddp.data import build
    from fedddp.flat import FlatLayout

    mib = 2 ** 20
    free = [100 * mib]
    monkeypatch.setattr(parallel, "cuda_footprint", lambda *args, **kwargs: (mib, mib))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 200 * mib))
    comm = SimpleNamespace(device=torch.device("cpu"), world_size=2, rank=0)

    def choice(overrides):
        cfg = checks.load(None, BLOBS + overrides)
        data = build(cfg, cfg.data.seed, list(range(cfg.data.num_clients)))
        model = build_model(cfg, data.input_shape, data.num_classes, data.task)
        return parallel._cuda_choice(LocalTraining.of(cfg, 2), cfg.model, cfg.num_sampled(), comm, model,
                                     FlatLayout(model), data, range(cfg.data.num_clients), tasks.get(data.task))

    b, why = choice([])
    assert b == 3 and "at most 3 clients a rank a round" in why  # 6 a round on 2 ranks
    free[0] = 3 * mib
    assert choice([])[0] == 1
    free[0] = 100 * mib
    b, why = choice(["model.name=test_parallel_clients:noisy_mlp"])
    assert b == 1 and "its module features.2 (Noise) calls a random operation" in why, why


def test_auto_accepts_the_B_a_run_recorded():
    """A checkpoint's identity and a sweep's run folder hold the resolved B: a config that says auto
    is the same setting (no refusal on resume, no 'other settings' in a sweep), another B is not."""
    from fedddp import checkpoint

    saved = checkpoint.identity(checks.load(None, ["run.parallel_clients=4"]))
    assert checkpoint.identity_changes(saved, checkpoint.identity(checks.load(None, []))) == []
    assert checkpoint.identity_changes(saved, checkpoint.identity(checks.load(None, ["run.parallel_clients=2"]))) \
        == ["run.parallel_clients 4 -> 2"]
    assert config.same_setting("run.parallel_clients", 1, "auto")
    assert not config.same_setting("run.parallel_clients", 1, 2)
    assert not config.same_setting("run.rounds", 1, "auto")


def test_sweep_finds_a_run_of_auto_with_its_resolved_B_the_same(tmp_path):
    from fedddp.study import sweep

    (tmp_path / "config.toml").write_text(config.dumps(checks.load(None, ["run.parallel_clients=1"])))
    assert sweep.settings_mismatch(str(tmp_path), sweep.settings_of(checks.load(None, []))) == []
    assert sweep.settings_mismatch(str(tmp_path), sweep.settings_of(checks.load(None, ["run.parallel_clients=2"]))) == \
        ["run.parallel_clients: 1 there, 2 here"]
