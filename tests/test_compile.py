"""run.compile: torch.compile of the whole side-by-side step (fedddp.client.compiled.WholeStep:
gradients, the rule's direction, BatchNorm statistics, SGD's or Adam's update) against the eager
step, to float32 rounding (tests/test_parallel_clients.py's TOL), with groups smaller than B (5
clients a round at B = 3: groups of 3 and 2, padded to 3), clients that leave their group at
different steps (their rows masked), rules with entries (FedProx, SCAFFOLD) and an extra pass
(SAM), a BatchNorm model, and no graph compiled again within a run; the start line's measured
figure and its words (a fake clock); the mode (CUDA graphs on CUDA); the start line with B = 1;
a compiler failure is one line and the eager step; a later run loads the graphs from disk."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._pytree import tree_leaves

from fedddp import checks, warmup
from fedddp.client import compiled
from fedddp.comm import Comm
from fedddp.errors import DivergenceError
from fedddp.env import ProcessEnv
from fedddp.round import run

from fedrun import QUICKSTART
from test_parallel_clients import BN_CNN

SINGLE = ProcessEnv(0, 1, 0, "127.0.0.1", 0, "single")
TOL = 2e-5
SMALL = ["run.clients_per_round=5", "run.rounds=2", "run.eval_every=100", "train.batch_size=16",
         "model.name=mlp", "model.hidden=16"]


def final_P(tmp_path, overrides: list[str], compile_: bool, parallel: int = 3, progress: bool = False):
    out = tmp_path / f"compile{compile_}-B{parallel}"
    cfg = checks.load(QUICKSTART, SMALL + overrides + [f"run.out_dir={out}", "run.overwrite=true",
                                                       f"run.compile={str(compile_).lower()}",
                                                       f"run.parallel_clients={parallel}",
                                                       f"run.progress={str(progress).lower()}"])
    return run(cfg, Comm(SINGLE, "cpu"))["global_P"]


# (overrides, whether the whole step compiles in the warm-up: every rule here, those with entries
# of their own (FedProx's anchor, SCAFFOLD's correction, FedSMOO's duals) too, made for the
# warm-up by their begin hooks)
CASES = {
    "plain": ([], True),
    "momentum": (["train.momentum=0.9", "train.nesterov=true", "train.weight_decay=0.01"], True),
    "adam": (["train.optimizer=adam", "train.lr=0.003", "train.weight_decay=0.01"], True),
    "fedprox": (["algorithm.name=fedprox"], True),
    "scaffold": (["algorithm.name=scaffold"], True),
    "fedsmoo": (["algorithm.name=fedsmoo"], True),
    # seed 1: at seed 0 one of client 0's 138 steps sits near a ReLU's kink, where float32 rounding
    # (1.5e-8 apart) flips it and the final models part by 8e-5 of their scale, compiled or not
    "feddyn": (["algorithm.name=feddyn", "run.seed=1"], True),
    "sam": (["algorithm.name=fedsam"], True),
    "batchnorm": (BN_CNN + ["train.momentum=0.9"], True),
    # full batches of 16 to 139 samples: every step padded to the widest client's, one graph
    "full_batch": (["train.batch_size=0"], True),
}


@pytest.mark.slow
@pytest.mark.processes  # inductor runs the C++ compiler
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.e2e
def test_compiled_equals_eager(tmp_path, case, capsys, monkeypatch):
    """... with one graph for every step, round and group of the run (torch._dynamo refuses to
    compile again: error_on_recompile), compiled in the warm-up before round 1 where the rule
    has no entries of its own, and the start line's measured figure there."""
    extra, in_warm_up = CASES[case]
    eager_P = final_P(tmp_path, extra, False)
    capsys.readouterr()
    warm_up, graphs = warmup.warm_up, []

    def counted(run_, comm):
        words = warm_up(run_, comm)
        graphs.append((counters["stats"]["unique_graphs"], words))
        return words

    monkeypatch.setattr(warmup, "warm_up", counted)
    torch._dynamo.reset()  # the graphs of other tests' models are not this run's
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled_P = final_P(tmp_path, extra, True)
    after_warm_up, words = graphs[0]
    if in_warm_up:
        assert after_warm_up > before and counters["stats"]["unique_graphs"] == after_warm_up
        assert "run.compile: step " in words and "ms eager" in words, words
    else:
        assert after_warm_up == before and counters["stats"]["unique_graphs"] > before
    err = capsys.readouterr().err
    assert err.count("side-by-side step compiled in") == 1 and "failed" not in err, err  # once a run
    scale = eager_P.abs().max().item()
    assert (eager_P - compiled_P).abs().max().item() <= TOL * scale


@pytest.mark.slow
@pytest.mark.processes  # inductor runs the C++ compiler
@pytest.mark.parametrize("case", ["momentum", "adam", "batchnorm"])
def test_a_compiled_step_is_one_call_and_its_batch(case):
    """The whole step dispatches, outside its compiled graph, the call and the two gathers of its
    batch (x, y): no per-tensor loop, no rate or step count built a step (bench/step_ops.py
    --compile; a count, never a time)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import step_ops

    row = step_ops.measure(case, 4, "cpu", compile_=True)
    assert row["fedddp_ops"]["compiled call"] == 1, row["fedddp_ops"]
    assert row["fedddp"] <= 3, row["fedddp_ops"]
    assert row["graph"] > 0  # the model's math ran within the graph


@pytest.mark.slow
@pytest.mark.processes  # inductor runs the C++ compiler
@pytest.mark.parametrize("case", ["momentum", "adam"])
def test_the_copies_a_replay_needs_are_one_op_a_dtype(case, monkeypatch):
    """On CUDA a step also copies what it hands the next out of the CUDA graph's pool
    (compiled.Persistent), counted here on CPU with the copies forced: one _foreach_copy_ for the
    float32 stacks and one for the float64 ones (loss sums, Adam's step count), not one a tensor
    (bench/step_ops.py --compile --replay-copies; a count, never a time)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import step_ops
    from fedddp.client import batched

    monkeypatch.setattr(batched, "replay_outputs_freed", lambda device: True)
    row = step_ops.measure(case, 4, "cpu", compile_=True)
    assert row["fedddp_ops"]["aten::_foreach_copy_"] == 2, row["fedddp_ops"]
    assert row["fedddp"] <= 5, row["fedddp_ops"]


@pytest.mark.e2e
def test_a_client_that_has_taken_its_steps_keeps_its_bits(tmp_path, monkeypatch):
    """The whole step (here run eagerly: torch.compile replaced by the function itself) leaves
    every tensor of a row whose client no longer steps (or pads the group) as it was, bit for
    bit: parameters, running statistics, momentum, loss sum. Clients of 16 to 139 samples at
    batch 30 take 1 to 5 steps, so most steps have such rows."""
    from fedddp.client.batched import BatchedTrainer

    whole, seen = BatchedTrainer._whole, []

    def checked(self, stacks, batch, lr_R, live_R):
        kept, direction_T, replaced = whole(self, stacks, batch, lr_R, live_R)
        for key, tensors in kept.items():
            for new, old in zip(tensors, stacks[key]):
                seen.append(int((~live_R).sum()))
                assert torch.equal(new[~live_R], old[~live_R]), key
        return kept, direction_T, replaced

    monkeypatch.setattr(BatchedTrainer, "_whole", checked)
    monkeypatch.setattr(compiled.torch, "compile", lambda fn, **kwargs: fn)
    final_P(tmp_path, BN_CNN + ["train.momentum=0.9", "train.weight_decay=0.01"], True)
    assert seen and max(seen) > 0


def overwriting_compile(fn, **kwargs):
    """torch.compile as CUDA graph trees treat a call's outputs, on CPU: the function runs
    eagerly, and calling it again first overwrites its previous outputs (NaN, -7 for integers),
    as the next replay writes the graph's memory pool."""
    previous = []

    def call(*args):
        for t in previous:
            t.fill_(float("nan") if t.is_floating_point() else -7)
        out = fn(*args)
        previous[:] = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    return call


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["adam", "fedsmoo"])
def test_a_step_keeps_what_the_next_replay_overwrites(tmp_path, monkeypatch, case):
    """On CUDA the whole step's outputs live in its CUDA graph's pool, which the next step's
    replay overwrites: what a step carries to the next (the stacks, FedSMOO's replaced dual) is
    copied into buffers of the step's own first (compiled.Persistent). Emulated on CPU
    (``overwriting_compile``): with the copies the run equals the eager one; without them it
    does not (the emulation can fail the run)."""
    from fedddp.client import batched

    extra = CASES[case][0]
    eager_P = final_P(tmp_path, extra, False)
    monkeypatch.setattr(compiled.torch, "compile", overwriting_compile)
    monkeypatch.setattr(batched, "replay_outputs_freed", lambda device: True)
    kept_P = final_P(tmp_path, extra, True)
    assert (eager_P - kept_P).abs().max().item() <= TOL * eager_P.abs().max().item()
    if case == "adam":  # the same run without the copies reads overwritten stacks: NaN, and it stops
        monkeypatch.setattr(batched, "replay_outputs_freed", lambda device: False)
        with pytest.raises(DivergenceError):
            final_P(tmp_path, extra, True)


def test_the_mode_is_cuda_graphs_on_cuda_only():
    assert compiled.compile_mode("cuda") == "reduce-overhead"
    assert compiled.compile_mode(torch.device("cuda", 0)) == "reduce-overhead"
    assert compiled.compile_mode("cpu") is None


def test_the_measured_figure_in_the_start_line_words():
    assert compiled.speed_words(0.0031, 0.0040) == "run.compile: step 3.1 ms compiled against 4.0 ms eager (1.29x)"
    slower = compiled.speed_words(0.0050, 0.0040)
    assert slower.startswith("run.compile: step 5.0 ms compiled against 4.0 ms eager (0.80x)")
    assert "does not pay here: run.compile=false is faster" in slower


def test_the_warm_up_times_compiled_against_eager_steps(monkeypatch):
    """WholeStep.measure on a fake clock: TIMED_CALLS compiled calls, then as many eager ones,
    each after one untimed call; the words from their mean times."""
    calls = []
    step = compiled.WholeStep(lambda n: calls.append("eager") or n + 1)
    monkeypatch.setattr(compiled.torch, "compile", lambda fn, **kwargs: lambda *a: calls.append("compiled") or fn(*a))
    ticks = iter([0.0, 3 * 0.002, 10.0, 10.0 + 3 * 0.001])  # compiled 2 ms a step, eager 1 ms
    monkeypatch.setattr(compiled, "clock", lambda: next(ticks))
    words = step.measure((1,), torch.device("cpu"))
    assert words == step.words == compiled.speed_words(0.002, 0.001)
    assert "does not pay here" in words
    n = compiled.TIMED_CALLS
    assert calls == ["compiled", "eager", "eager"] + ["compiled", "eager"] * n + ["eager"] * n


@pytest.mark.e2e
def test_compile_with_one_after_another_says_so(tmp_path, capsys):
    final_P(tmp_path, [], True, parallel=1, progress=True)
    assert "compile applies to side by side only" in capsys.readouterr().err


@pytest.mark.e2e
def test_a_compiler_failure_is_one_line_and_the_eager_step(tmp_path, capsys, monkeypatch):
    eager_P = final_P(tmp_path, [], False)

    def refuse(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("no backend for this model\nsecond line")
        return compiled

    monkeypatch.setattr(compiled.torch, "compile", refuse)
    capsys.readouterr()
    P = final_P(tmp_path, [], True)
    err = capsys.readouterr().err
    assert err.count("run.compile: torch.compile failed (RuntimeError: no backend for this model") == 1, err
    assert "Traceback" not in err
    assert torch.equal(P, eager_P)


@pytest.mark.slow
@pytest.mark.processes  # inductor runs the C++ compiler
@pytest.mark.e2e
def test_a_later_run_loads_the_compiled_step_from_the_cache(tmp_path, capsys, monkeypatch):
    """The compiled graphs are kept in FEDDDP_CACHE (not inductor's /tmp): a later run of the
    same step (here after torch._dynamo.reset(), as a new process starts) loads them from disk
    instead of compiling, and says so in its line. The variable starts as importing torch._dynamo
    leaves it (inductor's default), which is not a user's choice."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("FEDDDP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    torch._dynamo.reset()
    first = final_P(tmp_path / "first", [], True)
    assert os.listdir(tmp_path / "cache" / "inductor")
    torch._dynamo.reset()  # forget what this process compiled: only the disk is left
    hits = compiled.compile_cache_hits()
    second = final_P(tmp_path / "second", [], True)
    assert compiled.compile_cache_hits() > hits
    assert torch.equal(first, second)
    err = capsys.readouterr().err
    assert "kept in" in err and "graph(s) loaded from" in err
