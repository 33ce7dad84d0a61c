"""Models: logistic regression, MLP, the two-5x5-conv CNN of seed 002, ResNet-18 (CIFAR stem),
and seed 004's FFNN regressor.

Every model is ``head(projection(features(x)))``: ``features`` gives the representation,
``projection`` is the identity except for MOON clients with ``algorithm.moon_proj_dim > 0``
(MOON's projection head: Linear(d, d), ReLU, Linear(d, out); the classifier then reads its
output, as in MOON's code), and ``head`` is the final linear classifier (the FFNN's: a linear
layer and a sigmoid). ``represent(x)`` is what MOON's contrastive term compares.

A model of your own (``model.name = "module:attr"``) is any ``nn.Module``; MOON needs it split
as ``head(features(x))`` (submodules ``features`` and ``head``; docs/extending.md): its
``features`` and ``head`` are then put into a ``Net``, so the projection head sits between them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import plugins
from ..errors import ConfigError
from .dropout import seeded


class Net(nn.Module):
    def __init__(self, features: nn.Module, head: nn.Module):
        super().__init__()
        self.features = features
        self.projection = nn.Identity()  # no parameters: state_dict keys unchanged without MOON
        self.head = head

    def represent(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.features(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.represent(x))


def add_projection_head(net: Net, out_dim: int, num_classes: int) -> Net:
    """MOON's projection head between the features and a new classifier of ``out_dim`` inputs."""
    dim = net.head.in_features
    net.projection = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, out_dim))
    net.head = nn.Linear(out_dim, num_classes)
    return net


def logistic(input_shape, num_classes) -> Net:
    return Net(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def mlp(input_shape, num_classes, hidden: int = 200) -> Net:
    features = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU(),
                             nn.Linear(hidden, hidden), nn.ReLU())
    return Net(features, nn.Linear(hidden, num_classes))


def cnn(input_shape, num_classes) -> Net:
    """Seed 002's CNN: two 5x5 conv layers, each followed by ReLU and 2x2 max pooling, then two
    fully connected layers (512 hidden, ReLU)."""
    channels, height, width = input_shape
    side_h, side_w = ((height - 4) // 2 - 4) // 2, ((width - 4) // 2 - 4) // 2
    features = nn.Sequential(
        nn.Conv2d(channels, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * side_h * side_w, 512), nn.ReLU())
    return Net(features, nn.Linear(512, num_classes))


def ffnn(input_shape, num_outputs: int = 1) -> Net:
    """Seed 004's feed-forward regressor: hidden layers of 20, 30 and 20 tanh units and one
    sigmoid output, the predicted health percentage in (0, 1)."""
    features = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 20), nn.Tanh(),
                             nn.Linear(20, 30), nn.Tanh(), nn.Linear(30, 20), nn.Tanh())
    return Net(features, nn.Sequential(nn.Linear(20, num_outputs), nn.Sigmoid()))


def resnet18(input_shape, num_classes) -> Net:
    """torchvision's ResNet-18 with the CIFAR stem: a 3x3 stride-1 first conv and no max pool
    (the 7x7/stride-2 ImageNet stem throws away most of a 32x32 image)."""
    import torchvision.models  # late: its import pulls in torch._dynamo (seconds); only ResNet needs it

    net = torchvision.models.resnet18(num_classes=num_classes)
    net.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    head = net.fc
    net.fc = nn.Identity()
    return Net(net, head)


# The built-in models with BatchNorm, whose running statistics are state beside the parameters
# (side by side they must travel in the flat vector; plugin models are checked when built).
WITH_BATCH_NORM = ("resnet18",)


def build(name: str, input_shape, num_classes: int, task: str, hidden: int = 200) -> nn.Module:
    """The model ``name`` (a built-in, or ``module:attr`` called as (input_shape, num_classes))
    for data of this shape and task, each nn.Dropout a ``dropout.SeededDropout``; ``hidden`` is
    the MLP's width. What the run's rules need of it is checked above (``algorithms.build_model``)."""
    input_shape = tuple(input_shape)
    if plugins.is_path(name):
        with plugins.calling("model.name", f"{name}(input_shape, num_classes)"):
            net = plugins.get(name, "model.name")(input_shape, num_classes)
        if not isinstance(net, nn.Module):
            raise ConfigError(f"model.name: {name}(input_shape, num_classes) returned a {type(net).__name__}, "
                              "not a torch.nn.Module")
    else:
        if name in ("cnn", "resnet18") and len(input_shape) != 3:
            raise ConfigError(f"model.name: {name} needs images [C, H, W]; the data's samples have shape "
                              f"{list(input_shape)} (use logistic, mlp or your own model)")
        if name == "ffnn" and task != "regression":
            raise ConfigError(f"model.name: ffnn is a regressor (one sigmoid output); the data are a {task} "
                              "task (use logistic, mlp, cnn or resnet18)")
        if name == "mlp":
            net = mlp(input_shape, num_classes, hidden)
        else:
            builders = {"logistic": logistic, "cnn": cnn, "resnet18": resnet18, "ffnn": ffnn}
            net = builders[name](input_shape, num_classes)
    return seeded(net)  # dropout masks per (client, step), the same one after another and side by side
