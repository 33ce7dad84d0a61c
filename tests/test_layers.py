"""The package's import graph, drawn from the code's own imports (ast, no import of fedddp): no
cycle, no arrow from a lower layer up, and no fedddp import inside a function but the few named
below with their reason. ``python tests/test_layers.py`` prints the graph."""

from __future__ import annotations

import ast
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "fedddp")

# Lowest first. A module (or a subpackage, with everything in it) imports only from its own layer
# or below, never a cycle; docs/architecture.md shows the same table.
LAYERS = [
    ["errors", "registry", "params", "atomic", "flat", "blocks", "sampling", "tasks", "env", "console"],  # ground: names and helpers
    ["plugins", "comm", "verdict", "outdir", "callbacks"],  # user modules, collectives and the ranks' verdicts, the run folder, rank 0's hooks
    ["config"],                             # the typed config tree and its own fields' checks
    ["data", "models", "metrics", "participation", "asynchrony"],
    ["strategies"],                         # server rules, their kernels
    ["client"],                             # local training: rules, optimizers, side by side
    ["client_eval"],                        # client evaluation: held-out cohorts, personalization steps
    ["algorithms"],                         # pairs of rules, the run's model, cross-rule checks
    ["checks"],                             # loading a config: plugins registered, every check
    ["checkpoint"],
    ["logs"],
    ["report", "plan", "resume"],           # the report row; who trains when (the schedules); where a run starts
    ["server", "book"],                     # the server interface and its gathered form; rank 0's book
    ["sharded", "warmup"],                  # the sharded server; the first calls made before round 1
    ["prepare"],                            # a run's parts, built once before round 1
    ["round"],                              # the round loop
    ["api", "usage"],                       # fedddp.run's path; what python -m fedddp says about itself
    ["__main__"],
    ["slurm", "launch"],                    # launchers over the command line: submitit; torchrun's agent
    ["study"],                              # study tools: sweeps, summaries, results, plots
    ["sweep", "summary", "results", "plot"],  # the study tools' old names, for one release
]

# fedddp imports that may sit inside a function: (importing module, imported module) -> why
LATE = {
    ("fedddp", "fedddp.api"): "``import fedddp`` stays without torch (tests/test_api.py)",
    ("fedddp.strategies.kernels", "fedddp.strategies.triton_kernels"): "triton: optional, CUDA builds only",
    # --help, the usage and a mistake in the config answer before torch is imported
    # (tests/test_fast_start.py): what imports torch is imported once it is needed
    ("fedddp.__main__", "fedddp.api"): "the run and --check, after the config's own checks",
    ("fedddp.launch", "fedddp.checkpoint"): "the stopped line's checkpoint, once a run has started",
    ("fedddp.__main__", "fedddp.checkpoint"): "Ctrl-C's line: the newest checkpoint, to say how to continue",
    ("fedddp.usage", "fedddp.algorithms"): "--help's second part: the algorithms and their parameters",
    ("fedddp.usage", "fedddp.checks"): "--help module:attr: a plugin registered as a run would",
    ("fedddp.usage", "fedddp.client.rules"): "--help module:attr: whether a plugin is a local rule",
}


def modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: str, known: dict[str, str]) -> list[tuple[str, bool]]:
    """(imported fedddp module, inside a function?) for each import of the module."""
    tree = ast.parse(open(path).read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = base + ("." + node.module if node.module else "")
            else:
                module = node.module or ""
            subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in known]
            targets = subs + ([module] if module in known and len(subs) < len(node.names) else [])
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name in known]
        else:
            continue
        found += [(t, id(node) in inside) for t in targets if t != name]
    return found


def graph() -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    known = modules()
    edges, late = {}, []
    for name, path in known.items():
        edges[name] = set()
        for target, in_function in imports(name, path, known):
            edges[name].add(target)
            if in_function:
                late.append((name, target))
    return edges, late


def unit(name: str) -> str:
    """fedddp.data.build -> data; fedddp -> the package itself."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer(name: str) -> int:
    u = unit(name)
    for i, units in enumerate(LAYERS):
        if u in units:
            return i
    return len(LAYERS)  # the package's own __init__: above everything


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    missing = sorted({unit(m) for m in modules() if unit(m) and layer(m) == len(LAYERS)})
    assert not missing, f"add {missing} to LAYERS (and to docs/architecture.md's table)"


def test_no_import_cycle():
    assert cycles(graph()[0]) == []


def test_no_arrow_from_a_lower_layer_up():
    edges, _ = graph()
    upward = [(a, b) for a, targets in edges.items() for b in targets
              if layer(a) < layer(b)]
    assert not upward, upward


def test_no_fedddp_import_inside_a_function_but_the_named_ones():
    _, late = graph()
    assert sorted(set(late)) == sorted(LATE), sorted(set(late) ^ set(LATE))


def test_the_graph_sees_imports():
    """Guards the drawing itself: arrows that exist must be found."""
    edges, late = graph()
    assert "fedddp.registry" in edges["fedddp.strategies.base"]
    assert "fedddp.client.rules" in edges["fedddp.algorithms"]
    assert ("fedddp.strategies.kernels", "fedddp.strategies.triton_kernels") in late


if __name__ == "__main__":
    edges, _ = graph()
    for name in sorted(edges, key=lambda m: (layer(m), m)):
        print(f"{layer(name):2d} {name} -> {', '.join(sorted(edges[name])) or '-'}")
    sys.exit(0)
