"""Per-client algorithm state, owned by the simulator and keyed by client id.

Algorithms never keep client state themselves: the engine reads a client's
state from the store before local training and writes the new state back
after ``client_finish``.  Clients that have never trained have no entry; the
store hands out ``initial(θ0)`` for them without storing it, so memory grows
with the clients that have actually trained, not with the registered count.

Writes are staged and take effect together at ``commit()``: a round that is
interrupted half way (Ctrl-C, an error in the server update or evaluation) is
``discard()``-ed, and the store still holds exactly the states of the last
completed round, which is what the runner checkpoints.

``InMemoryClientStore`` is the implementation for now; a memory-mapped store
for 100k clients implements the same six methods.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol


class ClientStateStore(Protocol):
    def get(self, client_id: int) -> Any: ...  # the committed state

    def put(self, client_id: int, state: Any) -> None: ...  # staged until commit()

    def commit(self) -> None: ...

    def discard(self) -> None: ...

    def items(self, include_staged: bool = False) -> Iterator[tuple[int, Any]]: ...  # by client id

    def __len__(self) -> int: ...


class InMemoryClientStore:
    """Client states in a dict.  ``initial`` builds the state of a client that has not trained yet."""

    def __init__(self, initial: Callable[[], Any] | None) -> None:
        self._initial = initial
        self._states: dict[int, Any] = {}
        self._staged: dict[int, Any] = {}

    def get(self, client_id: int) -> Any:
        state = self._states.get(client_id)
        if state is None and self._initial is not None:
            return self._initial()
        return state

    def put(self, client_id: int, state: Any) -> None:
        if state is not None:
            self._staged[int(client_id)] = state

    def commit(self) -> None:
        # One dict.update: a signal cannot land half way through it.
        self._states.update(self._staged)
        self._staged = {}

    def discard(self) -> None:
        self._staged = {}

    def items(self, include_staged: bool = False) -> Iterator[tuple[int, Any]]:
        """Committed states by client id; with ``include_staged``, as they will be after ``commit()``."""
        states = {**self._states, **self._staged} if include_staged else self._states
        return iter(sorted(states.items()))

    def __len__(self) -> int:
        return len(self._states)
