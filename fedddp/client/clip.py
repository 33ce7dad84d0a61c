"""clip: every local step's minibatch gradient clipped to L2 norm ``max_norm`` (default 10).

FL-Simulator's local step (github.com/woodenchild95/FL-Simulator, client/client.py, the client
that its FedAvg, FedSAM and FedSMOO baselines share): ``loss.backward()``, then
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10)``, then the optimizer's step. Local
SGD with a clipped gradient is CELGC's client step (Liu et al., "A Communication-Efficient Distributed
Gradient Clipping Algorithm for Training Deep Neural Networks", NeurIPS 2022). As torch clips:

    g <- g * min(1, max_norm / (||g|| + 1e-6)),    ||g|| the L2 norm over every parameter

Use it with any server rule that takes FedAvg's clients: ``algorithm.local = "clip"``, e.g. with
``algorithm.name = "fedavg"`` for FL-Simulator's FedAvg. The whole rule is this file and its import
in fedddp/client/__init__.py (docs/extending.md, "Local rules").
"""

from __future__ import annotations

from ..params import positive
from ..registry import add_local
from .rules import LocalRule


class Clip(LocalRule):
    """Local steps along the minibatch gradient clipped to L2 norm max_norm (FL-Simulator's
    client step; CELGC, Liu et al. 2022): g * min(1, max_norm / (||g|| + 1e-6))."""

    name = "clip"
    doc = __doc__
    params = {"max_norm": 10.0}
    param_docs = {"max_norm": "clip: L2 norm every local step's minibatch gradient is clipped to."}

    @classmethod
    def check_params(cls, params: dict) -> list[str]:
        return positive(params, "max_norm")

    def direction(self, step):
        # one client's norm and scale (0-dim), or each client's of a stack ([L], per_client reshapes)
        scale = (step.hp.params["max_norm"] / (step.norm(step.grads) + 1e-6)).clamp(max=1.0)
        return [g * step.per_client(scale, g) for g in step.grads]


add_local(Clip)
