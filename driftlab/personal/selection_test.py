"""Resolving ``[personal_layers] keep`` over a model's parameter names (``selection.py``)."""

from __future__ import annotations

import pytest
import torch

from driftlab.personal.selection import RUNNING_NORM, head_names, parameter_kinds, select

CNN = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias", "fc3.weight", "fc3.bias")
SIZES = (6, 2, 8, 2, 4, 2, 3, 1)  # offsets 0, 6, 8, 16, 18, 22, 24, 27; P = 28


def test_head_is_the_last_modules_parameters_and_body_the_rest() -> None:
    assert head_names(CNN) == ("fc3.weight", "fc3.bias")
    assert head_names(("layers.4.weight", "layers.4.bias", "layers.0.weight")) == ("layers.0.weight",)
    head = select(CNN, SIZES, ("head",))
    assert head.personal == ("fc3.weight", "fc3.bias") and head.spans == ((24, 28),)
    body = select(CNN, SIZES, ("body",))
    assert body.spans == ((0, 24),) and body.num_personal == 24 and body.num_parameters == 28


def test_glob_patterns_union_and_spans_in_flat_order() -> None:
    part = select(CNN, SIZES, ("conv1.*", "fc1.bias", "conv1.weight"))
    assert part.personal == ("conv1.weight", "conv1.bias", "fc1.bias")
    assert part.spans == ((0, 8), (22, 24))
    params = torch.arange(28.0)
    assert part.values(params).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 22, 23]
    substituted = part.substitute(params, -part.values(params) - 1)
    assert substituted[part.mask()].tolist() == [-1, -2, -3, -4, -5, -6, -7, -8, -23, -24]
    assert torch.equal(substituted[~part.mask()], params[~part.mask()])
    assert torch.equal(params, torch.arange(28.0))  # substitute copies


def test_nothing_kept_has_no_spans() -> None:
    part = select(CNN, SIZES, ())
    assert part.spans == () and part.values(torch.ones(28)).numel() == 0 and not part.mask().any()


def test_an_unknown_pattern_lists_the_models_parameter_names() -> None:
    with pytest.raises(
        ValueError,
        match=r"'fc2\.\*' matches none of the model's parameters; its parameter names are: "
        r"conv1\.weight, conv1\.bias, .*fc3\.bias \(or use \"head\", \"body\"\)",
    ):
        select(CNN, SIZES, ("head", "fc2.*"))


def test_everything_personal_is_refused() -> None:
    with pytest.raises(ValueError, match="nothing is federated"):
        select(CNN, SIZES, ("head", "body"))


def _torchvision_like_block() -> torch.nn.Module:
    """A ResNet basic block's layout as torchvision names it: the shortcut's BatchNorm is ``downsample.1``."""
    nn = torch.nn
    block = nn.Module()
    block.conv1 = nn.Conv2d(1, 2, 1, bias=False)
    block.bn1 = nn.BatchNorm2d(2)
    block.downsample = nn.Sequential(nn.Conv2d(1, 2, 1, bias=False), nn.BatchNorm2d(2))
    block.norm = nn.GroupNorm(1, 2)  # no running statistics: shared
    block.stats_free = nn.BatchNorm2d(2, track_running_stats=False)  # none either: shared
    block.fc = nn.Linear(2, 1)
    return block


def test_batchnorm_keeps_every_normalisation_layer_with_running_statistics_by_module_class() -> None:
    block = _torchvision_like_block()
    names = tuple(name for name, _ in block.named_parameters())
    sizes = tuple(p.numel() for _, p in block.named_parameters())
    kinds = parameter_kinds(block, names)
    assert kinds == (
        "Conv2d", RUNNING_NORM, RUNNING_NORM, "Conv2d", RUNNING_NORM, RUNNING_NORM,
        "GroupNorm", "GroupNorm", "BatchNorm2d", "BatchNorm2d", "Linear", "Linear",
    )  # fmt: skip
    part = select(names, sizes, ("batchnorm",), kinds)
    assert part.personal == ("bn1.weight", "bn1.bias", "downsample.1.weight", "downsample.1.bias")
    assert part.spans == ((2, 6), (8, 12))  # conv1 2, bn1 4, downsample.0 2, downsample.1 4
    assert select(names, sizes, ("batchnorm", "fc.*"), kinds).personal[-2:] == ("fc.weight", "fc.bias")


def test_batchnorm_without_kinds_or_without_batchnorm_layers_is_refused() -> None:
    with pytest.raises(ValueError, match=r'"batchnorm" needs the kind of each parameter \(0 kinds for 8'):
        select(CNN, SIZES, ("batchnorm",))
    with pytest.raises(ValueError, match=r"no normalisation layer with running statistics \(BatchNorm\)"):
        select(CNN, SIZES, ("batchnorm",), ("Conv2d",) * 4 + ("Linear",) * 4)
