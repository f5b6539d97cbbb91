"""What the deployment server checks a node's reply against: the message its client would send had its model not
moved (``planned_message``), a reply of the structure to decode against (``reply_template``), the planned scalars
compared and each tensor's distance measured (``_check_planned``), and the round's bounds on those distances
(``out_of_bounds``).  The ``driftlab.deploy.server`` module docstring says why each check is there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from driftlab.deploy import wire
from driftlab.deploy.messages import TrainReply
from driftlab.simulation.backends.local_training import LocalSettings
from driftlab.simulation.seam import Algorithm, ClientContext, ClientUpdate


class _ZeroFisher:
    """The server's stand-in for a client's data when it plans a message: every computation on data the server never
    sees gives zeros, no minibatches, and local training that does not move (the message's structure is what counts)."""

    def diagonal_fisher(self, params: torch.Tensor, max_examples: int) -> torch.Tensor:  # noqa: ARG002
        return torch.zeros_like(params)

    def full_gradient(self, params: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(params)

    def train(
        self,
        params: torch.Tensor,
        correction: Any,  # noqa: ARG002 - the ClientComputation signature
        steps: int,  # noqa: ARG002
        purpose: str = "personal",  # noqa: ARG002
    ) -> tuple[torch.Tensor, int]:
        return params, 0

    def minibatches(self, steps: int, purpose: str = "local") -> list:  # noqa: ARG002
        return []

    def loss_gradient(self, params: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # noqa: ARG002
        return torch.zeros_like(params)

    @property
    def settings(self) -> LocalSettings:
        return LocalSettings(0.0)


def reply_template(algorithm: Algorithm, view: Any, context: ClientContext) -> TrainReply:
    """A reply of the structure ``context``'s client sends: the algorithm's own message for a made-up, non-trivial update."""
    params = view.params
    state = algorithm.client_state_init(params) if algorithm.client_state_init is not None else None
    moved = params + torch.linspace(-1.0, 1.0, params.numel(), dtype=params.dtype, device=params.device)
    complete = dataclasses.replace(context, available_steps=context.planned_steps)
    _, message = algorithm.client_finish(
        view, state, complete, ClientUpdate(params, moved, max(1, context.planned_steps), _ZeroFisher())
    )
    return TrainReply(algorithm.codec.to_wire(message) if message is not None else None, 0)


def planned_message(
    algorithm: Algorithm, view: Any, context: ClientContext, steps_done: int, moved: bool = False
) -> Any:
    """The message ``context``'s client sends after ``steps_done`` local steps that left its model where it started.

    Its scalars are what the server planned (``num_samples``, ``multiplicity``,
    an incomplete client's completed fraction); its tensors are where a
    client's message stands when it did not move, what a reply's distance is
    measured from (``out_of_bounds``).  ``moved``: after a made-up move instead
    (``reply_template``'s), for an algorithm that cannot finish a client that did not move.
    """
    params = view.params
    state = algorithm.client_state_init(params) if algorithm.client_state_init is not None else None
    final = (
        params + torch.linspace(-1.0, 1.0, params.numel(), dtype=params.dtype, device=params.device)
        if moved
        else params
    )
    _, message = algorithm.client_finish(view, state, context, ClientUpdate(params, final, steps_done, _ZeroFisher()))
    return message


def _check_planned(
    received: Any, planned: Any, path: str, distances: dict[str, float], unplanned: tuple[str, ...] = ()
) -> None:
    """MessageRejected where a scalar of ``received`` is not ``planned``'s; each tensor's distance from ``planned``'s into ``distances``.

    The fields ``unplanned`` (the codec's, ``MessageCodec.unplanned``: a compressed message's ``bits``,
    which the codec checked, and its compressed model, whose rebuilt field is measured) are not compared; a name
    ``outer/inner`` is a field of a nested message (a private message wrapping a compressed one).
    """
    if planned is None or received is None:
        if planned is not received:
            raise wire.MessageRejected(
                f"{path} is {'empty' if received is None else 'sent'}, the server planned it {'empty' if planned is None else 'sent'}"
            )
        return
    if isinstance(planned, torch.Tensor):
        if received.is_floating_point() and not bool(torch.isfinite(received).all()):
            raise wire.MessageRejected(f"{path}: non-finite values once rebuilt")
        if planned.is_floating_point() and bool(torch.isfinite(planned).all()):  # else no reference to measure from
            distance = float(torch.linalg.vector_norm(received.double() - planned.double()))
            distances[path] = distance if math.isfinite(distance) else math.inf
        return
    if isinstance(planned, tuple):
        if not isinstance(received, tuple) or len(received) != len(planned):
            sent = (
                f"a {type(received).__name__}"
                if not isinstance(received, tuple)
                else f"a tuple of length {len(received)}"
            )
            raise wire.MessageRejected(f"{path} is {sent}, the server planned a tuple of length {len(planned)}")
        for index, (item, planned_item) in enumerate(zip(received, planned, strict=True)):
            _check_planned(item, planned_item, f"{path}/{index}", distances)
        return
    if dataclasses.is_dataclass(planned):
        for name in (field.name for field in dataclasses.fields(planned)):
            if name not in unplanned:
                nested = tuple(entry.split("/", 1)[1] for entry in unplanned if entry.startswith(f"{name}/"))
                _check_planned(getattr(received, name), getattr(planned, name), f"{path}/{name}", distances, nested)
        return
    if type(received) is not type(planned) or received != planned:
        raise wire.MessageRejected(
            f"{path} is {_shown(received)}, the server planned {planned!r} (its registration and its plan decide it)"
        )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]} ({len(text)} characters)"


# Far above how much honest replies of a round differ, far below finite garbage (parameters x1e6, ternary scales 1e30).
DEFAULT_REPLY_BOUND = 1000.0


# The fewest nodes whose replies teach the bound's scale in a round: one node (all other nodes late, or alone in
# the run) could otherwise make its own inflated reply the scale and have a far larger one accepted later.
MIN_NODES_TO_LEARN = 2


def out_of_bounds(
    distances: dict[int, dict[str, float]],
    factor: float | None,
    scales: dict[str, float] | None = None,
    nodes: dict[int, int] | None = None,
) -> tuple[dict[int, str], dict[str, float]]:
    """The clients whose reply is out of the round's bounds, with the reason, and the tensors' scales after this round.

    A reply is out of bounds when one of its tensors is farther from where a client that did not move would send it
    (``planned_message``) than ``factor`` times the tensor's scale: the largest round median of that tensor's distances
    in any round so far, this one included (``scales`` holds those of the earlier rounds).  A round's median is over
    nodes (``nodes``: each client's node; None: each client its own), each node counted once at the lower median of
    its clients' distances, and only a round that ``MIN_NODES_TO_LEARN`` nodes or more answered has one: so no node
    alone can set or raise the scale, neither by hosting many of a round's clients nor by being the only one to
    answer a round (then the earlier rounds' scale bounds it).  The median is robust while honest nodes are more
    than half of a round's; the lower one, so that one node of two cannot set its own bound; the largest so far, so
    that a client reporting a state's change for the first time (EFL's u_k, v_k, whole) is measured against the
    rounds when most clients did.  A tensor whose scale is 0 is not bounded (nor any before a round of two nodes),
    nor is any when ``factor`` is None.
    """
    scales = dict(scales or {})
    rejected: dict[int, str] = {}
    paths = sorted({path for by_path in distances.values() for path in by_path})
    for path in paths:
        by_node: dict[int, list[float]] = {}
        for client_id, by_path in distances.items():
            if path in by_path:
                by_node.setdefault(client_id if nodes is None else nodes[client_id], []).append(by_path[path])
        if len(by_node) >= MIN_NODES_TO_LEARN:
            median = _lower_median([_lower_median(values) for values in by_node.values()])
            if math.isfinite(median):
                scales[path] = max(scales.get(path, 0.0), median)
        scale = scales.get(path, 0.0)
        if factor is None or not scale > 0:
            continue
        for client_id, by_path in distances.items():
            distance = by_path.get(path)
            if distance is not None and distance > factor * scale and client_id not in rejected:
                rejected[client_id] = (
                    f"out of bounds: {path} is {distance:.3g} from where a client that did not move sends it, more than "
                    f"{factor:g} x its scale {scale:.3g} (the largest median of the run's rounds; reply bound)"
                )
    return rejected, scales


def _lower_median(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]
