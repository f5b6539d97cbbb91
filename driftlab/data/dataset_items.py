"""Map-style datasets read into arrays for ``FederatedArrays.from_datasets``: every item read once and stacked, a dict
item's input and label found by name (a ConfigError that lists the item's keys when they are absent or ambiguous)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from driftlab.errors import ConfigError


def _as_array(values: Any) -> Any:
    return values if isinstance(values, (np.ndarray, torch.Tensor)) else np.asarray(values)


# The names datasets give an example's input and its label (Hugging Face's image, text-token and tabular sets).
INPUT_KEYS = ("image", "img", "pixel_values", "input_ids", "input", "inputs", "features", "x")
LABEL_KEYS = ("label", "labels", "target", "targets", "y")


def _stacked_items(
    dataset: Any, split: str, input_key: str | None = None, label_key: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"the {split} Dataset"
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise ConfigError(
            f"data: {where} is a {type(dataset).__name__}, not a map-style torch Dataset; give an object with "
            "__len__ and __getitem__(index) -> (input, target), such as torch.utils.data.TensorDataset"
        )
    count = len(dataset)
    if count == 0:
        raise ConfigError(f"data: {where} is empty; give at least one (input, target) item")
    inputs, targets = [], []
    keys: tuple[str, str] | None = None
    for index in range(count):
        item = dataset[index]
        if isinstance(item, Mapping):
            if keys is None:
                keys = dict_keys(item, input_key, label_key, where)
            try:
                item = (item[keys[0]], item[keys[1]])
            except KeyError as missing:
                listed = ", ".join(map(str, item))
                raise ConfigError(
                    f"data: item {index} of {where} has no key {missing} (its keys: {listed}); every item needs both"
                ) from None
        elif not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ConfigError(
                f"data: item {index} of {where} is a {type(item).__name__}, not an (input, target) pair or a dict; "
                "make __getitem__ return (input, target)"
            )
        inputs.append(item[0] if isinstance(item[0], torch.Tensor) else torch.as_tensor(np.asarray(item[0])))
        targets.append(torch.as_tensor(item[1]))
    for name, values in (("inputs", inputs), ("targets", targets)):
        shapes = {tuple(value.shape) for value in values}
        if len(shapes) > 1:
            raise ConfigError(
                f"data: the {name} of {where} have different shapes {sorted(shapes)[:3]}; every item's {name[:-1]} must have one shape"
            )
    return torch.stack(inputs), torch.stack(targets)


def dict_keys(item: Mapping, input_key: str | None, label_key: str | None, where: str) -> tuple[str, str]:
    """The (input, label) keys of a dict item: those given, else found by name (``INPUT_KEYS``, ``LABEL_KEYS``, or the
    only other key); a ConfigError listing the item's keys when a given key is absent or the choice is ambiguous."""
    keys = list(item)
    shown = ", ".join(repr(key) for key in keys)
    for role, given in (("input_key", input_key), ("label_key", label_key)):
        if given is not None and given not in item:
            raise ConfigError(f"data: {role}={given!r} is not a key of the items of {where}; their keys are {shown}")

    def named(given: str | None, names: tuple[str, ...]) -> str | None:
        if given is not None:
            return given
        present = [key for key in keys if key in names]
        return present[0] if len(present) == 1 else None

    label, inputs = named(label_key, LABEL_KEYS), named(input_key, INPUT_KEYS)
    others = [key for key in keys if key not in (label, inputs)]
    if label is None and inputs is not None and len(others) == 1:
        label = others[0]
    elif inputs is None and label is not None and len(others) == 1:
        inputs = others[0]
    if inputs is None or label is None or inputs == label:
        raise ConfigError(
            f"data: the items of {where} are dicts with keys {shown}, and which holds the input and which the label is "
            "ambiguous; name them: FederatedArrays.from_datasets(train, test=test, input_key=..., label_key=...)"
        )
    return inputs, label
