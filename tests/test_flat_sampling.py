"""Flat vectors round-trip; sampling and ownership are pure functions of (seed, round, client)."""

import torch

from fedddp import sampling
from fedddp.flat import FlatLayout
from fedddp.models import cnn, resnet18


def test_flatten_unflatten_roundtrip_with_buffers():
    torch.manual_seed(0)
    model = resnet18((3, 32, 32), 10)
    model(torch.randn(2, 3, 32, 32))  # moves BN running stats and num_batches_tracked
    layout = FlatLayout(model, buffers=True)
    flat = layout.flatten(model).clone()
    other = resnet18((3, 32, 32), 10)
    layout.unflatten_into(flat, other)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    state = layout.state_dict(flat)
    assert state["features.bn1.num_batches_tracked"].dtype == torch.int64
    assert state.keys() == model.state_dict().keys()


def test_conv_groups_follow_previous_conv():
    layout = FlatLayout(cnn((1, 28, 28), 10))
    group = layout.conv_group_P()
    names = [e.name for e in layout.entries]
    assert names[:2] == ["features.0.weight", "features.0.bias"]
    first_fc = layout.entries[4]  # features.7 Linear after the second conv
    assert group[0] == 0 and group[layout.entries[1].offset] == 0
    assert group[layout.entries[2].offset] == 1 and group[first_fc.offset] == 1 and group[-1] == 1
    assert len(layout.conv_entries()) == 2


def test_conv_runs_cover_the_layout_in_order_and_expand_to_the_groups():
    for net in (cnn((1, 28, 28), 10), resnet18((3, 32, 32), 100)):
        layout = FlatLayout(net)
        runs_R3, group_P = layout.conv_runs_R3(), layout.conv_group_P()
        assert runs_R3[0, 0] == 0 and runs_R3[-1, 1] == layout.numel
        assert torch.equal(runs_R3[1:, 0], runs_R3[:-1, 1])              # contiguous
        assert (runs_R3[1:, 2] != runs_R3[:-1, 2]).all()                 # maximal
        expanded_P = torch.repeat_interleave(runs_R3[:, 2], runs_R3[:, 1] - runs_R3[:, 0])
        assert torch.equal(expanded_P, group_P)


def test_grads_flatten_zero_for_buffers():
    model = resnet18((3, 32, 32), 10)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    layout = FlatLayout(model)
    g = layout.flatten_grads(model)
    buf = [e for e in layout.entries if not e.is_param][0]
    assert g[buf.offset:buf.offset + buf.numel].abs().sum() == 0
    assert g.abs().sum() > 0


def test_sampling_is_seeded_and_sorted():
    a = sampling.sample_clients(100, 10, seed=1, round_idx=3)
    assert a == sampling.sample_clients(100, 10, seed=1, round_idx=3)
    assert a == sorted(a) and len(set(a)) == 10
    assert a != sampling.sample_clients(100, 10, seed=1, round_idx=4)
    assert sampling.sample_clients(5, 5, 0, 1) == [0, 1, 2, 3, 4]


def test_row_layout_orders_by_client_id():
    sampled = [1, 2, 4, 7, 8]
    rows_per_rank, order = sampling.layout_rows(sampled, world_size=3)
    # rank 0 owns none but padding, rank 1 owns 1, 4, 7; rank 2 owns 2, 8
    assert rows_per_rank == 3
    assert order == [3, 6, 4, 5, 7]
    assert list(sampling.owned_clients(7, 1, 3)) == [1, 4]


def test_client_seeds_differ():
    seeds = {sampling.client_seed(0, r, c) for r in range(1, 4) for c in range(10)}
    assert len(seeds) == 30


def test_grads_into_a_reused_buffer_overwrite_every_element():
    """Report rows are reused across rounds: a gradient written into one must not leave the old
    contents where buffers (which have no gradient) sit."""
    model = resnet18((3, 32, 32), 10)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    layout = FlatLayout(model)
    out = torch.full((layout.numel,), float("nan"))
    layout.flatten_grads(model, out=out)
    assert not out.isnan().any()
    assert torch.equal(out, layout.flatten_grads(model))
