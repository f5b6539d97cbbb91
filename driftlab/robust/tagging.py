"""A message tagged with its client's id: what a server-side wrapper that must know who sent what folds.

Robust aggregation (centered clipping's per-client momentum) and attack simulation (who is Byzantine, whose noise)
need the sender of each message, and ``ServerFold.add`` sees only the message.  ``tagging(algorithm)`` returns the
client side that wraps each message as ``Tagged(message, client_id)``, and the release form and codec that read
through the tag.  The id is an int: it costs no upload bits (``metrics.communication.payload_bits``), and a
deployment compares it with the message it planned for that node (it is not ``unplanned``), so a node cannot claim
another's id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from driftlab.simulation.seam import ClientContext, ClientUpdate, MessageCodec, ReleaseForm

CARRIER = -1  # the id of a message the server builds from a vector alone (``ReleaseForm.restore(view, None, x)``)


@dataclass(frozen=True)
class Tagged:
    """A client's message (``payload``, the wrapped algorithm's) and the id of the client that sent it."""

    payload: Any
    client_id: int


def tagged_finish(client_finish: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[Any, Any]]:
    """``client_finish`` whose message (when it sends one) is tagged with the client's id."""

    def finish(view: Any, client: Any, context: ClientContext, update: ClientUpdate) -> tuple[Any, Any]:
        state, message = client_finish(view, client, context, update)
        return state, None if message is None else Tagged(message, context.client_id)

    return finish


def tagged_form(form: ReleaseForm) -> ReleaseForm:
    """``form`` read through the tag: a tagged message releases what its payload does; a restored one keeps its id."""

    def restore(view: Any, message: Tagged | None, vector: torch.Tensor) -> Tagged:
        if message is None:
            return Tagged(form.restore(view, None, vector), CARRIER)
        return Tagged(form.restore(view, message.payload, vector), message.client_id)

    scaled = None
    if form.scaled is not None:
        scaled = lambda view, message, factor: Tagged(  # noqa: E731 - the form's own scaling, through the tag
            form.scaled(view, message.payload, factor), message.client_id
        )
    return ReleaseForm(
        release=lambda view, message: form.release(view, message.payload),
        restore=restore,
        scaled=scaled,
        size=form.size,
    )


def tagged_codec(codec: MessageCodec) -> MessageCodec:
    """How a ``Tagged`` message travels: its payload through ``codec``, its id beside it (compared with the plan)."""

    def from_wire(sent: Any, start_params: torch.Tensor) -> Tagged:
        if not isinstance(sent, Tagged) or type(sent.client_id) is not int:
            raise ValueError(f"tagged message does not fit: a {type(sent).__name__} arrived, a Tagged was expected")
        return Tagged(codec.from_wire(sent.payload, start_params), sent.client_id)

    return MessageCodec(
        lambda message: Tagged(codec.to_wire(message.payload), message.client_id),
        from_wire,
        tuple(f"payload/{name}" for name in codec.unplanned),
    )
