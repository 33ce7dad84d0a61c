"""What a data set asks of the model: its training loss and its test metric, per task kind.

  classification  y: int64 class labels [N]; model output: logits [N, C]
                  loss cross-entropy; test metric accuracy   (metrics.jsonl: test_accuracy)
  regression      y: float32 targets [N];    model output: [N, 1]
                  loss MSE;           test metric MAE        (metrics.jsonl: test_mae)

Every place that turns a model output into a loss (the local rules, CGW's full-batch gradient,
evaluation) goes through ``get(task)``, so the local rules are written once for every task and a
new task kind is one entry here.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, NamedTuple

if TYPE_CHECKING:  # torch is imported on first use: the config's checks (of_data) run before it
    import torch


class Task(NamedTuple):
    name: str
    loss: Callable[..., torch.Tensor]  # (output, y, reduction="mean") -> loss
    metric_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (output, y) -> sum over samples
    metric_key: str  # the metrics.jsonl key of the test metric (mean of metric_sum)


def _mse(output_N1: torch.Tensor, target_N: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    import torch.nn.functional as F  # a lookup in sys.modules once torch is loaded

    return F.mse_loss(output_N1.squeeze(1), target_N, reduction=reduction)


def _correct(logits_NC: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    return (logits_NC.argmax(1) == labels_N).sum()


def _abs_error(output_N1: torch.Tensor, target_N: torch.Tensor) -> torch.Tensor:
    return (output_N1.squeeze(1) - target_N).abs().sum()


# data.name -> task kind, for the checks that run before any data is read (config validation);
# the data builders set FederatedData.task to the same value.
REGRESSION_DATA = ("cmapss",)


def of_data(data_name: str) -> str | None:
    """The task of a data set known by name; None for a tensors file, a clients_dir folder or a
    data callable, whose task is known once the arrays are read (the checks that need it then
    run on the built data and model: fedddp.models.build_model)."""
    if data_name in ("tensors", "clients_dir") or ":" in data_name:
        return None
    return "regression" if data_name in REGRESSION_DATA else "classification"


@functools.cache
def _tasks() -> dict[str, Task]:
    import torch.nn.functional as F

    return {"classification": Task("classification", F.cross_entropy, _correct, "test_accuracy"),
            "regression": Task("regression", _mse, _abs_error, "test_mae")}


def get(name: str) -> Task:
    return _tasks()[name]


def __getattr__(name: str):
    # TASKS and CLASSIFICATION are built on first use, so importing this module imports no torch
    if name == "TASKS":
        return _tasks()
    if name == "CLASSIFICATION":
        return _tasks()["classification"]
    raise AttributeError(f"module 'fedddp.tasks' has no attribute {name!r}")
