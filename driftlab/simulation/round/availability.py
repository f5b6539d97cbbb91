"""Client availability: does a selected client report full work, partial work, or nothing?

algorithms.md, "Client availability (shared by all algorithms)": per round each
selected client independently

* is inactive with probability ``p_inactive`` (``s_k = 0``: it trains nothing
  and sends nothing),
* else is incomplete with probability ``p_incomplete``: it completes only part of
  its work, ``s_k`` drawn uniformly from the whole epochs short of ``E`` (FedProx's
  stragglers do ``U{1..E−1}`` epochs of ``E``; EFL's incomplete clients do
  ``s_k < E``), or from ``{1..K−1}`` steps when the work is one epoch or a fixed
  step count ``K``,
* else completes its planned work.

The draws come from (seed, round, client id) alone, so every algorithm run with
the same seed meets the same stragglers and dropouts.  What an algorithm does
with partial work and dropouts is the algorithm's business (its docstring says).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from driftlab.randomness import Stream, generator


@dataclass(frozen=True)
class AvailabilityModel:
    inactive_probability: float = 0.0
    incomplete_probability: float = 0.0

    def __post_init__(self) -> None:
        for name in ("inactive_probability", "incomplete_probability"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.inactive_probability + self.incomplete_probability > 1.0:
            raise ValueError("inactive_probability + incomplete_probability must be at most 1")

    @property
    def always_complete(self) -> bool:
        return self.inactive_probability == 0.0 and self.incomplete_probability == 0.0


ALWAYS_AVAILABLE = AvailabilityModel()


def steps_to_do(
    model: AvailabilityModel, seed: int, round_index: int, client_id: int, planned_steps: int, steps_per_epoch: int
) -> int:
    """The steps client ``client_id`` does in round ``round_index``: 0 (inactive), fewer than planned, or all."""
    if model.always_complete:
        return planned_steps
    rng = generator(seed, Stream.AVAILABILITY, round_index, client_id)
    outcome = rng.random()
    if outcome < model.inactive_probability:
        return 0
    if outcome >= model.inactive_probability + model.incomplete_probability:
        return planned_steps
    epochs = planned_steps // steps_per_epoch if steps_per_epoch > 0 else 0
    if epochs >= 2 and planned_steps % steps_per_epoch == 0:
        return int(rng.integers(1, epochs)) * steps_per_epoch
    if planned_steps >= 2:
        return int(rng.integers(1, planned_steps))
    return planned_steps  # one step cannot be cut short


@dataclass(frozen=True)
class ClientIds:
    """Client ids listed one by one and a range ``[first, stop)`` (config ``join``/``join_range``), the range never listed.

    A range can name more ids than exist (``join_range = [0, 10**12]``); ``Membership`` checks its bounds
    against the data set's clients before it lists any, so a typo costs an error, not the memory of 10**12 ids.
    """

    ids: tuple[int, ...] = ()
    span: range = range(0)

    def __len__(self) -> int:
        return len(self.ids) + len(self.span)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self.ids, self.span)

    def __eq__(self, other: object) -> bool:
        """Equal to any ids in the same order: another ``ClientIds``, or a tuple such as ``(2, 3, 4)``."""
        if not isinstance(other, (ClientIds, tuple)) or len(self) != len(other):
            return False
        return all(mine == theirs for mine, theirs in zip(self, other, strict=True))

    def bounds(self) -> tuple[int, int] | None:
        """The smallest and largest id, found without listing the range; None when there are none."""
        ends = [*self.ids, *((self.span[0], self.span[-1]) if len(self.span) else ())]
        return (min(ends), max(ends)) if ends else None


@dataclass(frozen=True)
class MembershipEvent:
    """At the start of round ``round``, clients ``join`` register and clients ``leave`` deregister.

    A client cannot both join and leave in one round (in one event or two of the same round): which
    comes first would decide whether it is registered, so ``Membership`` refuses it.
    """

    round: int
    join: tuple[int, ...] | ClientIds = ()
    leave: tuple[int, ...] | ClientIds = ()


@dataclass(frozen=True)
class Membership:
    """Which clients are registered (``S_t``) in each round: AdaBest's non-stationary client
    sets, EFL's arrivals and departures (algorithms.md, "Client availability").

    Clients ``0 .. initially_registered − 1`` are registered in round 1 (all of
    them when ``None``); events then add and remove clients at given rounds.  The
    set of a round is a pure function of the round, so nothing needs to be
    checkpointed.
    """

    num_clients: int
    initially_registered: int | None = None
    events: tuple[MembershipEvent, ...] = ()

    def __post_init__(self) -> None:
        start = self.num_clients if self.initially_registered is None else self.initially_registered
        if not 1 <= start <= self.num_clients:
            raise ValueError(
                f"initially_registered must be in 1..{self.num_clients} (the data set's clients), got {start}"
            )
        for event in self.events:
            if event.round < 1:
                raise ValueError(f"a membership event's round must be >= 1, got {event.round}")
            for ids in (event.join, event.leave):
                for client_id in _bounds(ids):  # before any range is listed
                    if not 0 <= client_id < self.num_clients:
                        raise ValueError(
                            f"round {event.round}: client {client_id} does not exist; the data set has clients 0..{self.num_clients - 1}"
                        )
        _check_one_change_per_round(self.events)
        for t in sorted({event.round for event in self.events}):
            if len(self.registered_at(t)) == 0:
                raise ValueError(f"round {t}: the membership events leave no registered client")

    @property
    def is_static(self) -> bool:
        return self.initially_registered in (None, self.num_clients) and not self.events

    def registered_at(self, round_index: int) -> np.ndarray:
        """``S_t``, sorted client ids."""
        if self.is_static:  # the common case, once per round: no per-client set work
            return np.arange(self.num_clients, dtype=np.int64)
        start = self.num_clients if self.initially_registered is None else self.initially_registered
        registered = set(range(start))
        for event in sorted(self.events, key=lambda e: e.round):
            if event.round > round_index:
                break
            registered |= set(event.join)
            registered -= set(event.leave)
        return np.array(sorted(registered), dtype=np.int64)

    def changes_at(self, round_index: int) -> tuple[np.ndarray, np.ndarray]:
        """Clients that joined and that left at the start of round ``round_index``."""
        if all(event.round != round_index for event in self.events):
            nobody = np.zeros(0, dtype=np.int64)
            return nobody, nobody
        before = set(self.registered_at(round_index - 1).tolist())
        after = set(self.registered_at(round_index).tolist())
        return np.array(sorted(after - before), dtype=np.int64), np.array(sorted(before - after), dtype=np.int64)

    def server_after_changes(self, algorithm: Any, server: Any, clients: Any, round_index: int) -> Any:
        """The server state after the clients that join or leave at the start of round ``round_index`` are accounted
        for: the algorithm's ``client_joined``, then ``client_left``, with each such client's state from ``clients``
        (an algorithm without the hook ignores those clients)."""
        joined, left = self.changes_at(round_index)
        for hook, client_ids in ((algorithm.client_joined, joined), (algorithm.client_left, left)):
            if hook is not None:
                for client_id in client_ids.tolist():
                    server = hook(server, clients.get(client_id))
        return server


def _bounds(ids: tuple[int, ...] | ClientIds) -> tuple[int, ...]:
    """The smallest and largest of ``ids`` (none when empty), without listing a ``ClientIds`` range."""
    if isinstance(ids, ClientIds):
        bounds = ids.bounds()
        return bounds if bounds is not None else ()
    return (min(ids), max(ids)) if len(ids) else ()


def _check_one_change_per_round(events: Sequence[MembershipEvent]) -> None:
    """Refuse a client that joins and leaves in the same round (ids already checked against the data set)."""
    rounds: dict[int, tuple[set[int], set[int]]] = {}
    for event in events:
        joined, left = rounds.setdefault(event.round, (set(), set()))
        joined.update(event.join)
        left.update(event.leave)
    for round_index, (joined, left) in sorted(rounds.items()):
        both = sorted(joined & left)
        if both:
            shown = ", ".join(map(str, both[:10])) + (f", ... ({len(both)} in all)" if len(both) > 10 else "")
            raise ValueError(
                f"round {round_index}: client{'s' if len(both) > 1 else ''} {shown} both join and leave; a client changes its "
                "registration at most once per round, so remove it from the join or the leave list of that round (or move one "
                "change to another round)"
            )
