"""The fused CPU kernels (fedddp/strategies/kernels.c) against the rules' torch-op form, across
instruction sets, and without a compiler.

test_strategies.py checks both forms against the slow twins on small inputs; here the inputs
span many register chunks, prefetch blocks and 8192-column row-streaming blocks, the stacks
are strided views as round.py hands them over, and K goes past the 32 rows where the
kernels' prefetching matters. Then the per-machine choice of form.
Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from fedddp import strategies
from fedddp.strategies import kernels
from fedddp.strategies import fedcong as fedcong_module
from test_strategies import as_gather_views, hp_of, make_inputs, twin_fedcong

FUSED = {"fedavg": hp_of(), "fedmom": hp_of(server_momentum=0.9), "fedcong": hp_of(cong_alpha=0.6),
         "fedmom_lr": hp_of(server_momentum=0.9, server_lr=0.5),
         "fedcong_low_alpha": hp_of(cong_alpha=0.3),
         "fedgma": hp_of(gma_threshold=0.6, server_lr=0.5),
         "fedgma_soft_delta": hp_of(gma_threshold=0.6, server_lr=0.5, gma_mask="soft", gma_grad="delta"),
         "feder": hp_of(), "cgw": hp_of(cgw_alpha=0.2),
         "fedmedian": hp_of(), "fedtrimmedavg": hp_of(trim_beta=0.2)}

needs_compiler = pytest.mark.skipif(kernels.lib(torch.zeros(1)) is None, reason="no working C compiler")


def aggregate(name, global_P, stacks, state_seed=0):
    strategy = strategies.get(name.split("_")[0])
    hp = FUSED[name]
    state = strategy.init_state(global_P, hp)
    if "previous_P" in state:  # a velocity that is not zero
        state["previous_P"] = global_P + 0.01 * torch.randn(global_P.shape, generator=torch.Generator().manual_seed(state_seed))
    return strategy.aggregate(global_P.clone(), stacks, state, hp)


@needs_compiler
@pytest.mark.parametrize("name", sorted(FUSED))
@pytest.mark.parametrize("num_clients,num_params", [(7, 3001), (40, 1500), (6, 17003)])
def test_fused_and_torch_forms_agree(name, num_clients, num_params, monkeypatch):
    global_P, stacks = make_inputs(num_clients, num_params, seed=num_clients, discrete=name == "fedcong")
    stacks = as_gather_views(stacks)
    monkeypatch.setenv("FEDDDP_KERNELS", "c")
    fused_P, fused_state, fused_diag = aggregate(name, global_P, stacks)
    monkeypatch.setenv("FEDDDP_KERNELS", "torch")
    torch_P, torch_state, torch_diag = aggregate(name, global_P, stacks)
    torch.testing.assert_close(fused_P, torch_P, rtol=1e-5, atol=1e-6)
    assert fused_diag.keys() == torch_diag.keys()
    for key in fused_diag:
        torch.testing.assert_close(fused_diag[key], torch_diag[key], rtol=1e-5, atol=1e-6)
    for key in fused_state:
        torch.testing.assert_close(fused_state[key], torch_state[key])


def cpu_flags() -> set[str]:
    return set(kernels.cpu_signature().split(":")[-1].split())


@needs_compiler
def test_bits_do_not_depend_on_the_instruction_set(monkeypatch):
    """-march=native (AVX-512: 16 lanes, AVX2: 8), an x86-64-v3 build (AVX2, 8 lanes) and the
    baseline build (SSE2: 4 lanes) give identical bits: columns are independent, no
    multiply-add is fused, and sums over columns go into 16 partial sums whatever the width."""
    builds = [kernels.compile_library("native"), kernels.compile_library(None)]
    if {"avx2", "fma", "bmi2", "movbe", "f16c"} <= cpu_flags():
        builds.append(kernels.compile_library("x86-64-v3"))
    monkeypatch.setenv("FEDDDP_KERNELS", "c")
    global_P, stacks = make_inputs(9, 17003, seed=5, discrete=True)  # 2 blocks of 8192 + a tail
    for name in sorted(FUSED):
        results = []
        for library in builds:
            monkeypatch.setattr(kernels, "_loaded", library)
            results.append(aggregate(name, global_P, stacks))
        first_P, _, first_diag = results[0]
        for other_P, _, other_diag in results[1:]:
            assert torch.equal(first_P, other_P), name
            for key in first_diag:
                assert torch.equal(first_diag[key], other_diag[key]), (name, key)


@needs_compiler
def test_a_second_compile_reuses_the_cached_library(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDDDP_CACHE", str(tmp_path))
    kernels.compile_library()
    built = sorted(os.listdir(tmp_path))
    assert len(built) == 1 and built[0].startswith("kernels-") and built[0].endswith(".so")
    mtime = os.path.getmtime(tmp_path / built[0])
    kernels.compile_library()
    assert sorted(os.listdir(tmp_path)) == built and os.path.getmtime(tmp_path / built[0]) == mtime


@pytest.mark.processes
def test_without_a_compiler_the_rules_fall_back_to_torch_ops(tmp_path):
    """No compiler: one line on stderr, then the torch-op form, with the same result as when
    it is chosen on purpose."""
    script = (
        "import torch, sys\n"
        "sys.path.insert(0, %r)\n"
        "from test_strategies import hp_of, make_inputs\n"
        "from fedddp import strategies\n"
        "g, s = make_inputs(6, 700, seed=3)\n"
        "hp = hp_of(cong_alpha=0.5)\n"
        "out = [strategies.get(n).aggregate(g, s, strategies.get(n).init_state(g, hp), hp)[0]\n"
        "       for n in ('fedcong', 'fedavg', 'fedmedian', 'fedtrimmedavg')]\n"
        "torch.save(out, sys.argv[1])\n" % os.path.dirname(os.path.abspath(__file__)))
    results = []
    for env in ({"CC": str(tmp_path / "no-such-cc"), "FEDDDP_CACHE": str(tmp_path / "cache")},
                {"FEDDDP_KERNELS": "torch"}):
        target = tmp_path / f"out{len(results)}.pt"
        done = subprocess.run([sys.executable, "-c", script, str(target)], capture_output=True,
                              text=True, env={**os.environ, **env}, timeout=120)
        assert done.returncode == 0, done.stderr
        results.append((done.stderr, torch.load(target)))
    (no_cc_err, no_cc_out), (chosen_err, chosen_out) = results
    lines = no_cc_err.strip().splitlines()
    assert len(lines) == 1 and "fused CPU kernels unavailable" in lines[0] and "no-such-cc" in lines[0]
    assert chosen_err.strip() == ""
    for a, b in zip(no_cc_out, chosen_out):
        assert torch.equal(a, b)


def test_missing_source_says_the_install_is_incomplete(tmp_path, monkeypatch, capsys):
    """A package built without its package data had no kernels.c, and the line said to install
    a C compiler: it says the install is incomplete, and so does the run's start line."""
    for name, value in (("_loaded", None), ("_failure", None), ("_forms", None),
                        ("SOURCE", str(tmp_path / "kernels.c"))):
        monkeypatch.setattr(kernels, name, value)
    monkeypatch.setattr(kernels, "_why_unavailable", kernels._why_unavailable)
    monkeypatch.delenv("FEDDDP_KERNELS", raising=False)
    monkeypatch.setenv("FEDDDP_CACHE", str(tmp_path / "cache"))
    assert kernels.lib(torch.zeros(4)) is None
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "kernels.c is missing" in lines[0] and "install is incomplete" in lines[0], lines
    assert "C compiler" not in lines[0]
    described = kernels.describe(torch.device("cpu"), rule="fedavg")
    assert described.startswith("torch ops (kernels.c missing: this fedddp install is incomplete")
    assert "compiler" not in described and capsys.readouterr().err == ""


# -- the choice of form per rule ------------------------------------------------------------

def slowed(fn, times=20):
    """fn, made `times` times slower by doing its work again (so under any load)."""
    def slow(*args, **kwargs):
        for _ in range(times - 1):
            fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return slow


@pytest.fixture
def fresh_choice(tmp_path, monkeypatch):
    """Auto mode, an empty kernel cache, no choice made yet in this process, a smaller probe
    and one thread (the runtime's default)."""
    monkeypatch.delenv("FEDDDP_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "PROBE_PARAMS", 1 << 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("FEDDDP_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(kernels, "_forms", None)
    yield tmp_path
    torch.set_num_threads(threads)


def fedcong_in(form, global_P, stacks, monkeypatch):
    with monkeypatch.context() as patch:
        if form is not None:
            patch.setenv("FEDDDP_KERNELS", form)
        return aggregate("fedcong", global_P, stacks)[0]


@needs_compiler
@pytest.mark.parametrize("slow_form", ["c", "torch"])
def test_the_probe_picks_the_faster_form_and_caches_it(slow_form, fresh_choice, monkeypatch):
    """FedCong's kernel, or its torch-op form, made artificially slow: the probe picks the other
    one, the run uses it (with that form's bits, which the slow twin confirms), the choice is
    cached beside the library, and FEDDDP_KERNELS still forces either form."""
    if slow_form == "c":
        monkeypatch.setattr(kernels, "fedcong", slowed(kernels.fedcong))
    else:   # column_block sizes the torch-op form's blocks only: 64 columns cost ~20x the time
        monkeypatch.setattr(fedcong_module, "column_block", lambda num_rows, device: 64)
    expected = "torch" if slow_form == "c" else "c"
    assert kernels.forms()["fedcong"][0] == expected
    assert ("fused C kernel" if expected == "c" else "torch ops") in \
        kernels.describe(torch.device("cpu"), "fedcong")

    global_P, stacks = make_inputs(7, 300, seed=2, discrete=True)
    chosen_P = fedcong_in(None, global_P, stacks, monkeypatch)
    assert torch.equal(chosen_P, fedcong_in(expected, global_P, stacks, monkeypatch))
    twin_P, _ = twin_fedcong(global_P, stacks, 0.6, "samples")
    torch.testing.assert_close(chosen_P, torch.tensor(twin_P, dtype=torch.float32))

    cached = [f for f in os.listdir(fresh_choice) if f.endswith(".forms.json")]
    assert len(cached) == 1
    monkeypatch.setattr(kernels, "_forms", None)          # a new process: read, not probed
    monkeypatch.setattr(kernels, "probe", None)
    forms = kernels.forms()
    assert forms["fedcong"][0] == expected and forms["fedcong"][1].endswith("cached")
    for forced in ("c", "torch"):
        monkeypatch.setenv("FEDDDP_KERNELS", forced)
        assert (kernels.lib(torch.zeros(1), rule="fedcong") is not None) == (forced == "c")


@needs_compiler
def test_rules_whose_neutral_setting_is_fedavg_follow_fedavg_to_torch_ops(fresh_choice,
                                                                          monkeypatch):
    """Where FedAvg's kernel loses, FedMom, FedGMA and CGW keep their torch-op form whatever
    their own probe says, so that momentum 0 (and the other neutral settings) still give
    FedAvg's vector bit for bit in auto mode."""
    monkeypatch.setattr(kernels, "mean", slowed(kernels.mean))
    forms = kernels.forms()
    assert forms["fedavg"][0] == "torch"
    for rule in kernels.NEUTRAL_IS_FEDAVG:
        assert forms[rule][0] == "torch", rule
    global_P, stacks = make_inputs(6, 2000, seed=4)
    hp = hp_of(server_momentum=0.0)
    state = {"previous_P": global_P + 1.0}
    fedmom_P = strategies.get("fedmom").aggregate(global_P, stacks, state, hp)[0]
    fedavg_P = strategies.get("fedavg").aggregate(global_P, stacks, {}, hp)[0]
    assert torch.equal(fedmom_P, fedavg_P)
