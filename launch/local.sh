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
#
# Everything after the config is passed to fedddp untouched. Exit status: torchrun's.
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    [[ $# -ge 1 ]] && exit 0 || exit 2
fi

PYTHON=${PYTHON:-python}
if [[ -z "${NPROC:-}" ]]; then
    NPROC=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
    [[ "$NPROC" -gt 0 ]] || NPROC=2
fi

# Restarted workers must not meet in the agent's long-lived store, where the previous attempt's
# addresses are still written (pytorch/pytorch#135712): rank 0 hosts a fresh one each attempt.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
    --max-restarts="${MAX_RESTARTS:-0}" -m fedddp "$@"
