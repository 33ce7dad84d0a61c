"""A rule carries everything about itself: no core module names a built-in rule, one
registration path that refuses a taken name, and FedDyn (Acar et al. 2021) added as its two
files alone, checked against twins written from the paper's equations.
Legend: K sampled clients, P flat parameters.
"""

from __future__ import annotations

import ast
import math
import os

import pytest
import torch

from fedddp import registry, strategies
from fedddp.client import rules  # importing the clients registers every built-in local rule
from fedddp.strategies import Span
from test_local_rules import close, make_client, run_client, server_inputs, twin_grad, twin_shapes
from test_strategies import hp_of

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fedddp")

# Where a rule's name belongs: the registry, the rules' own files.
RULE_HOMES = ("registry.py", "strategies/", "client/rules/", "client/clip.py")
# Core modules that may still name a rule, each with its reason: none (the old flat keys' table
# and algorithm.name's default are the registry's).
ALLOWED: dict[str, str] = {}


def built_in_names() -> set[str]:
    return {n for table in (registry.SERVER_RULES, registry.LOCAL_RULES, registry.ALGORITHMS)
            for n in table if ":" not in n}


def core_files():
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(folder, name), PACKAGE).replace(os.sep, "/")
            if name.endswith(".py") and not rel.startswith(RULE_HOMES):
                yield rel


def named_rules(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each string literal outside a docstring that is a rule's name, and of
    each identifier compared with something that is one."""
    tree = ast.parse(source)
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    hits = [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
            and id(node) not in docs]
    hits += [(node.lineno, side.id) for node in ast.walk(tree) if isinstance(node, ast.Compare)
             for side in [node.left, *node.comparators] if isinstance(side, ast.Name) and side.id in names]
    return hits


def test_no_core_module_names_a_built_in_rule():
    names = built_in_names()
    found = {}
    for rel in core_files():
        with open(os.path.join(PACKAGE, rel)) as f:
            hits = named_rules(f.read(), names)
        if hits and rel not in ALLOWED:
            found[rel] = hits
    assert not found, f"core modules that name a rule (give the rule a hook instead): {found}"


def test_the_scan_finds_a_name():
    """The scan itself: a branch on a rule's name is found, a docstring's mention is not."""
    source = '"""moon is mentioned here."""\nif local == "moon":\n    pass\nif scaffold != x:\n    pass\n'
    assert named_rules(source, {"moon", "scaffold"}) == [(2, "moon"), (4, "scaffold")]


def test_a_taken_name_is_refused_in_one_line():
    with registry.kept():
        with pytest.raises(registry.DuplicateName, match="server rule 'fedavg' is registered twice"):
            registry.add_server(strategies.get("fedavg"))
        with pytest.raises(registry.DuplicateName, match="local rule 'prox'"):
            registry.add_local(rules.Prox)
        with pytest.raises(registry.DuplicateName, match="algorithm 'fedprox'"):
            registry.add_algorithm("fedprox", "prox", "fedavg", "samples")


def test_snapshot_restores_the_tables():
    saved = registry.snapshot()
    before = {n: dict(t) for n, t in zip("SLAW", saved)}

    class Extra(rules.LocalRule):
        name = "extra_for_test"

    registry.add_local(Extra)
    registry.add_algorithm("extra_for_test", "extra_for_test", "fedavg", "uniform")
    assert "extra_for_test" in registry.ALGORITHMS
    registry.restore(saved)
    assert {n: dict(t) for n, t in zip("SLAW", registry.snapshot())} == before


# -- FedDyn: its files and one registration -------------------------------------------------

FEDDYN_FILES = ("strategies/feddyn.py", "client/rules/feddyn.py")


def test_feddyn_is_its_own_files():
    """The algorithm registers from its own module, and no other file of the package names it
    (as a string: FedSMOO's docs mention FedDyn's drift correction): adding it took no edit
    elsewhere."""
    assert registry.ALGORITHMS["feddyn"] == ("feddyn", "feddyn") and registry.WEIGHTING["feddyn"] == "uniform"
    assert strategies.get("feddyn").aggregate.__module__ == "fedddp.strategies.feddyn"
    assert rules.RULES["feddyn"].__module__ == "fedddp.client.rules.feddyn"
    elsewhere = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), PACKAGE).replace(os.sep, "/")
            if name.endswith(".py") and rel not in FEDDYN_FILES:
                with open(os.path.join(PACKAGE, rel)) as f:
                    text = f.read()
                    if '"feddyn"' in text or "'feddyn'" in text:
                        elsewhere.append(rel)
    assert not elsewhere


def feddyn_hp(alpha: float):
    return hp_of(name="feddyn", weighting="uniform", feddyn_alpha=alpha)


@pytest.mark.parametrize("alpha", [0.1, 0.01])
def test_feddyn_server_twin(alpha):
    """Alg. 1's server in float64 loops: h <- h - alpha (1/N) sum_{k in S} (w_k - w), then
    w <- (1/|S|) sum_{k in S} w_k - h / alpha, over two rounds (the second reads h)."""
    global_P, stacks = server_inputs()
    rule, hp = strategies.get("feddyn"), feddyn_hp(alpha)
    K, P = stacks["params_KP"].shape
    N = float(stacks["num_clients"])
    state = rule.init_state(global_P, hp)
    h = [0.0] * P
    w = [float(v) for v in global_P]
    for round_idx in range(2):
        rows = stacks["params_KP"] + 0.05 * round_idx
        new_P, state, _ = rule.aggregate(global_P, dict(stacks, params_KP=rows), state, hp)
        for j in range(P):
            h[j] -= alpha / N * sum(float(rows[k, j]) - w[j] for k in range(K))
            w[j] = sum(float(rows[k, j]) for k in range(K)) / K - h[j] / alpha
            assert math.isclose(float(new_P[j]), w[j], rel_tol=1e-5, abs_tol=1e-5)
            assert math.isclose(float(state["dyn_h_P"][j]), h[j], rel_tol=1e-5, abs_tol=1e-6)
        global_P = new_P


def test_feddyn_span_is_the_gathered_form_bitwise():
    """The gathered form is the span form over one block; any block width gives the same bits."""
    global_P, stacks = server_inputs(K=5, P=23)
    rule, hp = strategies.get("feddyn"), feddyn_hp(0.05)
    state = {"dyn_h_P": torch.randn(23, generator=torch.Generator().manual_seed(3))}
    whole = rule.aggregate(global_P, stacks, dict(state), hp)
    for width in (4, 7):
        part = rule.aggregate_span(global_P, stacks, dict(state), hp, Span.whole(23, width, "cpu"))
        assert torch.equal(part[0], whole[0]) and torch.equal(part[1]["dyn_h_P"], whole[1]["dyn_h_P"])


def test_feddyn_client_twin():
    """Two local steps along g - grad_k + alpha (w - w_server), then grad_k <- grad_k - alpha
    (w_k - w_server), from a nonzero grad_k."""
    alpha, lr = 0.3, 0.1
    cfg, model, layout, data, g = make_client("feddyn", [f"algorithm.params.feddyn_alpha={alpha}"], steps=2)
    shapes = twin_shapes()
    w_glob = layout.flatten(model).clone()
    grad_k = 0.2 * torch.randn(layout.numel, generator=g)
    out, state = run_client(cfg, model, layout, data, w_glob, state={"dyn_grad_P": grad_k.clone()})
    w = w_glob.clone()
    for _ in range(2):
        w = w - lr * (twin_grad(w, data.x, data.y, shapes) - grad_k + alpha * (w - w_glob))
    close(out["params_P"], w)
    close(state["dyn_grad_P"], grad_k - alpha * (w - w_glob))


def test_feddyn_alpha_zero_is_plain_training():
    """alpha = 0: no linear or quadratic term, grad_k stays 0: the plain rule's steps bit for bit."""
    trained = {}
    for local, extra in (("feddyn", ["algorithm.params.feddyn_alpha=0"]), ("plain", [])):
        cfg, model, layout, data, _ = make_client(local, extra, steps=3)
        out, state = run_client(cfg, model, layout, data, layout.flatten(model).clone())
        trained[local] = out["params_P"]
        if local == "feddyn":
            assert torch.equal(state["dyn_grad_P"], torch.zeros_like(state["dyn_grad_P"]))
    assert torch.equal(trained["feddyn"], trained["plain"])


def test_feddyn_refuses_alpha_zero_on_the_server():
    errors = strategies.get("feddyn").check_params({"feddyn_alpha": 0.0})
    assert len(errors) == 1 and "feddyn_alpha" in errors[0]


def test_feddyn_on_any_number_of_ranks_is_the_gathered_rule():
    """The sharded server's form (each rank its range, h kept by range) gives the gathered bits on
    1 to 4 ranks, from a state that is not round 1's."""
    from test_sharded import _inputs, _on_ranks
    rule = strategies.get("feddyn")
    global_P, stacks, _ = _inputs(seed=5)
    hp = feddyn_hp(0.05)
    global_P, state, _ = rule.aggregate(global_P, stacks, rule.init_state(global_P, hp), hp)
    want_P, want_state, _ = rule.aggregate(global_P, stacks, state, hp)
    for world in (1, 2, 3, 4):
        new_P, new_state, _ = _on_ranks(rule, global_P, stacks, state, hp, world)
        assert torch.equal(new_P, want_P) and torch.equal(new_state["dyn_h_P"], want_state["dyn_h_P"]), world


@pytest.mark.e2e
def test_feddyn_runs_through_the_round_loop(tmp_path):
    """Three rounds through fedddp.round.run: a finite model, other than FedAvg's from the same seed."""
    from test_local_rules import final_global
    dyn = final_global(tmp_path, "feddyn", "algorithm.params.feddyn_alpha=0.1")
    avg = final_global(tmp_path, "fedavg", "algorithm.weighting=uniform")
    assert torch.isfinite(dyn).all() and (dyn - avg).abs().max() > 1e-4
