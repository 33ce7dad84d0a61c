#!/usr/bin/env bash
# One machine, one rank per GPU (2 ranks on a machine without GPUs): python -m fedddp.launch
# (torchrun's launcher, ending with fedddp's line and status) with its options from the environment.
#
#   launch/local.sh CONFIG.toml [section.key=value ...]
#   NPROC=4 MAX_RESTARTS=3 launch/local.sh configs/feder_cifar100.toml run.out_dir=runs/feder
#
# NPROC         ranks to start (--nproc; default: number of visible GPUs, or 2 without any)
# MAX_RESTARTS  torchrun --max-restarts (default 0). With N > 0, a rank that dies brings the
#               whole group back and the run continues from its last checkpoint
#               (set run.ckpt_every); see docs/launching.md.
# PYTHON        the interpreter whose torch and fedddp to use (default: python)
# CHECK         1 (default): check the config and data first, 0: skip it (data too big to load twice)
#
# Everything after the config is passed to fedddp untouched. Exit status: fedddp's (0, 2 to 7:
# README.md), with fedddp's line last on stderr; 128 + N when stopped by signal N (143: SIGTERM).
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    [[ $# -ge 1 ]] && exit 0 || exit 2
fi

flags=(--max-restarts "${MAX_RESTARTS:-0}")
if [[ -n "${NPROC:-}" ]]; then flags+=(--nproc "$NPROC"); fi
if [[ "${CHECK:-1}" == 0 ]]; then flags+=(--no-check); fi
exec "${PYTHON:-python}" -m fedddp.launch "${flags[@]}" "$@"
