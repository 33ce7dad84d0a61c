"""The package as pip builds it: the sdist and the wheel built from it hold what fedddp reads
beside its modules at run time (strategies/kernels.c, else the server rules fall back to torch
ops) and the Slurm task module that fedddp.study.sweep --slurm imports (it was a script beside the
package, launch/submit.py, so an installed fedddp refused --slurm). .ci/wheel_check.sh goes on
to install the wheel in a fresh venv and run it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

from fedrun import REPO

# Files beside the modules that the package opens at run time, and the modules that must be in it.
PACKAGE_DATA = ["fedddp/strategies/kernels.c"]
MODULES = ["fedddp/slurm.py", "fedddp/study/sweep.py", "fedddp/__main__.py"]


def source_copy(dest: str) -> None:
    """The checkout's files, tracked and new, not ignored (never a stale build/ or egg-info)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, timeout=60)
    if listed.returncode != 0:  # not a git checkout: the tree without build outputs
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(
            "build", "*.egg-info", "runs", "data", "__pycache__", ".git", ".pytest_cache"))
        return
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = os.path.join(REPO, name)
        if os.path.isfile(source):  # a file deleted but not yet committed is left out
            os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
            shutil.copy2(source, os.path.join(dest, name))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(sdist, wheel): the sdist from a clean copy, then the wheel from the sdist, as pip
    builds them for a user (offline: no build isolation, no dependencies)."""
    root = tmp_path_factory.mktemp("wheel")
    src, dist = root / "src", root / "dist"
    source_copy(str(src))
    sdist = subprocess.run([sys.executable, "-c", "import sys, setuptools.build_meta as b; "
                            "print(b.build_sdist(sys.argv[1]))", str(dist)],
                           cwd=src, capture_output=True, text=True, timeout=300)
    assert sdist.returncode == 0, sdist.stderr[-3000:]
    sdist_path = dist / sdist.stdout.strip().splitlines()[-1]
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
                            "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(sdist_path)],
                           cwd=root, capture_output=True, text=True, timeout=300)
    assert wheel.returncode == 0, wheel.stderr[-3000:]
    (wheel_path,) = dist.glob("fedddp-*.whl")
    return sdist_path, wheel_path


@pytest.mark.slow
@pytest.mark.processes
def test_wheel_holds_the_kernels_source_and_the_slurm_task(built):
    with zipfile.ZipFile(built[1]) as zf:
        names = set(zf.namelist())
    missing = [name for name in PACKAGE_DATA + MODULES if name not in names]
    assert not missing, f"missing from the wheel: {missing}"
    # every file the package carries besides modules is one it needs
    data = sorted(n for n in names if n.startswith("fedddp/") and not n.endswith(".py"))
    assert data == PACKAGE_DATA, data


@pytest.mark.slow
@pytest.mark.processes
def test_sdist_holds_the_kernels_source_and_the_slurm_task(built):
    with tarfile.open(built[0]) as tf:
        names = {name.split("/", 1)[1] for name in tf.getnames() if "/" in name}
    missing = [name for name in PACKAGE_DATA + MODULES if name not in names]
    assert not missing, f"missing from the sdist: {missing}"


@pytest.mark.processes
def test_package_data_is_every_file_beside_the_modules():
    """A file added beside the modules (a kernel source, a template) must join PACKAGE_DATA,
    and setup.cfg's [options.package_data], or the wheel goes without it."""
    listed = subprocess.run(["git", "ls-files", "fedddp"], cwd=REPO, capture_output=True, text=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    beside = sorted(n for n in listed.stdout.split() if not n.endswith(".py"))
    assert beside == PACKAGE_DATA, beside
