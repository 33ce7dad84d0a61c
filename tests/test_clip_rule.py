"""The built-in local rule clip (fedddp/client/clip.py), docs/extending.md's worked example of a
local rule: its slow twin, a loop written from the rule's equation

    w <- w - lr g min(1, max_norm / (||g|| + 1e-6)),   g the minibatch gradient at w

on test_local_rules' hand-written MLP (plain tensors and autograd, no fedddp code), against
train_client's steps; torch's clip_grad_norm_ bit for bit on one step; a max_norm no gradient
reaches is plain SGD bit for bit; side by side equal to one after another; its parameter checked."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from fedddp import checks
from fedddp.client import ClientContext, rules
from fedddp.errors import ConfigError

from test_local_rules import close, make_client, run_client, twin_grad, twin_shapes
from test_parallel_clients import SYNTHETIC, assert_close, final_P

LR, STEPS = 0.1, 3  # make_client's learning rate; full-batch steps


def twin_steps(w_P, data, max_norm: float, steps: int):
    """The rule's equation, step by step: the gradient's L2 norm summed in Python floats (float64)
    over every element, the clip factor as a Python float. Returns the weights and how many steps
    were clipped."""
    clipped = 0
    for _ in range(steps):
        grad = twin_grad(w_P, data.x, data.y, twin_shapes())
        norm = math.sqrt(sum(v * v for v in grad.double().tolist()))
        factor = min(1.0, max_norm / (norm + 1e-6))
        clipped += factor < 1.0
        w_P = w_P - LR * factor * grad
    return w_P, clipped


def test_clip_twin():
    """Clipped steps (max_norm below every step's gradient norm) are the equation's; plain steps
    would differ, so the comparison can fail."""
    cfg, model, layout, data, _ = make_client("clip", ["algorithm.params.max_norm=0.05"], steps=STEPS)
    w0 = layout.flatten(model).clone()
    out, _ = run_client(cfg, model, layout, data, w0)
    want, clipped = twin_steps(w0, data, 0.05, STEPS)
    assert clipped == STEPS
    close(out["params_P"], want)
    plain, clipped = twin_steps(w0, data, math.inf, STEPS)
    assert clipped == 0 and (plain - want).abs().max() > 1e-3


def test_clip_is_torchs_clip_grad_norm_bit_for_bit():
    """One step's gradients are what FL-Simulator's client leaves: backward, then
    torch.nn.utils.clip_grad_norm_ (the bytes compared: the sign of a zero included)."""
    cfg, model, layout, data, _ = make_client("clip", ["algorithm.params.max_norm=0.05"])
    reference = copy.deepcopy(model)
    ctx = ClientContext(0, 1, layout.flatten(model).clone(), layout, cfg.algorithm)
    rule = rules.get("clip")
    rule.begin(model, ctx)
    rule.gradient(model, data.x, data.y, ctx)
    rules.backward(F.cross_entropy(reference(data.x), data.y), list(reference.parameters()))
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad.view(torch.int32), q.grad.view(torch.int32))


def test_a_max_norm_no_gradient_reaches_is_plain_sgd_bitwise():
    cfg, model, layout, data, _ = make_client("clip", ["algorithm.params.max_norm=1e6"], steps=STEPS)
    w0 = layout.flatten(model).clone()
    clipped, _ = run_client(cfg, model, layout, data, w0)
    plain_cfg, *_ = make_client("plain", steps=STEPS)
    plain, _ = run_client(plain_cfg, model, layout, data, w0)
    assert torch.equal(clipped["params_P"], plain["params_P"])


@pytest.mark.e2e
def test_clip_side_by_side_equals_one_after_another(tmp_path):
    """Each client's own norm and clip factor over the stacks (clients of unequal sizes, partial
    batches, 3 rounds), against the sequential reference; the clip acts on these runs."""
    mlp = SYNTHETIC + ["model.name=mlp", "model.hidden=16"]
    clipped_P = assert_close(tmp_path, mlp + ["algorithm.local=clip", "algorithm.params.max_norm=0.5"])
    plain_P = final_P(tmp_path / "plain", 1, mlp)
    assert (clipped_P - plain_P).abs().max() > 1e-3


def test_max_norm_must_be_positive():
    with pytest.raises(ConfigError) as err:
        checks.load(None, ["algorithm.local=clip", "algorithm.params.max_norm=0"])
    assert "algorithm.params.max_norm: must be > 0, got 0.0" in str(err.value)
    assert checks.load(None, ["algorithm.local=clip"]).algorithm.params == {"max_norm": 10.0}
