"""Fixtures shared by several test modules, and the guard that keeps the markers true.

Markers (setup.cfg): ``processes`` a test that starts a process (``python -m fedddp``,
``torchrun``, any ``subprocess`` or ``multiprocessing``), ``e2e`` a test that runs experiments
through the round loop (here or in processes it starts), ``slow`` one that takes several seconds
or more. ``python -m pytest -q tests -m
"not processes"`` is the unit run. A test that starts a process without ``processes`` fails
(``_spawn_guard``), so the marking cannot rot. The processes allowed anywhere are the kernels'
builds (``_allowed``): the C compiler filling the kernels' cache (strategies/kernels.py), a build
step that any unit test of a server rule may trigger on a fresh machine, and whatever Triton
starts while it compiles or loads a kernel (ptxas, ``/sbin/ldconfig -p`` to find libcuda, the C
compiler for its launcher, ``file -b`` through ``platform``), by whichever call it uses
(``subprocess`` with or without ``os.posix_spawn`` beneath it).
"""

import multiprocessing.process
import os
import subprocess
import sys
import threading

import pytest

from fedddp import plugins, registry

# The tests read the start line's long form (the rules, the aggregation's form, how the clients
# train); tests/test_book.py checks the short one a user sees by default. Set before any test
# starts a process, so every rank of every run inherits it.
os.environ.setdefault("FEDDDP_VERBOSE", "1")
from fedrun import SLOW, run_here

# The test whose setup, call or teardown is running (None between tests and at collection).
_running: list = [None]
# Processes the running test started without the marker from another thread, whose exception
# never reaches the test: _spawn_guard fails the test for them.
_unmarked: list[str] = []
_started: list[str] = []  # every process the running test started
_experiments: list[int] = [0]  # round loops run here (fedddp.round.run; FEDDDP_TEST_SPAWN_LOG only)


def _argv(argv) -> list[str]:
    return [os.fsdecode(a) for a in ([argv] if isinstance(argv, (str, bytes, os.PathLike)) else argv)]


def _kernels_build(argv) -> bool:
    """``$CC`` (default cc) compiling the C kernels' source, kernels.c."""
    args = _argv(argv)
    return (bool(args) and os.path.basename(args[0]) == os.path.basename(os.environ.get("CC", "cc"))
            and any(a.endswith("kernels.c") for a in args))


def _package_dir(name: str) -> str | None:
    """Where an installed package's files lie, found without importing it (None: not installed)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    return os.path.join(os.path.dirname(spec.origin), "") if spec and spec.origin else None


_TRITON_DIR = _package_dir("triton")


def _from_triton() -> bool:
    """A frame of Triton's own code is on the stack: what Triton starts while it compiles or
    loads a kernel, whichever process and whichever call it uses (Triton's versions differ)."""
    frame = sys._getframe(1)
    while frame is not None:
        if _TRITON_DIR and frame.f_code.co_filename.startswith(_TRITON_DIR):
            return True
        frame = frame.f_back
    return False


def _allowed(argv) -> bool:
    """A process any test may start: the kernels' builds (the module's docstring)."""
    return _kernels_build(argv) or _from_triton()


def _refuse(what: str) -> None:
    item = _running[0]
    _started.append(what)
    if item is not None and item.get_closest_marker("processes") is None:
        if threading.current_thread() is not threading.main_thread():
            _unmarked.append(what)  # its exception ends that thread, not the test
        pytest.fail(f"{item.nodeid} starts a process ({what}) but is not marked "
                    "@pytest.mark.processes (tests/conftest.py, setup.cfg)", pytrace=False)


# subprocess.Popen judged its child already: the os call it makes beneath (os.posix_spawn where
# close_fds=False, fork and exec otherwise) is the same process, not another to judge.
_inside_popen = threading.local()
_popen_execute_child = subprocess.Popen._execute_child
_process_start = multiprocessing.process.BaseProcess.start
_os_calls = {name: getattr(os, name) for name in ("system", "fork", "forkpty", "posix_spawn",
                                                  "posix_spawnp", "spawnv", "spawnve", "execv", "execve")
             if hasattr(os, name)}


def _guarded_execute_child(self, args, *rest, **kwargs):
    if not _allowed(args):
        _refuse(f"subprocess: {' '.join(_argv(args))[:120]}")
    _inside_popen.depth = getattr(_inside_popen, "depth", 0) + 1
    try:
        return _popen_execute_child(self, args, *rest, **kwargs)
    finally:
        _inside_popen.depth -= 1


def _guarded_start(self):
    _refuse(f"multiprocessing: {self!r}")
    return _process_start(self)


def _guarded_os(name):
    original = _os_calls[name]

    def call(*args, **kwargs):
        if not getattr(_inside_popen, "depth", 0):
            # posix_spawn(path, argv, env), spawnv(mode, path, argv), execv(path, argv): the argv
            argv = next((a for a in args if isinstance(a, (list, tuple))), None)
            if not (_from_triton() or (argv is not None and _kernels_build(argv))):
                _refuse(f"os.{name}")
        return original(*args, **kwargs)
    return call


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Covers setup (module-scoped fixtures that start a shared run included), call and teardown."""
    _running[0] = item
    _unmarked.clear()
    _started.clear()
    _experiments[0] = 0
    try:
        yield
    finally:
        _running[0] = None
        if os.environ.get("FEDDDP_TEST_SPAWN_LOG"):  # to review the marks: what each test started
            with open(os.environ["FEDDDP_TEST_SPAWN_LOG"], "a") as fh:
                marks = ",".join(m for m in ("processes", "e2e", "slow") if item.get_closest_marker(m))
                fh.write(f"{item.nodeid}\tmarks={marks}\tstarted={len(_started)}\truns={_experiments[0]}\n")


def _warm_matplotlib() -> None:
    """matplotlib builds its font cache on first import (running ``fc-list``), once a machine:
    built here, before the guard, so that no plotting test starts that process on a fresh one."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.font_manager  # noqa: F401
    except ImportError:  # the plot extra is optional: its tests skip
        pass


def pytest_configure(config):
    _warm_matplotlib()
    if os.environ.get("FEDDDP_TEST_SPAWN_LOG"):  # count the experiments each test runs here too
        import fedddp.round

        rounds = fedddp.round.run

        def counted(*args, **kwargs):
            _experiments[0] += 1
            return rounds(*args, **kwargs)
        fedddp.round.run = counted  # before fedddp.api and the test modules bind it
    subprocess.Popen._execute_child = _guarded_execute_child
    multiprocessing.process.BaseProcess.start = _guarded_start
    for name in _os_calls:
        setattr(os, name, _guarded_os(name))


def pytest_unconfigure(config):
    subprocess.Popen._execute_child = _popen_execute_child
    multiprocessing.process.BaseProcess.start = _process_start
    for name, original in _os_calls.items():
        setattr(os, name, original)


@pytest.fixture(autouse=True)
def _spawn_guard(request):
    """Fails a test that started a process without @pytest.mark.processes, in whatever thread."""
    yield
    if _unmarked:
        found, _unmarked[:] = list(_unmarked), []
        pytest.fail(f"{request.node.nodeid} starts processes without @pytest.mark.processes: "
                    + "; ".join(found[:3]), pytrace=False)


# Test files whose shared runs (module fixtures) take longest, started first: under pytest-xdist
# (setup.cfg) each file runs whole on one worker, and a long file that starts last ends the suite
# alone while the other workers wait (tests/test_sharded.py's torchruns: about 2 minutes).
LONGEST_FIRST = ("test_sharded.py", "test_launch.py", "test_client_state.py", "test_rules_end_to_end.py",
                 "test_sweep.py", "test_restarts.py", "test_state_travels.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most 8 (each imports torch and some start 4 ranks)."""
    return max(1, min(os.cpu_count() or 1, 8))


@pytest.fixture
def without_scontrol(monkeypatch):
    """A machine without Slurm's tools: fedddp.env.first_host expands the node list itself
    instead of starting ``scontrol show hostnames`` (the same first host where Slurm is there)."""
    from types import SimpleNamespace

    from fedddp import env

    def missing(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "scontrol")

    monkeypatch.setattr(env, "subprocess", SimpleNamespace(run=missing, SubprocessError=subprocess.SubprocessError))


@pytest.fixture(scope="session")
def slow_reference(tmp_path_factory):
    """SLOW run uninterrupted, on one rank in this process (any world size gives the bitwise-same
    model; the tests that use it start the runs they compare with it)."""
    out = tmp_path_factory.mktemp("slow_reference")
    run_here(SLOW + [f"run.out_dir={out}"])
    return out


@pytest.fixture
def plugin_registries(monkeypatch):
    """The registries plugins join (fedddp.registry's tables, the imported modules) and sys.path
    restored after the test, so no other test sees the plugins it registered."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    # the built-in rules register as fedddp.algorithms is imported, which the command line does
    # only once it needs them: registered before the snapshot, restore keeps them
    import fedddp.algorithms  # noqa: F401
    import fedddp.data.build  # noqa: F401  (the data sets' builders, likewise)
    saved, objects = registry.snapshot(), dict(plugins._objects)
    yield
    registry.restore(saved)
    plugins._objects.clear()
    plugins._objects.update(objects)
