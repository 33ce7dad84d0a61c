"""A round's bookkeeping reads the device a fixed, small number of times, whatever the number of
clients: the round's scalars go to the report rows in one copy (ReportLayout.pack_round), and its
checks, losses and client columns come back in one read (server.read_once).
bench/bookkeeping.py counts the reads (a TorchFunctionMode: the CPU twin of a GPU sync)."""

import os
import sys

import pytest
import torch

from fedddp.report import SCALAR_FIELDS, VECTOR_FIELDS, ReportLayout
from fedddp.server import read_once

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import bookkeeping  # noqa: E402

# the round's one read (server.read_once); a second would be a read that crept back
READS_A_ROUND = 1


@pytest.mark.e2e
def test_a_rounds_host_reads_do_not_grow_with_its_clients(tmp_path):
    """10 and 100 clients a round, one after another (B = 1) and all side by side (B = clients):
    every steady round reads the device READS_A_ROUND times outside training and evaluation."""
    reads = {}
    for clients in (10, 100):
        for parallel in (1, clients):
            _, args = bookkeeping.workload(str(tmp_path / "no data"), clients, parallel, 3, "cpu")
            with bookkeeping.counted_rounds() as mode:
                bookkeeping.run_here(args + [f"run.out_dir={tmp_path / f'{clients}_{parallel}'}"])
            reads[clients, parallel] = [count for count, _ in bookkeeping.per_round(mode.per_round)]
    assert all(len(rounds) == 2 for rounds in reads.values()), reads
    assert all(rounds == [READS_A_ROUND] * 2 for rounds in reads.values()), reads


def test_the_counter_sees_a_read():
    """The count can fail: a read per client is counted per client, paused spans are not."""
    values_K = torch.arange(5.0)
    with bookkeeping.HostReads() as mode:
        for v in values_K:
            float(v)
        with mode.pause():
            values_K.tolist()
        torch.tensor([1.0], device="cpu")
    assert mode.count == len(values_K) + 1


def test_one_read_gives_what_item_and_tolist_give():
    """float32 and float64, 0-d, one element, [K] and [K, L]: the values and nesting of
    ``.item()`` (logs.to_json's, for a one-element tensor) and ``.tolist()`` (``as_lists``)."""
    gen = torch.Generator().manual_seed(0)
    parts = {"loss": torch.randn((), generator=gen, dtype=torch.float64), "one": torch.randn(1, generator=gen),
             "single_K": torch.randn(1, generator=gen), "loss_K": torch.randn(7, generator=gen),
             "rank_KL": torch.randn(7, 3, generator=gen), "empty_K": torch.zeros(0),
             "count": torch.tensor(3), "host": None, "number": 2.5}
    got = read_once(parts, torch.device("cpu"), as_lists={"single_K", "loss_K", "rank_KL", "empty_K"})
    assert got["loss"] == parts["loss"].item() and got["one"] == parts["one"].item()
    for key in ("single_K", "loss_K", "rank_KL", "empty_K"):
        assert got[key] == parts[key].tolist(), key
    assert got["count"] is parts["count"] and got["host"] is None and got["number"] == 2.5


def test_a_rounds_scalars_pack_as_each_clients_did():
    """pack_round over clients in any row order, with a row left out (a straggler's), writes
    each client's scalars as pack_scalars writes them, and no other row."""
    needs = frozenset({"params_KP"} | {s for s, _ in VECTOR_FIELDS} | {s for s, _ in SCALAR_FIELDS} | {"eff_rank_KL"})
    layout = ReportLayout(needs, 10, num_layers=3)
    gen = torch.Generator().manual_seed(1)

    def report(i: int) -> dict:
        return {"num_samples": torch.tensor(float(10 + i)),
                "train_loss": torch.rand((), generator=gen, dtype=torch.float64),
                "train_time": 1 / (3 + i), "num_steps": torch.tensor(4.0 + i),
                "full_loss": torch.rand((), generator=gen, dtype=torch.float64),
                "eff_rank_L": torch.rand(3, generator=gen, dtype=torch.float64)}

    for rows in ([0, 1, 2, 3], [3, 0, 2, 1], [4, 0, 2]):
        reports = [report(i) for i in range(len(rows))]
        want = torch.full((5, layout.width), -1.0)
        for row, rep in zip(rows, reports):
            layout.pack_scalars(want[row], rep)
        got = torch.full((5, layout.width), -1.0)
        layout.pack_round(got, rows, reports)
        assert torch.equal(got, want), rows
