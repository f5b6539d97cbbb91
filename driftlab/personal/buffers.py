"""FedBN's local running statistics (Li, Jiang, Zhang, Kamp and Dou, "FedBN: Federated Learning on Non-IID Features
via Local Batch Normalization", ICLR 2021): each client's BatchNorm buffers, kept for it between its rounds.

``[personal_layers]``'s ``finish`` (``feature.py``) adds a ``ClientBuffers`` to the simulation's state extras when
some normalisation layer's parameters are all personal; the round's buffers observer finds it
(``backends.buffers.own_buffers_record``) and starts each client from its own, keeps its final ones and leaves them out
of the server's average (``round.buffers``); the personal evaluation and ``driftlab.load_model(run_dir, client=k)``
load client k's.  With B the buffers of the personal normalisation layers (``personal_buffer_names``) and b_k client
k's own values there::

    start_k = (r^{t−1} outside B, b_k)          b_k = the server's initial buffers on B before client k first trains
    b_k    ← client k's final buffers on B       kept, never averaged
    r^t    = the server's average (backends.buffers.average_buffers) outside B;  r^t_B = r⁰_B  (never used by a client)

as FedBN's Algorithm 1 keeps a client's BN statistics and affine parameters out of the server's average.  Client k's
personal model evaluates with (r^t outside B, b_k).  ``ClientBuffers`` is also a checkpoint state extra
(``round.checkpointing.StateExtra``): ``personal_buffers/<client>/<name>``, so a resumed run continues each
client's own statistics.

Example:
    >>> record = ClientBuffers({"bn.running_mean": torch.zeros(2)})
    >>> record.keep(3, {"bn.running_mean": torch.ones(2), "other": torch.ones(1)})
    >>> record.start_of(3)["bn.running_mean"].tolist(), record.start_of(5)["bn.running_mean"].tolist()
    ([1.0, 1.0], [0.0, 0.0])
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from driftlab.personal.selection import PersonalPart

CHECKPOINT_PREFIX = "personal_buffers/"  # personal_buffers/<client id>/<buffer's state_dict name>


def personal_buffer_names(module: nn.Module, part: PersonalPart) -> tuple[str, ...]:
    """The buffers that stay local with ``part``: those of each normalisation layer with running statistics whose
    every parameter is personal (FedBN keeps a BN layer's statistics where its affine parameters are), in
    ``named_buffers`` order; a layer without affine parameters keeps its statistics shared."""
    personal = set(part.personal)
    names = []
    for prefix, layer in module.named_modules():
        if not (isinstance(layer, nn.modules.batchnorm._NormBase) and layer.track_running_stats):
            continue
        owned = [f"{prefix}.{name}" if prefix else name for name, _ in layer.named_parameters(recurse=False)]
        if owned and all(name in personal for name in owned):
            names.extend(f"{prefix}.{name}" if prefix else name for name, _ in layer.named_buffers(recurse=False))
    return tuple(names)


class ClientBuffers:
    """Each client's own values of the personal buffers (``initial``'s names), from its last round; a client that
    has not trained starts from ``initial`` (the server's at round 0)."""

    # how the round's buffers observer finds it among the simulation's state extras (backends.buffers.own_buffers_record)
    keeps_client_buffers = True

    def __init__(self, initial: Mapping[str, torch.Tensor]) -> None:
        self.initial = {name: value.detach().clone() for name, value in initial.items()}
        self.by_client: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.initial)

    def start_of(self, client_id: int) -> dict[str, torch.Tensor]:
        """The personal buffers client ``client_id`` starts from (and is evaluated with)."""
        return self.by_client.get(client_id, self.initial)

    def starts(self, client_ids: Sequence[int]) -> dict[int, dict[str, torch.Tensor]]:
        """The personal buffers each of ``client_ids`` starts from, by its position there (a wave's task positions)."""
        return {position: self.start_of(client_id) for position, client_id in enumerate(client_ids)}

    def keep(self, client_id: int, buffers: Mapping[str, torch.Tensor]) -> None:
        """Keep the personal ones of client ``client_id``'s final ``buffers`` (all of the model's)."""
        missing = [name for name in self.initial if name not in buffers]
        if missing:
            raise KeyError(f"client {client_id}'s buffers lack {', '.join(missing)}: pass all of the model's")
        self.by_client[client_id] = {name: buffers[name].detach().clone() for name in self.initial}

    def shared(self, averaged: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The server's new buffers: ``averaged`` outside the personal ones, ``initial`` on them (never averaged)."""
        return {**averaged, **{name: value.clone() for name, value in self.initial.items()}}

    def engine_tensors(self, state: Any, disk_stores: Mapping[str, Any]) -> dict[str, torch.Tensor]:  # noqa: ARG002
        return {
            f"{CHECKPOINT_PREFIX}{client_id}/{name}": value.to("cpu").contiguous()
            for client_id, buffers in sorted(self.by_client.items())
            for name, value in buffers.items()
        }

    def restored(self, sim: Any, state: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:  # noqa: ARG002
        self.by_client = {}
        for key, value in tensors.items():
            if key.startswith(CHECKPOINT_PREFIX):
                client, _, name = key[len(CHECKPOINT_PREFIX) :].partition("/")
                if name not in self.initial:
                    raise KeyError(f"checkpoint tensor {key!r} names no personal buffer of this run's model")
                target = self.initial[name]
                self.by_client.setdefault(int(client), {})[name] = value.to(target.device, target.dtype)
        return {}


__all__ = ["CHECKPOINT_PREFIX", "ClientBuffers", "personal_buffer_names"]
