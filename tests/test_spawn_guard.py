"""tests/conftest.py's process guard: what it allows without @pytest.mark.processes is exactly
the kernels' builds. Triton's calls are recorded from real work (a compile for an H100 with its
ptxas, its look-up of libcuda), not listed by hand, so a Triton that starts another program, or
starts it by another call (``os.posix_spawn`` beneath ``subprocess`` where ``close_fds=False``),
is covered or shows up here first.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

import conftest

triton = pytest.importorskip("triton")


@pytest.fixture
def started(monkeypatch):
    """Every process started while the test runs, beneath the guard: (how, argv)."""
    seen: list[tuple[str, list[str]]] = []
    execute_child = subprocess.Popen._execute_child  # the guard's wrapper (conftest)

    def recorded(self, args, *rest, **kwargs):
        seen.append(("subprocess", conftest._argv(args)))
        return execute_child(self, args, *rest, **kwargs)
    monkeypatch.setattr(subprocess.Popen, "_execute_child", recorded)
    for name in ("posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            original = getattr(os, name)

            def spawn(path, argv, *rest, _original=original, _name=name, **kwargs):
                seen.append((f"os.{_name}", conftest._argv(argv)))
                return _original(path, argv, *rest, **kwargs)
            monkeypatch.setattr(os, name, spawn)
    return seen


def test_the_guard_allows_what_triton_starts_while_it_compiles(started, monkeypatch, tmp_path):
    """A compile for sm_90 from an empty cache runs ptxas (by ``os.posix_spawn`` beneath
    ``subprocess.run(..., close_fds=False)`` in Triton 3.8); this test is not marked
    ``processes``, so the guard would fail it for any process it did not allow."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in triton.backends.backends:
        pytest.skip("needs triton's CUDA backend")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # nothing cached: ptxas must run
    spec = importlib.util.find_spec("fedddp.strategies.triton_kernels")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    signature = dict(rows="*fp32", ld="i32", K="i32", P="i32", p="*fp32", out="*fp32",
                     BLOCK="constexpr", ALIGNED="constexpr")
    source = ASTSource(module._mean_kernel, signature, dict(BLOCK=1024, ALIGNED=False))
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options=module.OPTIONS)
    programs = [os.path.basename(argv[0]) for _, argv in started]
    assert any(p.startswith("ptxas") for p in programs), started  # the compile did start ptxas


def test_the_guard_allows_tritons_look_up_of_libcuda(started):
    """On a GPU Triton finds libcuda with ``/sbin/ldconfig -p``; the same call runs here."""
    from triton.backends.nvidia import driver

    if not os.path.exists("/sbin/ldconfig"):
        pytest.skip("no /sbin/ldconfig")
    try:
        driver.libcuda_dirs.__wrapped__()  # past its cache
    except AssertionError:
        pass  # no libcuda on this machine: Triton's assertion comes after the look-up
    assert ["/sbin/ldconfig", "-p"] in [argv for _, argv in started]


def test_any_process_started_beneath_tritons_code_is_allowed(started):
    """What Triton starts through the standard library (``platform`` runs ``file -b
    python`` to learn the interpreter's architecture) is judged by the caller on the stack:
    the same call made from Triton's own files passes, made from here it does not."""
    code = compile("import subprocess, sys\nsubprocess.run(['file', '-b', sys.executable], "
                   "capture_output=True)\nallowed = conftest._allowed(['file', '-b'])\n",
                   os.path.join(conftest._TRITON_DIR, "backends", "made_up.py"), "exec")
    scope = {"conftest": conftest}
    try:
        exec(code, scope)
    except FileNotFoundError:
        pytest.skip("no `file` program")  # the guard let it through; the program is missing
    assert scope["allowed"]
    assert started and started[0][1][:2] == ["file", "-b"]
    assert not conftest._allowed(["file", "-b", sys.executable])


def test_only_the_c_kernels_source_is_an_allowed_build():
    cc = os.environ.get("CC", "cc")
    assert conftest._kernels_build([cc, "-O3", "-shared", "/x/fedddp/strategies/kernels.c", "-o", "k.so"])
    assert not conftest._kernels_build([cc, "other.c"])
    assert not conftest._allowed([sys.executable, "-m", "fedddp"])
