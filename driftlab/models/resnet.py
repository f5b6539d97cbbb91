"""ResNet-18 (He et al. 2016) in the zoo's two normalisations: GroupNorm (FedDyn) and BatchNorm (FedAvg-BN, FedBN).

Layout and parameter names follow torchvision's ``resnet18`` (``conv1``, ``bn1``,
``layer1..4``, ``fc``; the norms keep torchvision's ``bn`` names whichever they
are, as in the FedDyn authors' code, which swaps each ``bn`` for
``GroupNorm(2, ·)``).  Initialisation as torchvision: convolutions
Kaiming-normal (fan-out, ReLU), norms weight 1 and bias 0, the final linear
PyTorch's default.  Both variants build their layers in the same order, so a
seed gives the GroupNorm and BatchNorm networks the same convolution and
linear weights.

Stems (``stem``):
* ``"cifar"`` (default): 3x3 stride-1 conv, no max-pool — the common CIFAR
  variant (He et al.'s CIFAR experiments use it); a 32x32 image reaches
  layer4 at 4x4;
* ``"imagenet"``: 7x7 stride-2 conv and a 3x3 stride-2 max-pool —
  torchvision's layout, which is what the FedDyn authors actually ran on
  CIFAR-10 (``models.resnet18()`` with the norms swapped and
  ``fc = Linear(512, 10)``); a 32x32 image reaches layer4 at 1x1.

Parameters (10 classes, width 64), either norm (both have a weight and a bias
per channel): 11,173,962 with the CIFAR stem, 11,181,642 with the ImageNet stem
(torchvision's resnet18 with a 10-way head).  The BatchNorm network also has
buffers: every norm's ``running_mean``, ``running_var`` (one value per channel)
and ``num_batches_tracked``, which a run treats as state beside the parameters
(``simulation/backends/buffers.py``: each client updates its own from the
server's, the server averages the reporting clients').
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

Norm = Callable[[int], nn.Module]  # channels -> the normalisation layer


class _BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock``: conv3x3-norm-ReLU-conv3x3-norm, + shortcut (1x1 conv-norm when the shape
    changes), ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, norm: Norm) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = norm(out_channels)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), norm(out_channels)
            )

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(inputs)))
        out = self.bn2(self.conv2(out))
        shortcut = inputs if self.downsample is None else self.downsample(inputs)
        return torch.relu(out + shortcut)


class BasicBlockGN(_BasicBlock):
    """torchvision's ResNet ``BasicBlock`` with GroupNorm: conv3x3-GN-ReLU-conv3x3-GN, + shortcut, ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, groups: int) -> None:
        super().__init__(in_channels, out_channels, stride, lambda channels: nn.GroupNorm(groups, channels))


class BasicBlockBN(_BasicBlock):
    """torchvision's ResNet ``BasicBlock``: conv3x3-BN-ReLU-conv3x3-BN, + shortcut, ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__(in_channels, out_channels, stride, nn.BatchNorm2d)


class _ResNet18(nn.Module):
    """ResNet-18 with the norm each block and the stem get from ``block`` and ``norm`` (module docstring)."""

    def __init__(
        self,
        num_classes: int,
        block: Callable[[int, int, int], nn.Module],
        norm: Norm,
        in_channels: int,
        stem: str,
        width: int,
    ) -> None:
        super().__init__()
        if stem not in ("cifar", "imagenet"):
            raise ValueError(
                f"stem must be 'cifar' (3x3 conv, no max-pool) or 'imagenet' (7x7/2 conv + max-pool), got {stem!r}"
            )
        if stem == "cifar":
            self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
            self.maxpool = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.bn1 = norm(width)
        channels = [width, 2 * width, 4 * width, 8 * width]
        previous = width
        for index, out in enumerate(channels, start=1):
            stride = 1 if index == 1 else 2
            setattr(self, f"layer{index}", nn.Sequential(block(previous, out, stride), block(out, out, 1)))
            previous = out
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(previous, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, (nn.GroupNorm, nn.BatchNorm2d)):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(torch.relu(self.bn1(self.conv1(inputs))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


class ResNet18GN(_ResNet18):
    """ResNet-18 with every BatchNorm replaced by ``GroupNorm(groups, channels)`` (FedDyn A.2; module docstring).

    Args:
        num_classes: output size.
        groups: GroupNorm groups (2 in FedDyn); must divide ``width``.
        in_channels: input channels.
        stem: ``"cifar"`` or ``"imagenet"`` (module docstring).
        width: channels of the stem and layer1 (64); layers 2-4 have 2x, 4x, 8x.
            Smaller widths are for tests and quick experiments.
    """

    def __init__(
        self, num_classes: int, groups: int = 2, in_channels: int = 3, stem: str = "cifar", width: int = 64
    ) -> None:
        if width < 1 or width % groups:
            raise ValueError(
                f"GroupNorm needs groups={groups} to divide the channel count; width={width} is not a multiple"
            )
        super().__init__(
            num_classes,
            lambda given, out, stride: BasicBlockGN(given, out, stride, groups),
            lambda channels: nn.GroupNorm(groups, channels),
            in_channels,
            stem,
            width,
        )


class ResNet18BN(_ResNet18):
    """ResNet-18 with BatchNorm, as torchvision builds it (module docstring): the model of FedBN's and FedAvg-BN's
    experiments (Li et al., ICLR 2021), whose running statistics are buffers a run averages with the parameters.

    Args:
        num_classes: output size.
        in_channels: input channels.
        stem: ``"cifar"`` or ``"imagenet"`` (module docstring).
        width: channels of the stem and layer1 (64); layers 2-4 have 2x, 4x, 8x.
    """

    def __init__(self, num_classes: int, in_channels: int = 3, stem: str = "cifar", width: int = 64) -> None:
        if width < 1:
            raise ValueError(f"width must be at least 1, got {width}")
        super().__init__(num_classes, BasicBlockBN, nn.BatchNorm2d, in_channels, stem, width)


def resnet18_groupnorm(
    num_classes: int, groups: int = 2, in_channels: int = 3, stem: str = "cifar", width: int = 64
) -> ResNet18GN:
    """ResNet-18 with GroupNorm(``groups``) for CIFAR (:class:`ResNet18GN`)."""
    return ResNet18GN(num_classes, groups=groups, in_channels=in_channels, stem=stem, width=width)


def resnet18_batchnorm(num_classes: int, in_channels: int = 3, stem: str = "cifar", width: int = 64) -> ResNet18BN:
    """ResNet-18 with BatchNorm for CIFAR (:class:`ResNet18BN`)."""
    return ResNet18BN(num_classes, in_channels=in_channels, stem=stem, width=width)


__all__ = ["BasicBlockBN", "BasicBlockGN", "ResNet18BN", "ResNet18GN", "resnet18_batchnorm", "resnet18_groupnorm"]
