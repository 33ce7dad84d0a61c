"""A plugin module: its own data, model, server rule, local rule and callback (docs/extending.md).

    python -m fedddp examples/my_plugin.toml
    torchrun --standalone --nproc_per_node=2 -m fedddp examples/my_plugin.toml

Run from the repository root: the config names these objects by import path,
``examples.my_plugin:blobs`` and so on, looked up from the working directory.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedddp.callbacks import Callback
from fedddp.client.rules import LocalRule
from fedddp.params import positive
from fedddp.strategies import Strategy

CLASSES, CLIENTS, SIDE = 4, 12, 8


def blobs(root: str, seed: int) -> dict:
    """The data callable: 8 x 8 one-channel images, each class a fixed random pattern under
    noise, generated from ``seed`` (``root`` is unused: nothing is read). Its 12 natural
    clients hold two classes each."""
    rng = np.random.default_rng(seed)
    patterns = rng.normal(size=(CLASSES, 1, SIDE, SIDE))

    def draw(n: int):
        y_N = rng.integers(0, CLASSES, n)
        x_N = patterns[y_N] + rng.normal(scale=1.5, size=(n, 1, SIDE, SIDE))
        return x_N.astype(np.float32), y_N

    x_train, y_train = draw(960)
    x_test, y_test = draw(240)
    # client k holds the classes c with 3c in {k - 5, ..., k} (mod 12): two classes each
    client_train = (3 * y_train + rng.integers(0, 6, len(y_train))) % CLIENTS
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test,
            "client_train": client_train}


class SmallCNN(nn.Module):
    """The model callable (input_shape, num_classes): one conv layer (so FedER can weigh it)
    and the head(features(x)) split that MOON reads."""

    def __init__(self, input_shape: tuple, num_classes: int):
        super().__init__()
        channels, height, width = input_shape
        self.features = nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Flatten(), nn.Linear(8 * (height // 2) * (width // 2), 32), nn.ReLU())
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _trimmed_mean(global_P, stacks, state, hp):
    """Coordinate-wise trimmed mean (Yin et al. 2018): per coordinate, drop the ``trim`` fraction
    of largest and of smallest client values and average the rest, unweighted. trim = 0.5
    leaves the coordinate-wise median."""
    params_KP = stacks["params_KP"]
    num_clients = params_KP.shape[0]
    cut = min(int(hp.params["trim"] * num_clients), (num_clients - 1) // 2)
    kept_KP = params_KP.sort(dim=0).values[cut:num_clients - cut]
    return kept_KP.mean(0), state, {"trimmed_per_side": torch.tensor(cut)}


def _check_trim(params: dict) -> list[str]:
    trim = params["trim"]
    return [] if 0.0 <= trim <= 0.5 else [f"algorithm.params.trim: must be in [0, 0.5], got {trim}"]


TRIMMED_MEAN = Strategy("trimmed_mean", _trimmed_mean, params={"trim": 0.5}, check_params=_check_trim,
                        doc=_trimmed_mean.__doc__)


class ClippedSGD(LocalRule):
    """A local rule: the task's loss, its minibatch gradient clipped to L2 norm ``clip`` as
    torch.nn.utils.clip_grad_norm_ clips (fedddp's built-in ``clip`` is the same rule). One
    direction, for one client's tensors and for stacks of clients side by side."""

    name = "clipped_sgd"
    params = {"clip": 1.0}

    @classmethod
    def check_params(cls, params: dict) -> list[str]:
        return positive(params, "clip")  # fedddp.params: the checks rules share

    def direction(self, step):
        # step.norm: the client's L2 norm over every parameter (side by side: each client's)
        scale = (step.hp.params["clip"] / (step.norm(step.grads) + 1e-6)).clamp(max=1.0)
        return [g * step.per_client(scale, g) for g in step.grads]


class EarlyStop(Callback):
    """A callback (run.callbacks = ["examples.my_plugin:EarlyStop"]): stop the run once the test
    metric has not improved for ``patience`` evaluations in a row (early stopping). Called on
    rank 0 only; returning True from on_round_end ends the run after that round, with final.pt."""

    patience = 3

    def __init__(self):
        self.best, self.waited = None, 0

    def on_round_end(self, round, row, model):
        accuracy = row.get("test_accuracy")
        if accuracy is None:  # a round without evaluation (run.eval_every)
            return False
        if self.best is None or accuracy > self.best:
            self.best, self.waited = accuracy, 0
        else:
            self.waited += 1
        return self.waited >= self.patience
