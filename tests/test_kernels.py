"""The fused CPU kernels (fedddp/strategies/kernels.c) against the rules' torch-op form, across
instruction sets, and without a compiler.

test_strategies.py checks both forms against the slow twins on small inputs; here the inputs
span many 16-column chunks and 256-column blocks, the stacks are strided views as round.py
hands them over, and K goes past the 32 rows where the kernels' prefetching matters.
Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fedddp import strategies
from fedddp.strategies import kernels
from test_strategies import as_gather_views, hp_of, make_inputs

FUSED = {"fedavg": hp_of(), "fedmom": hp_of(server_momentum=0.9), "fedcong": hp_of(cong_alpha=0.6),
         "fedcong_low_alpha": hp_of(cong_alpha=0.3),
         "fedgma": hp_of(gma_threshold=0.6, server_lr=0.5),
         "fedgma_soft_delta": hp_of(gma_threshold=0.6, server_lr=0.5, gma_mask="soft", gma_grad="delta"),
         "feder": hp_of(), "cgw": hp_of(cgw_alpha=0.2)}

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
@pytest.mark.parametrize("num_clients,num_params", [(7, 3001), (40, 1500)])
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


@needs_compiler
def test_bits_do_not_depend_on_the_instruction_set(monkeypatch):
    """-march=native (AVX-512 here) and the baseline x86-64 build give identical bits: columns
    are independent and no multiply-add is fused, so the vector width cannot change a sum."""
    native, baseline = kernels.compile_library(native=True), kernels.compile_library(native=False)
    monkeypatch.setenv("FEDDDP_KERNELS", "c")
    global_P, stacks = make_inputs(9, 2003, seed=5, discrete=True)
    for name in sorted(FUSED):
        results = []
        for library in (native, baseline):
            monkeypatch.setattr(kernels, "_loaded", library)
            results.append(aggregate(name, global_P, stacks))
        (native_P, _, native_diag), (baseline_P, _, baseline_diag) = results
        assert torch.equal(native_P, baseline_P), name
        for key in native_diag:
            assert torch.equal(native_diag[key], baseline_diag[key]), (name, key)


@needs_compiler
def test_a_second_compile_reuses_the_cached_library(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDDDP_CACHE", str(tmp_path))
    kernels.compile_library()
    built = sorted(os.listdir(tmp_path))
    assert len(built) == 1 and built[0].startswith("kernels-") and built[0].endswith(".so")
    mtime = os.path.getmtime(tmp_path / built[0])
    kernels.compile_library()
    assert sorted(os.listdir(tmp_path)) == built and os.path.getmtime(tmp_path / built[0]) == mtime


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
        "       for n in ('fedcong', 'fedavg')]\n"
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
