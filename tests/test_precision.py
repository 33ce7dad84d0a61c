"""train.precision: bf16 (and tf32 on CUDA) in local training's passes, one after another
(autocast) and side by side (parameters and batch cast once a step, client/precision.py); float32
weights, optimizer state, reports and evaluation.

fp32 is today's bits (tests/digests.py). bf16 is checked end to end on CPU against fp32 and
between the two paths, to a loose tolerance: bfloat16 keeps 8 bits of mantissa, so after two
rounds the models differ from fp32's by about 0.01-0.6% of the largest weight (measured on these
configurations, FedProx, SCAFFOLD, dropout and MOON besides) and side by side from one after
another by as much; BF16_TOL is 4x the largest. A SAM step whose extra pass read a stale bfloat16
copy of the unshifted weights (autocast's cast cache) was 9% off, which fails.
"""

from __future__ import annotations

import pytest
import torch

from fedddp import checks
from fedddp.client import precision
from fedddp.comm import Comm
from fedddp.env import ProcessEnv
from fedddp.round import run

from fedrun import QUICKSTART

SINGLE = ProcessEnv(0, 1, 0, "127.0.0.1", 0, "single")
BF16_TOL = 2e-2
# examples/my_plugin.py's blobs and SmallCNN (a conv layer), as tests/digests.py runs them
CNN = ["data.name=examples.my_plugin:blobs", "data.num_clients=12", "data.partition=natural",
       "model.name=examples.my_plugin:SmallCNN", "run.clients_per_round=6", "train.batch_size=16",
       "train.lr=0.05"]


def final_P(tmp_path, overrides: list[str], prec: str, parallel: int) -> torch.Tensor:
    out = tmp_path / f"{prec}-B{parallel}"
    cfg = checks.load(QUICKSTART, overrides + ["run.rounds=2", f"run.out_dir={out}", "run.overwrite=true",
                                               f"train.precision={prec}", f"run.parallel_clients={parallel}",
                                               "run.progress=false"])
    global_P = run(cfg, Comm(SINGLE, "cpu"))["global_P"]
    assert global_P.dtype == torch.float32
    assert f'precision = "{prec}"' in (out / "config.toml").read_text()
    return global_P


# BatchNorm: side by side on CPU it runs torch's kernel on calls without padding (a step split by
# width), in float32 as the masked form
BATCH_NORM = ["data.name=examples.my_plugin:blobs", "data.num_clients=12", "run.clients_per_round=6",
              "model.name=test_parallel_clients:BatchNormCNN", "train.batch_size=30", "train.lr=0.05"]
# dropout masks cast to bfloat16, a BatchNorm1d with momentum None, and MOON's frozen models
# (cast inside the loss, eval mode on their float32 running statistics)
DROPOUT_BN = ["data.name=examples.my_plugin:blobs", "data.num_clients=12", "run.clients_per_round=6",
              "train.batch_size=30", "train.lr=0.05", "model.name=test_parallel_clients:dropout_batch_norm_mlp"]
CASES = [("quickstart", []), ("cnn", CNN), ("cnn fedsam", CNN + ["algorithm.name=fedsam"]),
         ("cnn fedprox", CNN + ["algorithm.name=fedprox"]), ("cnn scaffold", CNN + ["algorithm.name=scaffold"]),
         ("batch norm", BATCH_NORM), ("batch norm fedsam", BATCH_NORM + ["algorithm.name=fedsam"]),
         ("batch norm padded", BATCH_NORM), ("dropout batch norm", DROPOUT_BN),
         ("dropout batch norm moon", DROPOUT_BN + ["algorithm.name=moon"])]


@pytest.mark.parametrize("name, extra", CASES, ids=[n for n, _ in CASES])
@pytest.mark.e2e
def test_bf16_is_close_to_fp32_and_side_by_side_to_one_after_another(tmp_path, monkeypatch, name, extra):
    """... "padded": BatchNorm's masked form over padded batches (a GPU's), not the CPU's split by
    width."""
    if name == "batch norm padded":
        from fedddp.client import batched

        monkeypatch.setattr(batched, "SPLIT_DEVICES", ())
    fp32_P = final_P(tmp_path, extra, "fp32", 1)
    one_P, side_P = final_P(tmp_path, extra, "bf16", 1), final_P(tmp_path, extra, "bf16", 3)
    scale = fp32_P.abs().max().item()
    for P in (one_P, side_P):
        assert torch.isfinite(P).all()
        assert 0 < (P - fp32_P).abs().max().item() <= BF16_TOL * scale  # it did run in bfloat16
    assert (one_P - side_P).abs().max().item() <= BF16_TOL * scale


def test_contexts():
    assert isinstance(precision.local("fp32", "cpu"), type(precision.local("tf32", "cpu")))  # nothing on CPU
    with precision.local("bf16", "cpu"):
        w = torch.ones(3, 3, requires_grad=True)
        out = torch.ones(2, 3) @ w
    assert out.dtype == torch.bfloat16 and w.dtype == torch.float32
    assert precision.words("fp32", "cpu") == ""
    assert "no effect on CPU" in precision.words("tf32", "cpu")
    assert "bf16" in precision.words("bf16", "cpu")


def test_unknown_precision_is_a_config_error():
    with pytest.raises(Exception, match="train.precision"):
        checks.load(QUICKSTART, ["train.precision=fp16"])


@pytest.mark.parametrize("role, shape", [("input", (3, 4, 5, 6, 7)), ("weight", (3, 8, 5, 3, 3))])
def test_channels_last_stacks_fold_into_channels_last_views(role, shape):
    """models/layout.py: the stacked input and weight of a side-by-side convolution, copied into
    their layouts, fold (as vmap hands them to the kernel) into channels-last views of the same
    memory, with the values of the copy; a contiguous stack folds into an NCHW tensor."""
    from fedddp.models import layout

    src = torch.randn(shape)
    laid = layout.channels_last_empty(src, torch.bfloat16, role).copy_(src)
    assert laid.shape == src.shape and torch.equal(laid.float(), src.bfloat16().float())
    fold = layout.folded(laid, role)
    assert fold.data_ptr() == laid.data_ptr()  # a view: no copy before the kernel
    assert fold.is_contiguous(memory_format=torch.channels_last)
    assert not layout.folded(src, role).is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="5 dimensions"):
        layout.channels_last_empty(src[0], torch.bfloat16, role)


@pytest.mark.e2e
def test_channels_last_bf16_steps_equal_contiguous_ones(tmp_path, monkeypatch):
    """The channels-last layout CUDA's bf16 steps take (precision.CHANNELS_LAST_DEVICES), run on
    CPU: the same model to bfloat16's rounding (the kernels sum in another order), gradients
    handed back in the stacks' own layout (a foreach update over them stays one op)."""
    from fedddp.models import layout

    contiguous_P = final_P(tmp_path / "contiguous", CNN, "bf16", 3)
    monkeypatch.setattr(precision, "CHANNELS_LAST_DEVICES", ("cpu",))
    roles, copied, empty = [], precision._copied, layout.channels_last_empty

    def watched(dests, sources):
        out = copied(dests, sources)
        assert all(d.stride() == s.stride() for d, s in zip(out, sources) if d.dtype == torch.float32)
        return out

    def laid_out(like, dtype, role):
        roles.append(role)
        return empty(like, dtype, role)
    monkeypatch.setattr(precision, "_copied", watched)
    monkeypatch.setattr(layout, "channels_last_empty", laid_out)
    channels_last_P = final_P(tmp_path / "channels_last", CNN, "bf16", 3)
    assert {"input", "weight"} <= set(roles)  # SmallCNN's conv weight and its images were laid out
    scale = contiguous_P.abs().max().item()
    assert (channels_last_P - contiguous_P).abs().max().item() <= BF16_TOL * scale


class Offset(torch.nn.Module):
    """A plugin model (test_precision:Offset) that adds a float32 tensor it makes in its forward:
    bf16 side by side casts the parameters and the batch, not what the forward makes."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = torch.nn.Linear(int(torch.tensor(input_shape).prod()), num_classes)

    def forward(self, x):
        x = x.flatten(1)
        return self.fc(x + torch.ones(x.shape[-1], device=x.device))


@pytest.mark.e2e
def test_a_model_that_mixes_float32_into_bf16_is_one_line_before_round_1(tmp_path, capsys):
    """``--check`` tries one side-by-side step in bf16: a model whose forward makes float32
    tensors is one line naming the module and the fixes, exit 2; in fp32, and one after another
    in bf16 (autocast), it passes."""
    from fedddp.__main__ import main

    offset = [QUICKSTART, "model.name=test_precision:Offset", f"run.out_dir={tmp_path}", "run.progress=false"]
    assert main(["--check", *offset, "run.parallel_clients=3", "train.precision=bf16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "its module fc (Linear) mixes float32 tensors of its own with bfloat16 ones" in err
    assert "set train.precision=fp32, or run.parallel_clients=1" in err
    assert main(["--check", *offset, "run.parallel_clients=3", "train.precision=fp32"]) == 0
    assert main(["--check", *offset, "run.parallel_clients=1", "train.precision=bf16"]) == 0
