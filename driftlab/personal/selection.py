"""Which coordinates of the flat parameter vector are personal: name patterns resolved over the model's layout.

The flat vector is the model's parameters in ``named_parameters`` order, each flattened
(``driftlab.simulation.backends.flat.FlatModel``: ``names``, ``numels``).  ``select`` turns ``[personal_layers]
keep`` into the spans of the personal coordinates; ``"head"`` and ``"body"`` are resolved from the names alone,
``"batchnorm"`` (FedBN, Li et al., ICLR 2021) from the parameters' kinds (``parameter_kinds``): the affine
parameters of every normalisation layer that keeps running statistics, whatever its name (torchvision names a
ResNet shortcut's BatchNorm ``downsample.1``).

Example:
    >>> part = select(("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"), (6, 2, 4, 2), ("head",))
    >>> part.personal, part.spans
    (('fc2.weight', 'fc2.bias'), ((8, 14),))
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch

from driftlab.simulation.backends.flat import RUNNING_NORM, parameter_kinds

HEAD, BODY, BATCHNORM = "head", "body", "batchnorm"
_SHOWN_NAMES = 60  # an error lists at most this many parameter names


@dataclass(frozen=True)
class PersonalPart:
    """The personal parameters of a model: their names and their ``[start, stop)`` spans in the flat vector."""

    names: tuple[str, ...]  # every parameter name of the model, in flat order
    sizes: tuple[int, ...]  # their numbers of entries
    personal: tuple[str, ...]  # the personal ones, in flat order
    spans: tuple[tuple[int, int], ...]

    @property
    def num_parameters(self) -> int:
        return sum(self.sizes)

    @property
    def num_personal(self) -> int:
        return sum(stop - start for start, stop in self.spans)

    def mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[P]`` bool: True on the personal coordinates."""
        mask = torch.zeros(self.num_parameters, dtype=torch.bool, device=device)
        for start, stop in self.spans:
            mask[start:stop] = True
        return mask

    def values(self, params: torch.Tensor) -> torch.Tensor:
        """The personal coordinates of a flat ``[P]`` vector, concatenated in flat order (a copy)."""
        if not self.spans:
            return params.new_zeros(0)
        return torch.cat([params[start:stop] for start, stop in self.spans]).clone()

    def substitute(self, params: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``params`` with its personal coordinates replaced by ``values`` (as ``values(...)`` gives them); a new tensor."""
        out = params.clone()
        offset = 0
        for start, stop in self.spans:
            out[start:stop] = values[offset : offset + stop - start]
            offset += stop - start
        return out


def head_names(names: tuple[str, ...]) -> tuple[str, ...]:
    """The parameters of the model's last module (``fc3.weight``, ``fc3.bias``): the names that share the last name's
    module path, in flat order."""
    if not names:
        return ()
    module = names[-1].rpartition(".")[0]
    return tuple(name for name in names if name.rpartition(".")[0] == module)


def _listing(names: tuple[str, ...]) -> str:
    shown = ", ".join(names[:_SHOWN_NAMES])
    return shown if len(names) <= _SHOWN_NAMES else f"{shown}, ... ({len(names) - _SHOWN_NAMES} more)"


def select(
    names: tuple[str, ...], sizes: tuple[int, ...], keep: tuple[str, ...], kinds: tuple[str, ...] = ()
) -> PersonalPart:
    """The personal part ``keep`` names: each item is ``"head"``, ``"body"``, ``"batchnorm"`` (the parameters whose
    kind in ``kinds``, from ``parameter_kinds``, is ``RUNNING_NORM``) or a glob pattern (``fnmatch``, case sensitive)
    over ``names``.  ValueError, listing the model's parameter names, for an item that matches none, and for a
    selection that leaves nothing shared."""
    if len(names) != len(sizes):
        raise ValueError(f"{len(names)} parameter names for {len(sizes)} tensor sizes")
    if BATCHNORM in keep and len(kinds) != len(names):
        raise ValueError(
            f'personal_layers.keep item "batchnorm" needs the kind of each parameter ({len(kinds)} kinds for '
            f"{len(names)} parameters): pass parameter_kinds(module, names)"
        )
    head = head_names(names)
    chosen: set[str] = set()
    for item in keep:
        if item == HEAD:
            matched = head
        elif item == BODY:
            matched = tuple(name for name in names if name not in head)
        elif item == BATCHNORM:
            matched = tuple(name for name, kind in zip(names, kinds, strict=True) if kind == RUNNING_NORM)
        else:
            matched = tuple(name for name in names if fnmatch.fnmatchcase(name, item))
        if not matched:
            raise ValueError(
                f"personal_layers.keep item {item!r} matches none of the model's parameters; its parameter names are: "
                f'{_listing(names)} (or use "head", "body"'
                + (', "batchnorm"' if RUNNING_NORM in kinds else "")
                + ")"
                + (
                    '; the model has no normalisation layer with running statistics (BatchNorm) for "batchnorm"'
                    if item == BATCHNORM
                    else ""
                )
            )
        chosen.update(matched)
    if names and len(chosen) == len(names):
        raise ValueError(
            f"personal_layers.keep = {list(keep)} makes every parameter personal, so nothing is federated: keep fewer "
            '(e.g. ["head"]), or train each client alone'
        )
    spans, offset, personal = [], 0, []
    for name, size in zip(names, sizes, strict=True):
        if name in chosen:
            personal.append(name)
            if spans and spans[-1][1] == offset:
                spans[-1] = (spans[-1][0], offset + size)  # adjacent tensors: one span
            else:
                spans.append((offset, offset + size))
        offset += size
    return PersonalPart(tuple(names), tuple(int(s) for s in sizes), tuple(personal), tuple(spans))


__all__ = ["BATCHNORM", "BODY", "HEAD", "RUNNING_NORM", "PersonalPart", "head_names", "parameter_kinds", "select"]
