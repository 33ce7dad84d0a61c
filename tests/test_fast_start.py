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
