"""Bitwise digests of final.pt over a fixed set of configurations.

Restructuring the runtime must not move a single bit of a run's result. This script runs every
server rule, every local rule, side by side, 1 and 2 ranks, a plugin and a resume for a few rounds,
hashes each final model, and compares the hashes with the ones stored in tests/digests.json:

    python tests/digests.py            # compare with the stored digests (exit 1 on a change)
    python tests/digests.py --record   # store the digests of the current code
    python tests/digests.py --record NAME ...   # store those configurations' digests, keep the others

Bits of torch's CPU ops depend on the processor and the torch build, so the stored file names the
machine it was recorded on (torch version, CPU model and flags) and the check says when it runs
elsewhere. The server rules' form is pinned (FEDDDP_KERNELS=c): the form probe on first use may
otherwise choose another form on a loaded machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
STORE = os.path.join(HERE, "digests.json")
QUICKSTART = os.path.join(REPO, "configs", "quickstart.toml")
PLUGIN = os.path.join(REPO, "examples", "my_plugin.toml")

BASE = ["run.rounds=3", "run.eval_every=3", "run.ckpt_every=0"]
# the plugin's 8x8 images and SmallCNN (one conv layer): image rules (FedER) and CNNs side by side
CNN = ["data.name=examples.my_plugin:blobs", "data.num_clients=12", "data.partition=natural",
       "model.name=examples.my_plugin:SmallCNN", "run.clients_per_round=6", "train.batch_size=16",
       "train.lr=0.05"]

# name -> (ranks, config file, overrides)
CONFIGS: dict[str, tuple[int, str, list[str]]] = {
    "fedavg": (1, QUICKSTART, ["algorithm.name=fedavg"]),
    "fedavg-2ranks": (2, QUICKSTART, ["algorithm.name=fedavg"]),
    "fedmom": (1, QUICKSTART, ["algorithm.name=fedmom"]),
    "fedcong": (1, QUICKSTART, ["algorithm.name=fedcong"]),
    "fedgma": (1, QUICKSTART, ["algorithm.name=fedgma", "algorithm.server_lr=0.5"]),
    "cgw": (1, QUICKSTART, ["algorithm.name=cgw"]),
    "feder": (1, QUICKSTART, CNN + ["algorithm.name=feder"]),
    "fedprox": (1, QUICKSTART, ["algorithm.name=fedprox"]),
    "scaffold": (1, QUICKSTART, ["algorithm.name=scaffold"]),
    "scaffold-2ranks": (2, QUICKSTART, ["algorithm.name=scaffold"]),
    "fednova": (1, QUICKSTART, ["algorithm.name=fednova", "train.momentum=0.5"]),
    "moon": (1, QUICKSTART, CNN + ["algorithm.name=moon"]),
    "fedsam": (1, QUICKSTART, ["algorithm.name=fedsam"]),
    "fedgam": (1, QUICKSTART, ["algorithm.name=fedgam"]),
    "fedgam_cv": (1, QUICKSTART, ["algorithm.name=fedgam_cv"]),
    "fedsmoo": (1, QUICKSTART, ["algorithm.name=fedsmoo"]),
    # Poisson sampling (run.sampling = auto is poisson for DP-FedAvg) since it matches the accountant
    "dpfedavg": (1, QUICKSTART, ["algorithm.name=dpfedavg", "algorithm.dp_clip=1.0", "algorithm.dp_noise=0.5"]),
    # the fixed-size sampling DP-FedAvg had before: the bits "dpfedavg" had then
    "dpfedavg-fixed": (1, QUICKSTART, ["algorithm.name=dpfedavg", "algorithm.dp_clip=1.0", "algorithm.dp_noise=0.5",
                                       "run.sampling=fixed", "algorithm.params.dp_accountant=rdp"]),
    "dpfedmom-adaptive-cohort": (1, QUICKSTART, ["algorithm.name=dpfedmom", "algorithm.dp_clip=1.0",
                                                 "algorithm.dp_noise=0.5", "algorithm.params.dp_adaptive_quantile=0.5",
                                                 "algorithm.params.dp_noise_cohort=20"]),
    "adam-steplr": (1, QUICKSTART, ["train.optimizer=adam", "train.lr=0.001", "train.lr_schedule=steplr"]),
    "participation": (1, QUICKSTART, ["run.dropout=0.2", "train.local_work_min=1", "train.local_epochs=3",
                                      "run.deadline_steps=20"]),
    "parallel-b3": (1, QUICKSTART, ["run.parallel_clients=3"]),
    "parallel-b3-2ranks": (2, QUICKSTART, ["run.parallel_clients=3", "algorithm.name=scaffold"]),
    "parallel-b3-cnn-sam": (1, QUICKSTART, CNN + ["run.parallel_clients=3", "algorithm.name=fedsam"]),
    "plugin": (1, PLUGIN, []),
    "plugin-2ranks": (2, PLUGIN, []),
    "resume": (1, QUICKSTART, ["algorithm.name=fedmom", "run.rounds=4", "run.ckpt_every=2"]),
}


def machine() -> dict:
    import torch
    cpu = ""
    try:
        with open("/proc/cpuinfo") as fh:
            info = fh.read()
        cpu = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        flags = next(line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags"))
        cpu += " | " + " ".join(sorted(f for f in flags if f.startswith(("avx", "fma", "sse4"))))
    except (OSError, StopIteration):
        cpu = platform.processor()
    return {"torch": torch.__version__, "cpu": cpu}


def digest_state(path: str) -> str:
    """sha256 over the tensors of a state_dict in key order: name, dtype, shape and bytes."""
    import torch
    state = torch.load(path, weights_only=True)
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _launch(ranks: int, config: str, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "fedddp"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m", "fedddp"]
    env = dict(os.environ, OMP_NUM_THREADS="1", FEDDDP_KERNELS="c")
    proc = subprocess.run(cmd + [config, "run.progress=false"] + args, capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd + [config] + args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def run_one(name: str, folder: str) -> str:
    ranks, config, overrides = CONFIGS[name]
    out = os.path.join(folder, name)
    args = BASE + overrides + [f"run.out_dir={out}"]
    if name == "resume":  # stop cleanly after round 2's checkpoint, then continue from it
        _launch(ranks, config, args + ["run.stop_after=2"])
        args = args + ["run.resume=true"]
    _launch(ranks, config, args)
    return digest_state(os.path.join(out, "final.pt"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="store the current code's digests")
    parser.add_argument("names", nargs="*", help="only these configurations (default: all)")
    args = parser.parse_args(argv)
    names = args.names or list(CONFIGS)
    with tempfile.TemporaryDirectory() as folder:
        digests = {name: run_one(name, folder) for name in names}
    here = machine()
    if args.record:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
        if args.names:  # the named ones only: the others keep their stored digests
            with open(STORE) as fh:
                digests = {**json.load(fh)["digests"], **digests}
        stored = {"commit": git.stdout.strip(), "machine": here, "digests": digests}
        with open(STORE, "w") as fh:
            json.dump(stored, fh, indent=1, sort_keys=True)
            fh.write("\n")
        print(f"recorded {len(digests)} digests in {STORE}")
        return 0
    with open(STORE) as fh:
        stored = json.load(fh)
    if stored["machine"] != here:
        print(f"note: digests recorded on {stored['machine']}, this is {here}: torch's CPU ops may round "
              "differently here", file=sys.stderr)
    changed = [n for n in names if stored["digests"].get(n) != digests[n]]
    for n in names:
        print(f"{n:22s} {'same' if n not in changed else 'CHANGED'}")
    print(f"{len(names) - len(changed)} same, {len(changed)} changed (stored at {stored['commit']})")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
