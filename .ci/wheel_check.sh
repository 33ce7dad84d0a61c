#!/usr/bin/env bash
# CI: the package as pip builds it, not the checkout. From a copy of the checkout's files
# (tracked and new, not ignored: a stale build/ or egg-info cannot leak in), build the sdist,
# then the wheel from the sdist, as pip does for a user who installs from either; check that
# both hold the files the package reads at run time (strategies/kernels.c) and the Slurm task
# (fedddp/slurm.py, which fedddp.study.sweep --slurm imports); install the wheel in a fresh venv that
# reuses this Python's installed packages (torch, submitit, ...) but imports fedddp from the
# wheel, never from the checkout or an editable install; from a folder outside the checkout, run
# a one-round quickstart and check that its start line names the C kernels, built from the
# installed kernels.c; and parse a sweep's --slurm flags through the installed fedddp.slurm.
#
#   bash .ci/wheel_check.sh        (PYTHON=python3.11 to pick the interpreter; 9-21 s on a shared 2 cores)
#
# Needs setuptools and wheel (pyproject.toml's build requirements) and a C compiler (cc or
# $CC), no network: the build does not isolate itself, the install takes no dependencies.
# Exit status: 0 all held; 1 something did not (its line says what).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python}
start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/fedddp_wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "wheel_check: FAILED: $*" >&2; exit 1; }
step() { echo "wheel_check: $* ($((SECONDS - start)) s)"; }

# 1. a clean copy of the source tree
mkdir -p "$work/src" "$work/dist"
if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
    (cd "$repo" && git ls-files -z --cached --others --exclude-standard |
        while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
        tar -c --null -T - -f -) | tar -x -C "$work/src" || fail "cannot copy the checkout"
else
    tar -c -C "$repo" --exclude=./build --exclude='*.egg-info' --exclude=./runs --exclude=./data \
        --exclude=__pycache__ -f - . | tar -x -C "$work/src" || fail "cannot copy the source tree"
fi

# 2. sdist, then the wheel from the sdist
(cd "$work/src" && "$python" -c "import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))" \
    "$work/dist") >"$work/sdist.log" 2>&1 || { tail -n 20 "$work/sdist.log" >&2; fail "sdist build"; }
sdist=$(ls "$work"/dist/fedddp-*.tar.gz 2>/dev/null | head -n 1)
[ -n "$sdist" ] || fail "no sdist in $work/dist"
"$python" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation --no-index \
    -w "$work/dist" "$sdist" >"$work/wheel.log" 2>&1 || { tail -n 20 "$work/wheel.log" >&2; fail "wheel build"; }
wheel=$(ls "$work"/dist/fedddp-*.whl 2>/dev/null | head -n 1)
[ -n "$wheel" ] || fail "no wheel in $work/dist"
step "built $(basename "$sdist") and $(basename "$wheel")"

# 3. both hold what the package needs beside its modules
"$python" - "$sdist" "$wheel" <<'EOF' || fail "package contents"
import sys, tarfile, zipfile
NEEDED = ["fedddp/strategies/kernels.c", "fedddp/slurm.py", "fedddp/study/sweep.py", "fedddp/strategies/kernels.py"]
sdist, wheel = sys.argv[1:]
with tarfile.open(sdist) as tf:
    in_sdist = {name.split("/", 1)[1] for name in tf.getnames() if "/" in name}
with zipfile.ZipFile(wheel) as zf:
    in_wheel = set(zf.namelist())
missing = [f"{kind}: {name}" for kind, names in (("sdist", in_sdist), ("wheel", in_wheel))
           for name in NEEDED if name not in names]
if missing:
    sys.exit("wheel_check: missing from the package: " + ", ".join(missing))
data = sorted(n for n in in_wheel if n.startswith("fedddp/") and not n.endswith(".py"))
print(f"wheel_check: {len(in_wheel)} files in the wheel; package data: {', '.join(data)}")
EOF

# 4. a venv that sees this Python's packages but takes fedddp from the wheel. This Python may
# itself be a venv (.ci/run's), whose packages --system-site-packages would not show (it shows
# the base interpreter's), so a .pth file in the new venv names this Python's site folders: they
# come after the venv's own, and their .pth files (an editable fedddp) are not run. Without pip
# of its own (this Python's pip, visible that way, installs into the venv); --ignore-installed:
# an editable or other install of fedddp outside the venv is left alone.
"$python" -m venv --without-pip "$work/venv" || fail "venv"
venv_python=$work/venv/bin/python
venv_site=$("$venv_python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") || fail "venv site"
"$python" -c "import site, sys; print('\n'.join(p for p in sys.path if p.endswith('-packages')))" \
    >"$venv_site/_outer_site.pth" || fail "venv site"
"$venv_python" -m pip install --quiet --disable-pip-version-check --no-deps --no-index \
    --ignore-installed --no-warn-script-location "$wheel" >"$work/install.log" 2>&1 ||
    { tail -n 20 "$work/install.log" >&2; fail "install of the wheel into the venv"; }
step "installed into a venv"

# 5. from a folder outside the checkout: the installed copy is the one imported
run=$work/run
mkdir -p "$run"
cd "$run" || fail "cd $run"
export FEDDDP_CACHE=$work/cache     # kernels built now, from the installed kernels.c
unset PYTHONPATH
"$venv_python" - "$work/venv" <<'EOF' || fail "the venv does not import the installed fedddp"
import os, sys
import fedddp, fedddp.slurm, fedddp.study.sweep
from fedddp.strategies import kernels
venv = os.path.realpath(sys.argv[1])
for label, path in (("fedddp", fedddp.__file__), ("fedddp.slurm", fedddp.slurm.__file__),
                    ("kernels.c", kernels.SOURCE)):
    if not os.path.realpath(path).startswith(venv + os.sep):
        sys.exit(f"wheel_check: {label} comes from {path}, not from the venv {venv}")
    if not os.path.exists(path):
        sys.exit(f"wheel_check: {path} missing")
print(f"wheel_check: fedddp imported from {os.path.dirname(fedddp.__file__)}")
EOF

# The probe may choose torch ops for a rule on some CPUs; FEDDDP_KERNELS=c takes the C kernels
# wherever they build, so the line checks the install, not this CPU; --verbose: the start line's
# long form names the aggregation's form.
FEDDDP_KERNELS=c "$venv_python" -m fedddp --verbose "$repo/configs/quickstart.toml" run.rounds=1 \
    "run.out_dir=$run/quickstart" >"$work/run.out" 2>"$work/run.err"
status=$?
line=$(grep -m 1 "aggregation:" "$work/run.err")
echo "wheel_check: start line: ${line:-(none)}"
[ "$status" -eq 0 ] || { tail -n 20 "$work/run.err" >&2; fail "quickstart exited $status"; }
case "$line" in
    *"aggregation: fused C kernel"*) ;;
    *) tail -n 20 "$work/run.err" >&2; fail "the start line does not name the C kernels" ;;
esac
[ "$(wc -l <"$run/quickstart/metrics.jsonl")" -eq 1 ] || fail "quickstart: not one metrics row"
step "one-round quickstart ran with the C kernels"

# --slurm, as far as it goes without a cluster: flags parsed by the installed fedddp.slurm, no job
"$venv_python" -m fedddp.study.sweep "$repo/configs/quickstart.toml" run.seed=0,1 --out "$run/sweep" \
    --slurm --local --gpus-per-node 0 --dry-run >"$work/sweep.out" 2>&1 ||
    { cat "$work/sweep.out" >&2; fail "sweep --slurm --dry-run"; }
grep -q "2 combination(s)" "$work/sweep.out" || { cat "$work/sweep.out" >&2; fail "sweep --slurm --dry-run output"; }
step "passed"
