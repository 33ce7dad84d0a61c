"""The fused Triton kernels (fedddp/strategies/triton_kernels.py), run on CPU through Triton's
interpreter, against the papers' slow twins; their neutral settings, determinism and block
independence; the dispatch between forms; and, on a GPU, against the torch ops at ResNet-18 size.

The interpreter is switched on by TRITON_INTERPRET=1 when a kernel is *defined*, so the fixture
loads its own copy of triton_kernels with it set and hands that copy to the dispatch
(kernels._triton_module): the rest of the session (and a GPU run's compiled kernels) is left
alone. The interpreter runs each program's block ops through numpy, so the inputs are small and
the blocks are shrunk to 16 columns, so that P crosses several blocks and ends inside one.
Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from fedddp import strategies
from fedddp.strategies import kernels
from fedrun import REPO, assert_same_state, final_state, run_fedddp, run_here
from test_fedadam import ROUNDING_CASES, check_rounding
from test_strategies import (as_gather_views, assert_close, hp_of, make_inputs, run, twin_cgw,
                             twin_feder, twin_fedcong, twin_fedgma, twin_fedmom, twin_weights)

pytest.importorskip("triton")

SMALL_BLOCK = 16
# K = 1 (a single client), odd K, and K = 33 (past 32 rows); P = 37: three blocks of 16, the
# last one partial
CLIENTS = [1, 3, 7, 33]
NUM_PARAMS = 37
_interpreted_module = None


def _load_interpreted():
    """A private copy of triton_kernels whose kernels were defined under the interpreter."""
    global _interpreted_module
    if _interpreted_module is None:
        spec = importlib.util.find_spec("fedddp.strategies.triton_kernels")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.INTERPRETED
        _interpreted_module = module
    return _interpreted_module


@pytest.fixture
def interpreted(monkeypatch):
    """The Triton form, interpreted on CPU, for every rule: FEDDDP_KERNELS=triton."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = _load_interpreted()
    monkeypatch.setattr(kernels, "_triton_module", module)
    monkeypatch.setattr(module, "BLOCK", SMALL_BLOCK)
    monkeypatch.setattr(module, "STATS_TILE", 256)    # CGW statistics: 16 columns a block at K > 8
    monkeypatch.setenv("FEDDDP_KERNELS", "triton")
    return module


def aggregate(name, global_P, stacks, hp, state=None):
    """The rule's result, checking that it ran the Triton form (not the torch ops)."""
    assert kernels.lib(stacks["params_KP"], rule=name) is _interpreted_module
    return run(name, global_P, stacks, hp, state)


def inputs(num_clients, seed, strided, discrete=False):
    global_P, stacks = make_inputs(num_clients, NUM_PARAMS, seed, discrete=discrete)
    return global_P, as_gather_views(stacks) if strided else stacks


# -- each rule against its slow twin -----------------------------------------------------------

@pytest.mark.parametrize("num_clients", CLIENTS)
@pytest.mark.parametrize("strided", [False, True])
def test_fedavg_matches_twin(interpreted, num_clients, strided):
    global_P, stacks = inputs(num_clients, 0, strided)
    new_P, _, _ = aggregate("fedavg", global_P, stacks, hp_of())
    p = twin_weights(stacks, "samples")
    rows = stacks["params_KP"].double().tolist()
    assert_close(new_P, [sum(p[k] * rows[k][j] for k in range(num_clients))
                         for j in range(NUM_PARAMS)])


@pytest.mark.parametrize("num_clients", CLIENTS)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_fedmom_matches_twin_over_rounds(interpreted, num_clients, strided, server_lr):
    hp = hp_of(server_momentum=0.9, server_lr=server_lr)
    global_P, _ = inputs(num_clients, 1, strided)
    state, velocity = strategies.get("fedmom").init_state(global_P, hp), [0.0] * NUM_PARAMS
    for round_idx in range(2):
        _, stacks = inputs(num_clients, 10 + round_idx, strided)
        new_P, state, diag = aggregate("fedmom", global_P, stacks, hp, state)
        twin_P, velocity = twin_fedmom(global_P, stacks, velocity, 0.9, "samples", server_lr)
        assert_close(new_P, twin_P)
        assert diag["velocity_norm"].item() == pytest.approx(
            server_lr * sum(v * v for v in velocity) ** 0.5, rel=1e-5, abs=1e-6)
        global_P = new_P


@pytest.mark.parametrize("num_clients", CLIENTS)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("alpha", [0.3, 0.7])
def test_fedcong_matches_twin(interpreted, num_clients, strided, alpha):
    hp = hp_of(cong_alpha=alpha)
    global_P, stacks = inputs(num_clients, 2, strided, discrete=True)
    new_P, _, diag = aggregate("fedcong", global_P, stacks, hp)
    twin_P, chosen = twin_fedcong(global_P, stacks, alpha, "samples")
    assert_close(new_P, twin_P)
    assert diag["cong_positive"].item() == pytest.approx(chosen.count(1) / NUM_PARAMS)
    assert diag["cong_negative"].item() == pytest.approx(chosen.count(-1) / NUM_PARAMS)
    assert diag["cong_all"].item() == pytest.approx(chosen.count(0) / NUM_PARAMS)


@pytest.mark.parametrize("num_clients", CLIENTS)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("grad_mode,mask_mode", [("last", "hard"), ("delta", "soft")])
def test_fedgma_matches_twin(interpreted, num_clients, strided, grad_mode, mask_mode):
    hp = hp_of(gma_threshold=0.6, server_lr=0.7, gma_grad=grad_mode, gma_mask=mask_mode,
               weighting="uniform")
    global_P, stacks = inputs(num_clients, 3, strided, discrete=True)
    new_P, _, diag = aggregate("fedgma", global_P, stacks, hp)
    twin_P, masks = twin_fedgma(global_P, stacks, 0.6, 0.7, grad_mode, mask_mode, "uniform")
    assert_close(new_P, twin_P)
    assert diag["mask_density"].item() == pytest.approx(sum(masks) / NUM_PARAMS, abs=1e-6)


@pytest.mark.parametrize("num_clients", CLIENTS)
@pytest.mark.parametrize("strided", [False, True])
def test_cgw_matches_twin(interpreted, num_clients, strided):
    hp = hp_of(cgw_alpha=0.3)
    global_P, stacks = inputs(num_clients, 4, strided)
    new_P, _, diag = aggregate("cgw", global_P, stacks, hp)
    twin_P, x, c, _, _ = twin_cgw(global_P, stacks, 0.3, "samples")
    assert_close(new_P, twin_P)
    assert_close(diag["cgw_x_K"], x, rtol=1e-4, atol=1e-7)
    assert diag["cgw_c"].item() == pytest.approx(c, rel=1e-5)


@pytest.mark.parametrize("num_clients", [3, 200])
def test_cgw_statistics_in_chunks_of_clients(interpreted, num_clients):
    """Past STATS_MAX_CLIENTS (128) the statistics pass reads the clients in chunks, twice."""
    _, stacks = make_inputs(num_clients, 20, 5)
    grads_KP = stacks["full_grad_KP"]
    sq_norm_K, m_K = interpreted.cgw_stats(grads_KP)
    grads_KP = grads_KP.double()
    torch.testing.assert_close(sq_norm_K, grads_KP.square().sum(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m_K, grads_KP @ grads_KP.sum(0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("num_clients", [10, 17])
def test_cgw_is_exact_when_the_gradients_nearly_cancel(interpreted, num_clients, monkeypatch):
    """As tests/test_cgw_precision.py for the C and torch forms: with ||sum_k D_k|| / ||D_k||
    at 1e-6 the statistics must still come from float64 sums (a float32 route loses m)."""
    from test_cgw_precision import ALPHA, cancelling_gradients_KP, cgw_float64, relative_error

    monkeypatch.setattr(interpreted, "BLOCK", 256)       # fewer programs: the interpreter is slow
    num_params, gen = 600, torch.Generator().manual_seed(num_clients)
    loss_K = 0.5 + torch.rand(num_clients, generator=gen)
    grads_KP = cancelling_gradients_KP(num_clients, num_params, 1e-6, gen)
    x_ref_K, correction_ref_P, measured = cgw_float64(grads_KP, loss_K, ALPHA)
    assert 1e-6 / 3 < measured < 3e-6                     # the inputs are as hard as intended
    stacks = {"params_KP": torch.zeros(num_clients, num_params), "full_grad_KP": grads_KP,
              "full_loss_K": loss_K, "num_samples_K": torch.ones(num_clients),
              "train_loss_K": loss_K}
    model_P, _, diag = aggregate("cgw", torch.zeros(num_params), stacks, hp_of(cgw_alpha=ALPHA))
    assert relative_error(diag["cgw_x_K"], x_ref_K) <= 1e-4
    assert relative_error(-model_P, correction_ref_P) <= 1e-4


@pytest.mark.parametrize("num_clients", CLIENTS)
@pytest.mark.parametrize("strided", [False, True])
def test_feder_matches_twin(interpreted, num_clients, strided):
    global_P, stacks = inputs(num_clients, 6, strided)
    # runs shorter than a block, and runs crossing block edges
    g = torch.Generator().manual_seed(num_clients)
    stacks["conv_group_P"] = torch.randint(-1, 4, (NUM_PARAMS,), generator=g).sort().values
    stacks["conv_group_P"][20:23] = 0
    from fedddp.flat import runs_R3
    stacks["conv_runs_R3"] = runs_R3(stacks["conv_group_P"])
    new_P, _, _ = aggregate("feder", global_P, stacks, hp_of())
    assert_close(new_P, twin_feder(global_P, stacks))


@pytest.mark.parametrize("eta,tau", ROUNDING_CASES)
def test_fedadam_unmoved_coordinates_stay_and_small_moves_match_the_twin(interpreted, eta, tau):
    """FedAdam's delta, sum_k p_k (w_k - w), through the Triton mean: test_fedadam.py's checks."""
    def triton_form(global_P, stacks, state, hp):
        return aggregate("fedadam", global_P, stacks, hp, state)

    check_rounding(triton_form, eta, tau)


# -- neutral settings, determinism, the C kernels' bits ----------------------------------------

NEUTRAL = {"fedmom": hp_of(server_momentum=0.0), "cgw": hp_of(cgw_alpha=0.0),
           "fedgma": hp_of(gma_threshold=0.0, server_lr=0.0),
           "fedgma_delta_soft": hp_of(gma_threshold=0.0, server_lr=0.0, gma_grad="delta",
                                      gma_mask="soft"),
           # the robust rules keep every client: their means are the mean kernel's over the same rows
           "fedtrimmedavg": hp_of(trim_beta=0.0, weighting="uniform"), "krum": hp_of(krum_m=50),
           "bulyan": hp_of(byzantine_f=0, weighting="uniform")}


@pytest.mark.parametrize("name", sorted(NEUTRAL))
@pytest.mark.parametrize("num_clients", [1, 7])
def test_neutral_settings_give_fedavg_bits(interpreted, name, num_clients):
    """Guards the shared summation: every kernel must form the mean as the mean kernel does."""
    rule, hp = name.split("_")[0], NEUTRAL[name]
    global_P, stacks = inputs(num_clients, 7, strided=True)
    state = {"previous_P": torch.randn(NUM_PARAMS)} if rule == "fedmom" else None
    new_P, _, _ = aggregate(rule, global_P, stacks, hp, state)
    assert torch.equal(new_P, aggregate("fedavg", global_P, stacks, hp_of(weighting=hp.weighting))[0])


# the rules whose fused part is the mean alone (FedAdam's family: delta; the robust rules: the
# mean of the rows they keep, after a torch selection; FedMedian and FedTrimmedAvg sort in their kernel)
MEAN_ONLY = {"fedyogi": hp_of(), "fedadagrad": hp_of(), "fedmedian": hp_of(), "fedtrimmedavg": hp_of(trim_beta=0.2),
             "krum": hp_of(byzantine_f=1, krum_m=3), "bulyan": hp_of(byzantine_f=1)}


@pytest.mark.parametrize("name", sorted(MEAN_ONLY))
def test_rules_through_the_triton_mean_agree_with_their_torch_ops(interpreted, name):
    global_P, stacks = inputs(7, 8, strided=True)
    new_P, _, _ = aggregate(name, global_P, stacks, MEAN_ONLY[name])
    with kernels.forced("torch"):
        torch_P, _, _ = run(name, global_P, stacks, MEAN_ONLY[name])
    torch.testing.assert_close(new_P, torch_P, rtol=1e-6, atol=1e-6)


RULE_HPS = {"fedavg": hp_of(), "fedmom": hp_of(server_momentum=0.9),
            "fedcong": hp_of(cong_alpha=0.3), "fedgma": hp_of(gma_threshold=0.6, server_lr=0.5),
            "feder": hp_of(), "cgw": hp_of(cgw_alpha=0.2),
            "fedmedian": hp_of(), "fedtrimmedavg": hp_of(trim_beta=0.2)}


@pytest.mark.parametrize("name", sorted(RULE_HPS))
def test_same_bits_on_every_call_and_for_any_block(interpreted, name, monkeypatch):
    """Columns are independent and each sums over clients in order: the new global vector does
    not depend on the call or on the block size (the grid); sums over columns may, in rounding."""
    global_P, stacks = inputs(7, 8, strided=True, discrete=name == "fedcong")
    first = aggregate(name, global_P, stacks, RULE_HPS[name])
    again = aggregate(name, global_P, stacks, RULE_HPS[name])
    monkeypatch.setattr(interpreted, "BLOCK", 64)          # one program for all 37 columns
    wide = aggregate(name, global_P, stacks, RULE_HPS[name])
    assert torch.equal(first[0], again[0]) and torch.equal(first[0], wide[0])
    for key in first[2]:
        assert torch.equal(first[2][key], again[2][key])
        torch.testing.assert_close(first[2][key], wide[2][key], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(RULE_HPS))
@pytest.mark.parametrize("aligned", [False, True])
def test_same_bits_as_the_c_kernels(interpreted, name, aligned, monkeypatch):
    """The kernels repeat kernels.c's arithmetic (client order, no multiply-add): in the
    interpreter, whose float32 ops round as the CPU's, the new global vector is the C kernel's.
    aligned: rows of 52 floats (16-byte aligned: the vector-load path) instead of strided views
    of 114 (P = 37)."""
    if kernels._library() is None:
        pytest.skip("no working C compiler")
    if aligned:
        global_P, stacks = make_inputs(33, 52, 9, discrete=name == "fedcong")
        assert interpreted._aligned(stacks["params_KP"], stacks["last_grad_KP"])
    else:
        global_P, stacks = inputs(33, 9, strided=True, discrete=name == "fedcong")
        assert not interpreted._aligned(stacks["params_KP"])
    triton_P = aggregate(name, global_P, stacks, RULE_HPS[name])[0]
    monkeypatch.setenv("FEDDDP_KERNELS", "c")
    assert torch.equal(triton_P, run(name, global_P, stacks, RULE_HPS[name])[0])


def test_fedmom_server_step_has_the_c_kernels_bits(interpreted, monkeypatch):
    """FedMom with server_lr != 1 (w + lr (mean - w) in place of the mean) in both kernels."""
    if kernels._library() is None:
        pytest.skip("no working C compiler")
    hp = hp_of(server_momentum=0.9, server_lr=0.5)
    global_P, stacks = inputs(33, 9, strided=True)
    state = {"previous_P": global_P + 0.01 * torch.randn(NUM_PARAMS)}
    triton_P, _, triton_diag = aggregate("fedmom", global_P, stacks, hp, dict(state))
    monkeypatch.setenv("FEDDDP_KERNELS", "c")
    c_P, _, c_diag = run("fedmom", global_P, stacks, hp, dict(state))
    assert torch.equal(triton_P, c_P)
    torch.testing.assert_close(triton_diag["velocity_norm"], c_diag["velocity_norm"])


# -- dispatch ----------------------------------------------------------------------------------

def test_triton_form_needs_the_interpreter_on_cpu(monkeypatch, capsys):
    """FEDDDP_KERNELS=triton on CPU tensors without the interpreter runs the torch ops, said once
    on stderr, and the start line says so."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernels, "_triton_module", None)
    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.setenv("FEDDDP_KERNELS", "triton")
    assert kernels.lib(torch.zeros(2, 3), rule="fedavg") is None
    assert kernels.lib(torch.zeros(2, 3), rule="fedcong") is None
    assert capsys.readouterr().err.count("TRITON_INTERPRET=1") == 1
    assert "torch ops" in kernels.describe(torch.device("cpu"), "fedavg")


def test_unsuitable_tensors_take_the_torch_ops(interpreted, monkeypatch):
    """float64 stacks, or stacks whose columns are not contiguous, cannot enter the kernels."""
    assert kernels.lib(torch.zeros(2, 3), rule="fedavg") is interpreted
    assert kernels.lib(torch.zeros(2, 3, dtype=torch.float64), rule="fedavg") is None
    assert kernels.lib(torch.zeros(3, 2).T, rule="fedavg") is None
    assert "Triton" in kernels.describe(torch.device("cpu"), "fedavg")
    monkeypatch.setenv("FEDDDP_KERNELS", "torch")
    assert kernels.lib(torch.zeros(2, 3), rule="fedavg") is None


@pytest.mark.processes
def test_a_cpu_run_does_not_import_triton():
    """Guards the fast start: triton (seconds to import) is imported only for the Triton form."""
    code = ("import sys, torch; from fedddp import strategies; from fedddp.config import "
            "AlgorithmConfig\n"
            "stacks = {'params_KP': torch.rand(3, 50), 'num_samples_K': torch.ones(3), "
            "'train_loss_K': torch.ones(3)}\n"
            "for rule in ('fedavg', 'fedcong'):\n"
            "    strategies.get(rule).aggregate(torch.zeros(50), stacks, {}, AlgorithmConfig(params={'cong_alpha': 0.7}))\n"
            "strategies.kernels.describe(torch.device('cpu'), 'fedavg')\n"
            "print('triton' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("FEDDDP_KERNELS", "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("algorithm", ["fedgma", "cgw"])
@pytest.mark.processes
@pytest.mark.e2e
def test_a_run_through_the_triton_form_ends_with_the_c_forms_model(tmp_path, algorithm, monkeypatch, capsys):
    """The rules inside a run (strided views of the gather buffer, the round loop's dispatch):
    the quickstart for 2 rounds with FEDDDP_KERNELS=triton in the interpreter (its own process:
    TRITON_INTERPRET is read when triton loads) writes the final.pt of FEDDDP_KERNELS=c (read at
    each call: in this process) bit for bit, and only its start line names the Triton form."""
    if kernels._library() is None:
        pytest.skip("no working C compiler")
    outs = {form: tmp_path / form for form in ("triton", "c")}
    args = ["run.rounds=2", f"algorithm.name={algorithm}", "run.progress=true", "run.eval_every=2"]
    proc = run_fedddp(args + [f"run.out_dir={outs['triton']}"],
                      env=dict(os.environ, FEDDDP_KERNELS="triton", TRITON_INTERPRET="1"))
    assert "Triton kernels in Triton's interpreter" in proc.stderr
    monkeypatch.setenv("FEDDDP_KERNELS", "c")
    capsys.readouterr()
    run_here(args + [f"run.out_dir={outs['c']}"])
    assert "Triton kernels in Triton's interpreter" not in capsys.readouterr().err
    assert_same_state(final_state(outs["triton"]), final_state(outs["c"]))


@pytest.mark.processes
def test_benchmark_runs_the_triton_path_in_the_interpreter():
    """bench/aggregate.py --device cuda times the Triton form; its code path, at tiny sizes."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("FEDDDP_KERNELS", None)
    proc = subprocess.run([sys.executable, "bench/aggregate.py", "--device", "cpu", "--kernel",
                           "triton", "--smoke"], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines()
            if line.startswith("| ") and "---" not in line]
    assert "Triton ms" in rows[0]
    assert sorted(row.split(" | ")[0][2:] for row in rows[1:]) == sorted(RULE_HPS)
    assert all(row.split(" | ")[4] == "triton" for row in rows[1:])


# -- compiled for a GPU, without one ------------------------------------------------------------

F32, I32 = "*fp32", "i32"
# kernel -> (runtime arguments' types, compile-time arguments besides ALIGNED), as a launch on
# float32 stacks passes them
SM90 = {
    "_mean_kernel": (dict(rows=F32, ld=I32, K=I32, P=I32, p=F32, out=F32), dict(BLOCK=1024)),
    "_mix_kernel": (dict(rows=F32, ld=I32, K=I32, weights_RK=F32, tile_run="*i32",
                         tile_block="*i32", bounds="*i64", out=F32), dict(BLOCK=1024)),
    "_fedmom_kernel": (dict(rows=F32, ld=I32, K=I32, P=I32, p=F32, g=F32, g_prev=F32,
                            momentum="fp32", lr="fp32", out=F32, sq_parts="*fp64"),
                       dict(BLOCK=1024)),
    "_cgw_kernel": (dict(W=F32, D=F32, ldw=I32, ldd=I32, K=I32, P=I32, p=F32, x=F32, out=F32),
                    dict(BLOCK=1024)),
    "_cgw_stats_kernel": (dict(D=F32, ld=I32, K=I32, P=I32, sq_parts="*fp64", dot_parts="*fp64"),
                          dict(KC=64, B=64, ONE_TILE=True)),
    "_fedgma_kernel": (dict(W=F32, G=F32, ldw=I32, ldg=I32, K=I32, num_clients="fp32", P=I32,
                            p=F32, g=F32, need=I32, eta="fp32", out=F32, mask_parts="*fp64"),
                       dict(HAS_G=True, SOFT=True, BLOCK=1024)),
    "_fedcong_kernel": (dict(W=F32, ld=I32, K=I32, P=I32, p=F32, g=F32, need=I32, out=F32,
                             took_parts="*i32"), dict(BLOCK=1024)),
}


@pytest.mark.parametrize("name", sorted(SM90))
def test_kernel_compiles_for_sm90_without_fma_and_with_vector_loads(name, monkeypatch):
    """Guards what the interpreter cannot see: each kernel compiles for an H100 (Triton's code
    generator and ptxas need no GPU), without multiply-add contraction (the C kernels' bits),
    and with more 4-float loads when the host says its rows are 16-byte aligned (the hint was
    once silently dropped: set on a helper's argument, it never reached the loads)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in triton.backends.backends or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs triton's CUDA backend, not the interpreter")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec = importlib.util.find_spec("fedddp.strategies.triton_kernels")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = getattr(module, name)
    types, constants = SM90[name]
    vector_loads = {}
    for aligned in (False, True):
        consts = dict(constants, ALIGNED=aligned)
        signature = {arg: "constexpr" if arg in consts else types[arg] for arg in kernel.arg_names}
        source = ASTSource(kernel, signature, consts, {(0,): [["tt.divisibility", 16]]})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options=module.OPTIONS)
        ptx = compiled.asm["ptx"]
        assert "fma.rn" not in ptx
        vector_loads[aligned] = ptx.count("ld.global.v4")
    assert vector_loads[True] > vector_loads[False]


# -- on a GPU ----------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(RULE_HPS))
def test_triton_and_torch_forms_agree_on_cuda_at_resnet18_size(name, monkeypatch):
    from fedddp.flat import FlatLayout, runs_R3
    from fedddp.models import resnet18

    layout = FlatLayout(resnet18((3, 32, 32), 100))
    num_clients, num_params, device = 32, layout.numel, torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    global_P = torch.randn(num_params, device=device, generator=gen)
    params_KP = global_P + 0.01 * torch.randn(num_clients, num_params, device=device, generator=gen)
    grads_KP = torch.randn(num_clients, num_params, device=device, generator=gen)
    stacks = {"params_KP": params_KP, "last_grad_KP": grads_KP, "full_grad_KP": grads_KP,
              "num_samples_K": torch.arange(10.0, 10.0 + num_clients, device=device),
              "train_loss_K": torch.rand(num_clients, device=device, generator=gen),
              "full_loss_K": 0.5 + torch.rand(num_clients, device=device, generator=gen),
              "eff_rank_KL": 3 * torch.rand(num_clients, len(layout.conv_entries()), device=device,
                                            generator=gen),
              "conv_runs_R3": runs_R3(layout.conv_group_P()).to(device)}
    results = {}
    for form in ("triton", "torch"):
        monkeypatch.setenv("FEDDDP_KERNELS", form)
        lib = kernels.lib(params_KP, rule=name)
        assert (lib is not None) == (form == "triton")
        results[form] = run(name, global_P, stacks, RULE_HPS[name])
    monkeypatch.setenv("FEDDDP_KERNELS", "triton")
    assert torch.equal(results["triton"][0], run(name, global_P, stacks, RULE_HPS[name])[0])
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=1e-5, atol=1e-5)
    for key, value in results["torch"][2].items():
        torch.testing.assert_close(results["triton"][2][key], value, rtol=1e-4, atol=1e-5)
