"""The fused column sorts of FedMedian and FedTrimmedAvg (kernels.c's fd_sorted_mean and
triton_kernels.py's _sorted_mean_kernel, run on CPU through Triton's interpreter) against the
rules' torch form (torch.sort, then the mean kernel over the kept rows) bit for bit, against
the slow twins of tests/test_robust.py, and the cases the sorts must get right: K = 1, 2, 3,
even and odd K, ties, NaN (sorted last, as torch.sort), every trim count from 0 to the most
that leaves one or two rows, strided stacks, and K past the sorts' limit (the torch form).
Legend: K clients, P flat parameters.
"""

from __future__ import annotations

import pytest
import torch

from fedddp.strategies import coordinatewise, kernels
from test_robust import aggregate, assert_close, twin_median, twin_trimmed

CLIENTS = [1, 2, 3, 4, 5, 8, 9, 16, 33]
NUM_PARAMS = 37                # past two register chunks of 16 lanes, the last one partial

needs_compiler = pytest.mark.skipif(kernels.lib(torch.zeros(1)) is None, reason="no working C compiler")


def stack(num_clients, seed, num_params=NUM_PARAMS, ties=False, nan=False):
    """[K, P] reports as a strided view (row stride P + 5, as round.py's gather buffer)."""
    g = torch.Generator().manual_seed(seed)
    rows_KP = torch.randn(num_clients, num_params + 5, generator=g)[:, :num_params]
    if ties:                   # few distinct values: most columns have equal values
        rows_KP = torch.round(rows_KP * 2) / 2
    if nan and num_clients > 2:
        rows_KP[1, ::3] = float("nan")
        rows_KP[num_clients - 1, ::4] = float("nan")
    return rows_KP


def median_rows(num_clients):
    return (num_clients - 1) // 2, num_clients // 2 + 1


def torch_form(rows_KP, lo, hi, median):
    """The rules' torch form with the mean through the C mean kernel (FedAvg's form on CPU)."""
    with kernels.forced("c"):
        if median:
            return coordinatewise.median_C(rows_KP)
        return coordinatewise.uniform_mean_C(torch.sort(rows_KP, dim=0).values[lo:hi])


def same(a_P, b_P):
    """Equal bits, NaN where the other has NaN."""
    return torch.equal(a_P.isnan(), b_P.isnan()) and torch.equal(a_P.nan_to_num(), b_P.nan_to_num())


def check_every_trim(lib, rows_KP):
    num_clients = rows_KP.shape[0]
    lo, hi = median_rows(num_clients)
    assert same(kernels.sorted_mean(lib, rows_KP, lo, hi, True), torch_form(rows_KP, lo, hi, True))
    for trim in range((num_clients + 1) // 2):       # 0 .. the most that leaves 1 or 2 rows
        lo, hi = trim, num_clients - trim
        assert same(kernels.sorted_mean(lib, rows_KP, lo, hi, False), torch_form(rows_KP, lo, hi, False)), trim


@needs_compiler
@pytest.mark.parametrize("num_clients", CLIENTS + [100, kernels.SORT_MAX_CLIENTS])
@pytest.mark.parametrize("data", ["random", "ties", "nan"])
def test_c_kernel_has_the_torch_forms_bits(num_clients, data):
    rows_KP = stack(num_clients, num_clients, ties=data == "ties", nan=data == "nan")
    check_every_trim(kernels.lib(rows_KP), rows_KP)


@needs_compiler
@pytest.mark.parametrize("num_clients", [1, 2, 3, 8, 9, 40])
def test_rules_in_c_match_their_twins_and_torch_form(num_clients, monkeypatch):
    """Through the rules (gathered, blocks of 16 columns): the twins to float32 rounding, and
    FEDDDP_KERNELS=c against the torch ops to the mean kernel's rounding (torch's matrix-vector
    product sums in its own order)."""
    g = torch.Generator().manual_seed(num_clients)
    global_P = torch.randn(NUM_PARAMS, generator=g)
    stacks = {"params_KP": stack(num_clients, num_clients) + global_P, "num_samples_K": torch.ones(num_clients),
              "train_loss_K": torch.ones(num_clients), "aggregation_block": torch.tensor(16)}
    rows = stacks["params_KP"].double().tolist()
    for beta in (0.0, 0.1, 0.2, 0.45):
        monkeypatch.setenv("FEDDDP_KERNELS", "c")
        fused_P = aggregate("fedtrimmedavg", global_P, stacks, trim_beta=beta)[0]
        assert_close(fused_P, twin_trimmed(rows, beta))
        monkeypatch.setenv("FEDDDP_KERNELS", "torch")
        torch.testing.assert_close(fused_P, aggregate("fedtrimmedavg", global_P, stacks, trim_beta=beta)[0])
    monkeypatch.setenv("FEDDDP_KERNELS", "c")
    fused_P = aggregate("fedmedian", global_P, stacks)[0]
    assert_close(fused_P, twin_median(rows))
    monkeypatch.setenv("FEDDDP_KERNELS", "torch")
    assert torch.equal(fused_P, aggregate("fedmedian", global_P, stacks)[0])


@needs_compiler
def test_more_clients_than_the_sort_holds_take_the_torch_form(monkeypatch):
    num_clients = kernels.SORT_MAX_CLIENTS + 1
    global_P = torch.zeros(NUM_PARAMS)
    stacks = {"params_KP": stack(num_clients, 3), "num_samples_K": torch.ones(num_clients),
              "train_loss_K": torch.ones(num_clients)}
    real_sorted_mean = kernels.sorted_mean
    with pytest.raises(ValueError, match="fd_sorted_mean refused"):   # the C kernel checks it too
        real_sorted_mean(kernels.lib(global_P), stacks["params_KP"], 0, num_clients, False)

    def refused(*args):
        raise AssertionError("the kernel was called past SORT_MAX_CLIENTS")

    monkeypatch.setenv("FEDDDP_KERNELS", "c")
    monkeypatch.setattr(kernels, "sorted_mean", refused)
    assert_close(aggregate("fedmedian", global_P, stacks)[0], twin_median(stacks["params_KP"].double().tolist()))
    assert_close(aggregate("fedtrimmedavg", global_P, stacks)[0], twin_trimmed(stacks["params_KP"].double().tolist(), 0.2))


# -- the Triton kernel, interpreted on CPU ----------------------------------------------------------

@pytest.fixture
def interpreted(monkeypatch):
    """triton_kernels defined under Triton's interpreter (test_triton_kernels.py's copy), its
    sort tiles shrunk to 64 elements so that P = 37 crosses several programs at small K."""
    pytest.importorskip("triton")
    from test_triton_kernels import _load_interpreted
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = _load_interpreted()
    monkeypatch.setattr(kernels, "_triton_module", module)
    monkeypatch.setattr(module, "SORT_TILE", 64)
    monkeypatch.setenv("FEDDDP_KERNELS", "triton")
    return module


@needs_compiler
@pytest.mark.parametrize("num_clients", CLIENTS)
@pytest.mark.parametrize("data", ["random", "ties", "nan"])
def test_triton_kernel_has_the_c_kernels_bits(interpreted, num_clients, data):
    rows_KP = stack(num_clients, 100 + num_clients, ties=data == "ties", nan=data == "nan")
    c_lib = kernels.lib(rows_KP)
    lo, hi = median_rows(num_clients)
    assert same(interpreted.sorted_mean(rows_KP, lo, hi, True), kernels.sorted_mean(c_lib, rows_KP, lo, hi, True))
    for trim in range((num_clients + 1) // 2):
        lo, hi = trim, num_clients - trim
        assert same(interpreted.sorted_mean(rows_KP, lo, hi, False),
                    kernels.sorted_mean(c_lib, rows_KP, lo, hi, False)), trim


@pytest.mark.parametrize("num_clients", [1, 2, 7, 8])
def test_rules_through_triton_match_their_twins(interpreted, num_clients):
    global_P = torch.zeros(NUM_PARAMS)
    stacks = {"params_KP": stack(num_clients, 200 + num_clients), "num_samples_K": torch.ones(num_clients),
              "train_loss_K": torch.ones(num_clients), "aggregation_block": torch.tensor(16)}
    assert kernels.lib(stacks["params_KP"], rule="fedmedian") is interpreted
    rows = stacks["params_KP"].double().tolist()
    assert_close(aggregate("fedmedian", global_P, stacks)[0], twin_median(rows))
    for beta in (0.2, 0.45):
        assert_close(aggregate("fedtrimmedavg", global_P, stacks, trim_beta=beta)[0], twin_trimmed(rows, beta))
