#!/usr/bin/env bash
# One machine, one rank per GPU (2 ranks on a machine without GPUs), through torchrun.
#
#   launch/local.sh CONFIG.toml [section.key=value ...]
#   NPROC=4 MAX_RESTARTS=3 launch/local.sh configs/feder_cifar100.toml run.out_dir=runs/feder
#
# NPROC         ranks to start (default: number of visible GPUs, or 2 without any)
# MAX_RESTARTS  torchrun --max-restarts (default 0). With N > 0, a rank that dies brings the
#               whole group back and the run continues from its last checkpoint
#               (set run.ckpt_every); see docs/launching.md.
# PYTHON        the interpreter whose torch and fedddp to use (default: python)
# CHECK         1 (default): python -m fedddp --check first, 0: skip it (data too big to load twice)
#
# Everything after the config is passed to fedddp untouched. Exit status: fedddp's (0, 2 to 7:
# README.md), with fedddp's line last on stderr; torchrun's otherwise.
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    [[ $# -ge 1 ]] && exit 0 || exit 2
fi

PYTHON=${PYTHON:-python}
# The config and every client's data, checked in one process before any rank starts: a mistake
# is fedddp's one line and its status (2, 3), not torchrun's banner and status 1.
if [[ "${CHECK:-1}" != 0 ]]; then
    "$PYTHON" -m fedddp --check "$@" || exit $?
fi
if [[ -z "${NPROC:-}" ]]; then
    NPROC=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
    [[ "$NPROC" -gt 0 ]] || NPROC=2
fi

# A rank that fails writes "STATUS<TAB>RANK<TAB>LINE" here (torchrun itself only says 1).
FEDDDP_STATUS_FILE=$(mktemp "${TMPDIR:-/tmp}/fedddp-status.XXXXXX")
export FEDDDP_STATUS_FILE
trap 'rm -f "$FEDDDP_STATUS_FILE"' EXIT

# Restarted workers must not meet in the agent's long-lived store, where the previous attempt's
# addresses are still written (pytorch/pytorch#135712): rank 0 hosts a fresh one each attempt.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# torchrun sets OMP_NUM_THREADS=1 for every rank when it is unset, announcing it in a banner that
# opened every run; the same value set here leaves the ranks as they were, without the banner
# (fedddp pins torch's intra-op threads itself: run.num_threads). A value you export is kept.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
    --max-restarts="${MAX_RESTARTS:-0}" -m fedddp "$@" &
TORCHRUN=$!
trap 'kill -TERM "$TORCHRUN" 2>/dev/null || true' TERM INT HUP  # torchrun stops its ranks
status=0
wait "$TORCHRUN" || status=$?
while kill -0 "$TORCHRUN" 2>/dev/null; do  # a trapped signal interrupted wait: wait for the end
    status=0
    wait "$TORCHRUN" || status=$?
done
if [[ $status -ne 0 && -s "$FEDDDP_STATUS_FILE" ]]; then
    IFS=$'\t' read -r code rank line < <(sort -t$'\t' -k2,2n "$FEDDDP_STATUS_FILE" | head -n 1)
    echo "$line" >&2
    exit "$code"
fi
exit "$status"
