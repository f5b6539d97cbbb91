"""The model zoo: plain ``torch.nn`` modules used by the papers.

Every model is an ordinary module, so users can pass their own instead.
Shapes follow ../shared/design/benchmarks.md (FedDyn authors' code unless noted).
"""

from __future__ import annotations

import torch
from torch import nn


class MultinomialLogisticRegression(nn.Module):
    """``softmax(W x + b)`` on flattened inputs (FedProx's MNIST and synthetic model).

    Parameters: ``in_features * num_classes + num_classes``.
    """

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.linear(inputs.flatten(1))


class MLP(nn.Module):
    """Fully connected ReLU network, e.g. 784-200-200-10 for MNIST (FedDyn).

    Args:
        in_features: flattened input size.
        hidden: widths of the hidden layers, e.g. ``(200, 200)``.
        num_classes: output size.
    """

    def __init__(self, in_features: int, hidden: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        widths = (in_features, *hidden)
        layers: list[nn.Module] = []
        for width_in, width_out in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.layers(inputs.flatten(1))


MODEL_NAMES = ("mlr", "mlp", "quadratic")


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = (200, 200)) -> nn.Module:
    """Build a zoo model by name for inputs of ``input_shape`` (without the batch dimension)."""
    in_features = 1
    for size in input_shape:
        in_features *= size
    if name == "mlr":
        return MultinomialLogisticRegression(in_features, num_classes)
    if name == "mlp":
        return MLP(in_features, tuple(hidden), num_classes)
    if name == "quadratic":
        from driftlab.data.quadratic import QuadraticObjective

        if len(input_shape) != 1 or input_shape[0] % 2:
            raise ValueError(f"model quadratic needs quadratic data (rows [a, b]); got inputs of shape {input_shape}")
        return QuadraticObjective(input_shape[0] // 2)
    raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODEL_NAMES)}")
