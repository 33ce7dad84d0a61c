"""CGW when the clients' gradients nearly cancel, and with a tiny but nonzero gradient.

Near a stationary point on non-IID data the clients' full-batch gradients D_k nearly cancel:
||sum_k D_k|| << ||D_k||. m_k = D_k . sum_j D_j then cancels catastrophically if it is formed
in float32 (a float32 Gram matrix, m = G 1, had 100% error in x at K = 10 and a sum of 1e-3
of the norms; a float32 sum of D is no better at 1e-6). Both forms of the rule are compared
with eq. 29 evaluated here in float64 on the same float32 inputs.
Legend: K sampled clients, P flat parameters, H pairs of opposite rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedddp import strategies
from fedddp.config import AlgorithmConfig
from fedddp.strategies import kernels

NUM_PARAMS = 1_000_000
ALPHA = 0.1
FORMS = ["c", "torch"]


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as runs use by default (and no spinning workers on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def forms():
    """The forms to compare: the fused C kernel where a compiler works, and the torch ops."""
    return FORMS if kernels.lib(torch.zeros(1)) is not None else ["torch"]


def cancelling_gradients_KP(num_clients, num_params, ratio, gen):
    """float32 gradients whose sum has about `ratio` times the norm of one of them: rows in
    exactly opposite pairs (and a triple summing to about 0 when K is odd), shuffled so that
    no float32 running sum cancels a pair by luck, plus a common vector v with K ||v|| = ratio
    ||D_k||. The rows are windows of one random vector (cheap to make, and far from parallel)."""
    num_pairs = (num_clients - num_clients % 2 * 3) // 2
    pool = torch.randn(num_params + num_pairs + 2, generator=gen)
    half_HP = pool.unfold(0, num_params, 1)[:num_pairs]
    rows = [half_HP, -half_HP]
    if num_clients % 2:
        a_P, b_P = pool[-num_params - 1:-1], pool[-num_params:]
        rows.append(torch.stack([a_P, b_P, -(a_P + b_P)]))
    base_KP = torch.cat(rows)
    common_P = torch.randn(num_params, generator=gen)
    common_P *= ratio * math.sqrt(num_params) / (num_clients * common_P.norm())
    order = torch.randperm(num_clients, generator=gen)
    return (base_KP + common_P)[order]


def cgw_float64(grads_KP, loss_K, alpha):
    """x_k and the correction sum_k x_k D_k of eqs. 6, 13, 29 in float64 on the float32 inputs
    (every client nonzero), and ||sum_k D_k|| / mean_k ||D_k||."""
    grads_KP = grads_KP.double()
    total_P = grads_KP.sum(0)
    m_K = grads_KP @ total_P
    norm_K = grads_KP.norm(dim=1)
    c = (alpha * loss_K.double() / norm_K).min()
    x_K = c / (m_K / norm_K).norm() * m_K / norm_K ** 2
    return x_K, x_K @ grads_KP, (total_P.norm() / norm_K.mean()).item()


def relative_error(got, expected):
    return ((got.double() - expected).norm() / expected.norm()).item()


def aggregate(params_KP, grads_KP, loss_K, form):
    num_clients = params_KP.shape[0]
    stacks = {"params_KP": params_KP, "full_grad_KP": grads_KP, "full_loss_K": loss_K,
              "num_samples_K": torch.ones(num_clients), "train_loss_K": loss_K}
    hp = AlgorithmConfig(params={"cgw_alpha": ALPHA})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FEDDDP_KERNELS", form)
        return strategies.get("cgw").aggregate(torch.zeros(params_KP.shape[1]), stacks, {}, hp)


@pytest.mark.parametrize("num_clients", [2, 10, 16, 17, 40])
def test_cgw_is_exact_when_the_gradients_nearly_cancel(num_clients):
    """Regression: with K <= 16, m came from a float32 Gram matrix and x_k was 100% wrong
    (90% of its signs flipped) once ||sum_k D_k|| / ||D_k|| fell to about 3e-3. The params are
    zero, so the new model is minus the correction itself."""
    gen = torch.Generator().manual_seed(num_clients)
    params_KP = torch.zeros(num_clients, NUM_PARAMS)
    loss_K = 0.5 + torch.rand(num_clients, generator=gen)
    for ratio in (1e-3, 1e-6):
        grads_KP = cancelling_gradients_KP(num_clients, NUM_PARAMS, ratio, gen)
        x_ref_K, correction_ref_P, measured = cgw_float64(grads_KP, loss_K, ALPHA)
        assert ratio / 3 < measured < ratio * 3          # the inputs are as hard as intended
        for form in forms():
            model_P, _, diag = aggregate(params_KP, grads_KP, loss_K, form)
            assert relative_error(diag["cgw_x_K"], x_ref_K) <= 1e-4, (ratio, form)
            assert relative_error(model_P, -correction_ref_P) <= 1e-4, (ratio, form)
            assert diag["cgw_zero_grad_clients"].item() == 0


@pytest.mark.parametrize("norm", [1e-20, 1e-22, 1e-30, 1e-40])
def test_cgw_keeps_a_client_with_a_tiny_nonzero_gradient(norm):
    """Regression: ||D_k|| near 1e-20 overflowed x_k in float32 (-inf/NaN in the model), and
    below about 1e-23 ||D_k||^2 underflowed and the client was taken for a zero gradient."""
    gen = torch.Generator().manual_seed(7)
    num_clients, num_params = 4, 5000
    grads_KP = torch.randn(num_clients, num_params, generator=gen)
    grads_KP[1] *= norm / grads_KP[1].norm()
    loss_K = torch.ones(num_clients)
    x_ref_K, correction_ref_P, _ = cgw_float64(grads_KP, loss_K, ALPHA)
    for form in forms():
        model_P, _, diag = aggregate(torch.zeros(num_clients, num_params), grads_KP, loss_K, form)
        assert torch.isfinite(model_P).all() and torch.isfinite(diag["cgw_x_K"]).all()
        assert diag["cgw_zero_grad_clients"].item() == 0 and diag["cgw_x_K"][1] != 0, form
        assert relative_error(diag["cgw_x_K"], x_ref_K) <= 1e-6, form
        assert relative_error(model_P, -correction_ref_P) <= 1e-6, form
