#!/usr/bin/env bash
# Every figure of BENCHMARKS.md that needs a GPU, in one run on a CUDA machine, so that a short
# lease of one is spent measuring: the CUDA-only tests, the server rules' throughput (Triton
# kernels beside the torch ops, ResNet-18, K = 32 and 64), clients side by side (CNN, FFNN,
# ResNet-18), fedddp's round against a bare PyTorch loop, configs/mnist_cnn.toml with 100
# clients at B = 1 and B = 100, and pfl-research's CIFAR10 benchmark (and FLUTE's FEMNIST shape)
# run by fedddp at B = 1 and B = 50 and by pfl, alternating (bench/peers/pfl_cifar10.py, 30
# rounds x 2 repeats, about 2 minutes). Each step's output goes to $OUT/NAME.log (default
# gpu_out/); a failing step is reported and the next one runs. Eight files in all, the most a
# lease returns from $OUT. Not in the default list: STEPS=aggregation_scale, gathered against
# sharded aggregation on one GPU (bench/aggregation_scale.py; NCCL needs one GPU per rank).
#
#   bash bench/gpu_session.sh [DATA_ROOT [WHEELS]]
#
# DATA_ROOT holds MNIST/raw/ (the t10k files are enough); default ../shared/data; with
# cifar-10-batches-py/ in it the peer step reads real CIFAR10, else it draws synthetic arrays of
# the same shapes (its log says which). WHEELS: a folder of wheels for what the machine lacks
# (tensorly, submitit, adamp, rmsgd; for the peer step pfl 0.6.0 and its dp-accounting, dm-tree,
# multiprocess, dill, prv-accountant), installed into a scratch site folder first; default
# .gpu/whl when it exists. Without pfl the peer step runs fedddp's side and says so. To take both along to a machine
# that gets only the checkout: mkdir -p .gpu/whl .gpu/data/MNIST/raw, copy the MNIST files and
# the wheels there, add /.gpu/ to .git/info/exclude and carry .gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
root=${1:-../shared/data}
wheels=${2:-.gpu/whl}
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export FEDDDP_VERBOSE=1  # the start lines' long form: the B auto picked, the aggregation's form
if [ -d "$wheels" ] && ls "$wheels"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/fedddp_site "$wheels"/*.whl || exit 1
    export PYTHONPATH=/tmp/fedddp_site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

# STEPS: the steps to run, in this order (default all); each has a time limit, and a step whose
# limit would end past DEADLINE seconds (default 480: 8 minutes) is skipped and said so, so one call of a
# 10-minute device lease comes back with what it measured.
steps=${STEPS:-"device cuda_tests gpu_checks aggregate parallel_clients round_vs_loop mnist_cnn peers"}
deadline=${DEADLINE:-480}

step() {  # step NAME LIMIT COMMAND...: run it if asked for and in time, keep its output, say how it ended
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    case " $steps " in *" $name "*) ;; *) return ;; esac
    if [ $((SECONDS + limit)) -gt "$deadline" ]; then
        echo "== $name: skipped (its ${limit} s would end past ${deadline} s)"
        return
    fi
    echo "== $name: $*"
    timeout "$limit" "$@" >>"$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    echo "== $name: exit $rc in $((SECONDS - start)) s"
}

# the device, then the ops a side-by-side step dispatches on it (each a launch) against the plain
# step's (bench/step_ops.py), in one log: a lease returns at most 8 files
step device 90 bash -c "python3 -c \"import torch, triton; print(torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**20, 'MiB')\" \
    && python3 bench/step_ops.py --device cuda --clients 10 \
    && python3 bench/step_ops.py --device cuda --clients 100 --cases sgd,adam,batchnorm"
step cuda_tests 240 python3 -m pytest -q -p no:cacheprovider -o addopts=-ra tests/test_triton_kernels.py \
    tests/test_strategies.py tests/test_spawn_guard.py tests/test_shared_gpu.py -k "cuda or guard"
step gpu_checks 180 python3 bench/gpu_checks.py --device cuda
step aggregate 120 python3 bench/aggregate.py --device cuda --models resnet18-c100 --counts 32,64 --no-naive
step aggregation_scale 120 python3 bench/aggregation_scale.py --device cuda --ranks 1 --clients 8 32 64
step parallel_clients 180 python3 bench/parallel_clients.py --device cuda
# not in the default list (its time would push the later steps past DEADLINE): STEPS=parallel_clients_fast,
# the side-by-side step compiled (run.compile: the whole step, one CUDA graph; its table adds the eager
# side-by-side rate, compiled / eager and the compile time; the ops outside the graph counted first) and in
# bf16 (train.precision: parameters cast in one foreach copy a step, convolutions channels-last; its casts
# counted on CUDA first), CNN and ResNet-18
step parallel_clients_fast 300 bash -c "python3 bench/step_ops.py --device cuda --clients 100 --cases sgd,adam,batchnorm \
    --compile; python3 bench/parallel_clients.py --device cuda --models cnn,resnet18 \
    --clients 10,100 --compile; python3 bench/step_ops.py --device cuda --clients 100 --cases sgd,batchnorm \
    --precision bf16; python3 bench/parallel_clients.py --device cuda --models cnn,resnet18 \
    --clients 10,100 --precision bf16"
step round_vs_loop 120 python3 bench/round_vs_loop.py --data-root "$root"
for B in 1 100 auto; do  # auto: the B run.parallel_clients=auto picks from free memory (its start line says); the runs' folders stay out of $OUT (a lease returns few files); their metrics join the log
    runs=/tmp/fedddp_gpu_runs/mnist_cnn_B$B
    step mnist_cnn 90 python3 -m fedddp configs/mnist_cnn.toml "data.root=$root" run.device=cuda \
        data.num_clients=100 run.clients_per_round=100 run.rounds=3 run.ckpt_every=0 \
        "run.parallel_clients=$B" "run.out_dir=$runs" run.overwrite=true
    cat "$runs/metrics.jsonl" >>"$out/mnist_cnn.log" 2>/dev/null
done
# the same workload's bookkeeping at B = 100: ms a round outside training and evaluation, host reads
# and the syncs CUDA reports (bench/bookkeeping.py); into mnist_cnn.log (a step of that name)
step mnist_cnn 90 python3 bench/bookkeeping.py --device cuda --data-root "$root" --parallel 100
# not in the default list: STEPS=mnist_cnn_compile, the same at B = 100 with run.compile (the whole step
# compiled and captured as a CUDA graph in the warm-up before round 1: its metrics' first round_s against the
# steady ones; --verbose: the start line's long form, with the compiled step's time against the eager one's)
runs=/tmp/fedddp_gpu_runs/mnist_cnn_compile
step mnist_cnn_compile 150 python3 -m fedddp --verbose configs/mnist_cnn.toml "data.root=$root" run.device=cuda \
    data.num_clients=100 run.clients_per_round=100 run.rounds=3 run.ckpt_every=0 run.parallel_clients=100 \
    run.compile=true "run.out_dir=$runs" run.overwrite=true
cat "$runs/metrics.jsonl" >>"$out/mnist_cnn_compile.log" 2>/dev/null
# --start-phases: each framework's time before round 1 in the table ("start s") and its median in the
# summary, fedddp's beside pfl's, with fedddp's phases (data, model, checks, warm-up, ...) under each run
step peers 200 python3 bench/peers/pfl_cifar10.py --device cuda --rounds 30 --reps 2 --parallel-clients 1,50 \
    --data-root "$root" --start-phases
