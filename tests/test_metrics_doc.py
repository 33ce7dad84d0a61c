"""docs/running.md's "The columns" names every key that metrics.jsonl and clients.jsonl hold: runs of
the rules with diagnostics of their own (sync and async, DP with adaptive clipping, CGW, Krum), two
rounds each, in this process."""

import os
import re

import pytest

from fedrun import REPO, client_rows, metrics, run_here

RUNS = {
    "fedavg_async": ["algorithm.name=fedavg", "run.mode=async"],
    "fedmom": ["algorithm.name=fedmom"],
    "cgw": ["algorithm.name=cgw"],
    "dpfedmom": ["algorithm.name=dpfedmom", "algorithm.params.dp_clip=1.0", "algorithm.params.dp_adaptive_quantile=0.5",
                 "algorithm.params.dp_adaptive_count_noise=1.0"],
    "krum": ["algorithm.name=krum"],
}


def documented() -> set[str]:
    with open(os.path.join(REPO, "docs", "running.md")) as fh:
        text = fh.read()
    section = text[text.index("### The columns"):text.index("A finished run ends with one line")]
    # the keys a table row names in its first cell: | `key` | or | `key`, `key` |
    return {key for cell in re.findall(r"^\| ([^|]+) \|", section, re.M) for key in re.findall(r"`([a-z_]+)`", cell)}


@pytest.mark.e2e
def test_every_key_of_metrics_and_clients_is_documented(tmp_path):
    keys = set()
    for name, args in RUNS.items():
        out = tmp_path / name
        run_here(args + ["run.rounds=2", "run.eval_every=1", "run.progress=false", f"run.out_dir={out}"])
        keys |= {k for row in metrics(out) for k in row} | {k for row in client_rows(out) for k in row}
    assert {"staleness_mean", "cgw_x", "epsilon", "unclipped_fraction_noised", "krum_score"} <= keys
    assert keys - documented() == set()
