"""A model of your own, as a plugin: a small CNN that is not in driftlab's zoo, named in configs as ``tiny_cnn``.

Importing this file registers a ``ModelEntry``; a config (or a sweep file) that names the file under
``plugins`` can then say ``model.name = "tiny_cnn"`` and set its own key ``model.channels``, validated like a
zoo model's (an unknown key, or ``channels = 0``, is refused before anything runs).  Every run imports the file
in its own interpreter, and each run's config.json records it, so resume and ``driftlab report`` find it too.

The network: conv 3x3 (channels), ReLU, max-pool 2; conv 3x3 (2 x channels), ReLU, max-pool 2; flatten;
linear to the classes.  No dropout and no batch normalisation: a
client's local step must be a deterministic function of its parameters and batch.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from driftlab.models import ModelEntry, ModelSection, register


class TinyCNN(nn.Module):
    """Two 3x3 convolutions with max-pooling and one linear layer: 80 + 1,168 + 7,850 = 9,098 parameters with
    8 channels on MNIST (a fortieth of the zoo's ``cnn`` there)."""

    def __init__(self, in_channels: int, height: int, width: int, channels: int, num_classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.fc = nn.Linear(2 * channels * (height // 4) * (width // 4), num_classes)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(inputs)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class TinyCNNConfig(ModelSection):
    """``[model]`` when ``name = "tiny_cnn"``: ``loss`` and ``classifier`` come from ModelSection."""

    name: Literal["tiny_cnn"] = "tiny_cnn"
    channels: int = Field(
        8, ge=1, le=512, description="channels of the first convolution (the second has twice as many)"
    )


def build(section: TinyCNNConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The module for images of ``input_shape`` = (channels, height, width) and ``num_classes`` classes."""
    if len(input_shape) != 3 or min(input_shape[1:]) < 4:
        raise ValueError(
            f"tiny_cnn needs image inputs of shape (channels, height, width), at least 4x4; got {input_shape}"
        )
    channels, height, width = input_shape
    return TinyCNN(channels, height, width, section.channels, num_classes)


register(
    ModelEntry(
        "tiny_cnn",
        TinyCNNConfig,
        build,
        inputs=("images",),
        description="two 3x3 convolutions with max-pooling and a linear layer (examples/own_model)",
    )
)
