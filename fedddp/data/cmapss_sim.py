"""A simulated turbofan set in NASA's CMAPSS file format: the regression task of the reduced
seed-004 reproduction where NASA's CMAPSSData.zip is not at hand.

    python -m fedddp.data.cmapss_sim DIR [--train-engines 100] [--test-engines 100] [--seed 0]

writes DIR/CMAPSS/{train,test,RUL}_FD001.txt, read by ``data.name = "cmapss"`` with
``data.root = DIR``. Deterministic: the same arguments write the same bytes.

Provenance: NOT NASA's data. Each engine's 21 sensors are a fixed level like FD001's, plus a
per-engine offset (manufacturing variation, as CMAPSS's unknown initial wear), plus a drift that
grows as (t / T)^q towards failure at cycle T with a per-engine exponent q in [1.5, 2.5], plus
Gaussian noise; the levels, drifts and noise scales are read off FD001's ranges and the sensors
FD001 keeps constant stay constant. Lifetimes are drawn uniformly from FD001's range, 128 to 362
cycles; a test engine's series stops uniformly between 10% and 90% of its life and its RUL is
the rest. It is a smooth, noisy degradation to regress from 14 sensors, which is what the
comparison of server rules needs; the paper's absolute errors on the real engines do not carry over.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from ..atomic import atomic_write_text

SUBSET = "FD001"
# Levels like FD001's, their drift towards failure, and their noise (s1, s5, s6, s10, s16, s18,
# s19 are constant, as in FD001).
LEVEL_21 = np.array([518.67, 642.0, 1589.0, 1400.0, 14.62, 21.61, 554.0, 2388.0, 9046.0, 1.3, 47.5,
                     521.7, 2388.0, 8138.0, 8.42, 0.03, 392.0, 2388.0, 100.0, 39.0, 23.4])
DRIFT_21 = np.array([0, 1.5, 12, 20, 0, 0, -2.5, 0.2, 15, 0, 0.8, -2, 0.2, 10, 0.1, 0, 4, 0, 0, -0.6, -0.35])
NOISE_21 = np.array([0, .5, 6, 9, 0, 0, .9, .07, 20, 0, .27, .7, .07, 19, .04, 0, 1.5, 0, 0, .18, .1])
LIFE_MIN, LIFE_MAX = 128, 362  # FD001's shortest and longest training engine


def engine_lines(unit: int, life: int, stop: int, rng: np.random.Generator) -> list[str]:
    """Rows 1..stop of one engine that fails at cycle ``life``, as NASA writes them."""
    offset_21 = NOISE_21 * rng.normal(0.0, 1.0, 21)
    exponent = rng.uniform(1.5, 2.5)
    cycles_N = np.arange(1, stop + 1)
    sensors_N21 = (LEVEL_21 + offset_21 + DRIFT_21 * (cycles_N[:, None] / life) ** exponent
                   + NOISE_21 * rng.standard_normal((stop, 21)))
    settings_N2 = np.stack([rng.normal(0, 0.002, stop), rng.normal(0, 0.0003, stop)], axis=1)
    return [f"{unit} {c} {s[0]:.4f} {s[1]:.4f} 100.0 " + " ".join(f"{v:.4f}" for v in row) + "  "
            for c, s, row in zip(cycles_N, settings_N2, sensors_N21)]


def write(root: str, train_engines: int = 100, test_engines: int = 100, seed: int = 0) -> str:
    """Write the three files under ROOT/CMAPSS (atomically, each); returns that folder."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "CMAPSS")
    os.makedirs(folder, exist_ok=True)
    train = [line for u in range(1, train_engines + 1)
             for life in [int(rng.integers(LIFE_MIN, LIFE_MAX + 1))]
             for line in engine_lines(u, life, life, rng)]
    test, rul = [], []
    for u in range(1, test_engines + 1):
        life = int(rng.integers(LIFE_MIN, LIFE_MAX + 1))
        stop = int(rng.integers(int(0.1 * life), int(0.9 * life) + 1))
        test += engine_lines(u, life, stop, rng)
        rul.append(f"{life - stop}")
    for kind, lines in (("train", train), ("test", test), ("RUL", rul)):
        atomic_write_text("\n".join(lines) + "\n", os.path.join(folder, f"{kind}_{SUBSET}.txt"))
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedddp.data.cmapss_sim", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("root", help="data root: the files go to ROOT/CMAPSS/")
    parser.add_argument("--train-engines", type=int, default=100)
    parser.add_argument("--test-engines", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.train_engines < 1 or args.test_engines < 1:
        print("fedddp.data.cmapss_sim: error: --train-engines and --test-engines must be >= 1", file=sys.stderr)
        return 2
    try:
        folder = write(args.root, args.train_engines, args.test_engines, args.seed)
    except OSError as exc:
        print(f"fedddp.data.cmapss_sim: error: {args.root}: cannot write ({exc.strerror or exc})", file=sys.stderr)
        return 2
    print(f"fedddp.data.cmapss_sim: simulated {SUBSET} files in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
