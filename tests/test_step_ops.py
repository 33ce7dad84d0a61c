"""A side-by-side step dispatches the ops its math needs, and no more than 1.25x those of the
plain step (the batch gathered, ``vmap(grad(loss))``, the rule's direction and the optimizer as
``torch._foreach_*`` ops): counted with torch.profiler on CPU (bench/step_ops.py), where each op
is what would be a kernel launch on a GPU. A count, never a time. And no step reads a tensor's
value on the host (``.item()``, ``float()``, ``bool()``, ``.tolist()``, ``nonzero``): on a GPU each
such read waits for the device."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import step_ops  # noqa: E402

# Every case meets the goal; Dropout since its masks are a counter-based draw for the whole
# group (models/dropout.py), where each client's own seeded generator took 5 ops a client and layer.
MET = list(step_ops.CASES)


@pytest.mark.parametrize("case", MET)
def test_a_step_dispatches_at_most_a_quarter_more_ops_than_its_math(case):
    row = step_ops.measure(case, 10, "cpu")
    assert row["fedddp"] <= 1.25 * row["plain"], (row["fedddp_ops"], row["plain_ops"])
    # the group's batch index is built once on the host: no op of it runs in a step
    assert not {"aten::randperm", "aten::repeat_interleave", "aten::cumsum"} & set(row["fedddp_ops"])


@pytest.mark.parametrize("case", ["sgd", "dropout", "batchnorm"])
def test_a_bf16_step_casts_each_tensor_once(case):
    """train.precision = bf16 side by side casts each tensor once a step (client/precision.py):
    every client's parameters down in one foreach copy and their gradients up in another, the
    batch down and the logits up (and that cast's backward) once; BatchNorm's input and output
    (each way); a dropout mask. No cast per convolution or linear call (autocast under vmap casts
    a weight at each use, inside the layer's op), and its ops at most 1.25x the plain step with
    the casts its math needs (one a tensor)."""
    row = step_ops.measure(case, 10, "cpu", "bf16")
    ops = row["fedddp_ops"]
    batch_norm_casts = 4 if case == "batchnorm" else 0  # one BatchNorm layer: 2 casts forward, 2 backward
    dropout_casts = 1 if case == "dropout" else 0  # the mask of the one dropout layer
    assert ops["aten::_foreach_copy_"] == 2, ops
    assert ops["aten::to"] + ops["aten::_to_copy"] == 3 + batch_norm_casts + dropout_casts, ops
    assert row["casts"] <= row["plain_casts"], (ops, row["plain_ops"])
    assert row["fedddp"] <= 1.25 * row["plain"], (ops, row["plain_ops"])


@pytest.mark.parametrize("per_step", [False, True], ids=["masks once a group", "masks each step"])
def test_dropouts_masks_do_not_grow_with_the_clients(monkeypatch, per_step):
    """A group's dropout masks, every client's and step's, are one draw a layer (no op of them in
    a step); a group too large for that (GROUP_DROPOUT_BYTES) draws each step's, still one draw a
    layer for all its clients: no op of a step grows with the clients."""
    from fedddp.client import batched

    if per_step:
        monkeypatch.setattr(batched, "GROUP_DROPOUT_BYTES", 0)
    rows = {k: step_ops.measure("dropout", k, "cpu") for k in (4, 8)}
    grown = {name: rows[8]["fedddp_ops"][name] - rows[4]["fedddp_ops"][name] for name in rows[8]["fedddp_ops"]}
    assert not any(grown.values()), grown
    masks_a_step = rows[4]["fedddp"] - step_ops.measure("sgd", 4, "cpu")["fedddp"]
    assert (masks_a_step > 10) is per_step, masks_a_step  # the hash's ops, where a step draws its masks


# Tensor calls that copy a value to the host (a device sync on a GPU)
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
              torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
              torch.Tensor.numpy}


class _HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in HOST_READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["sgd", "adam", "fedprox", "scaffold", "batchnorm"])
def test_no_step_reads_a_value_on_the_host(case):
    """The host reads of a group do not grow with its steps (those of its reports, after the
    last step, do not count)."""
    reads = {}
    for steps in (2, 6):
        once = step_ops.fedddp_step(case, 4, torch.device("cpu"), steps)
        once()
        with _HostReads() as mode:
            once()
        reads[steps] = mode.count
    assert reads[6] == reads[2], reads


@pytest.mark.e2e
def test_a_rounds_host_reads_do_not_grow_with_its_clients(tmp_path):
    """A round side by side reads values on the host a fixed number of times (its losses and
    checks once), not once a client: two rounds of 10 and of 30 clients, each one group."""
    from fedrun import run_here

    reads = {}
    for clients in (10, 30):
        with _HostReads() as mode:
            run_here([f"run.out_dir={tmp_path / str(clients)}", "run.rounds=2", f"data.num_clients={clients}",
                      f"run.clients_per_round={clients}", f"run.parallel_clients={clients}", "run.eval_every=100",
                      "run.ckpt_every=0"])
        reads[clients] = mode.count
    assert reads[30] == reads[10], reads
