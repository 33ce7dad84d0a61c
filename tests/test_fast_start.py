"""A run imports only what it uses: the quickstart never pays for torchvision's model zoo or
torch._dynamo (together several seconds, more than ``import torch``), and the optimizers that
skip torch.optim's compile guards update bitwise as torch.optim's own classes do."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fedddp.client.optim import _Adam, _SGD
from fedrun import QUICKSTART, REPO


@pytest.mark.processes
def test_quickstart_round_imports_neither_torchvision_nor_dynamo(tmp_path):
    """Guards the slow start: fedddp.models imported torchvision (which pulls in torch._dynamo)
    for every model, and the first torch.optim step imported torch._dynamo. TensorBoard is
    imported only for run.tensorboard = true."""
    code = ("import sys; from fedddp.__main__ import main\n"
            f"code = main([{QUICKSTART!r}, 'run.rounds=1', 'run.out_dir={tmp_path}', 'run.progress=false'])\n"
            "assert code == 0, code\n"
            "print(sorted(m for m in ('torchvision', 'torch._dynamo', 'torch.utils.tensorboard') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "final.pt").exists()  # the round ran


@pytest.mark.parametrize("eager, reference, kwargs", [
    (_SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}),
    (_SGD, torch.optim.SGD, {"lr": 0.1}),
    (_Adam, torch.optim.Adam, {"lr": 0.01, "weight_decay": 1e-3}),
])
def test_eager_optimizers_update_bitwise_as_torch_optim(eager, reference, kwargs):
    """Guards the bits: a step without torch.optim's wrapper must still run under no_grad and
    reach the same update as the wrapped one."""
    finals = []
    for cls in (eager, reference):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        opt = cls(model.parameters(), **kwargs)
        x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
        for _ in range(5):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        finals.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*finals):
        assert torch.equal(a, b)


# Each command's first output is written before torch is imported (seconds on a busy 2-core
# machine): the subprocess records, at every write to stdout or stderr, whether torch was loaded.
_WATCH = """
import io, json, sys
seen = []
class Watch(io.TextIOWrapper):
    def write(self, text):
        if text.strip():
            seen.append('torch' in sys.modules)
        return super().write(text)
sys.stdout = Watch(sys.stdout.buffer, line_buffering=True)
sys.stderr = Watch(sys.stderr.buffer, line_buffering=True)
from fedddp.{module} import main
code = main({argv!r})
sys.stdout.flush()
print(json.dumps({{"code": code, "first_write_torch": seen[0] if seen else None,
                   "torch_at_end": 'torch' in sys.modules}}), file=sys.__stdout__)
"""


def _watch(module: str, argv: list[str], tmp_path) -> dict:
    import json

    code = _WATCH.format(module=module, argv=argv)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.processes
@pytest.mark.parametrize("module", ["__main__", "launch"])
@pytest.mark.parametrize("case, overrides", [
    ("unknown key", ["run.roundz=3"]),
    ("wrong type", ["run.rounds=three"]),
    ("out of range", ["run.rounds=-1"]),
    ("unknown choice", ["train.precision=fp8"]),
])
def test_a_mistake_in_the_config_answers_before_torch_is_imported(tmp_path, module, case, overrides):
    result = _watch(module, [QUICKSTART, *overrides], tmp_path)
    assert result == {"code": 2, "first_write_torch": False, "torch_at_end": False}, case


@pytest.mark.processes
def test_a_broken_or_missing_file_answers_before_torch_is_imported(tmp_path):
    (tmp_path / "bad.toml").write_text("[run\nrounds = 3\n")
    for path in ("bad.toml", "missing.toml"):
        assert _watch("__main__", [path], tmp_path) == {"code": 2, "first_write_torch": False,
                                                         "torch_at_end": False}, path


@pytest.mark.processes
@pytest.mark.parametrize("argv", [[], ["--version"], ["--help"]])
def test_usage_version_and_help_write_before_torch_is_imported(tmp_path, argv):
    result = _watch("__main__", argv, tmp_path)
    assert result["first_write_torch"] is False and result["code"] == (2 if not argv else 0)
    # --help's second part names the algorithms, which are known once the rules are imported
    assert result["torch_at_end"] is (argv == ["--help"])


@pytest.mark.processes
def test_launch_help_needs_no_torch(tmp_path):
    code = ("import sys\nfrom fedddp.launch import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n"
            "    assert e.code == 0\nprint('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "False", proc.stderr[-2000:]
