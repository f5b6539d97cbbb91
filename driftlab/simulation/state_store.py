"""Per-client algorithm state, owned by the simulator and keyed by client id.

Algorithms never keep client state themselves: the engine reads a client's
state from the store before local training and writes the new state back
after ``client_finish``.  Clients that have never trained have no entry; the
store hands out ``initial(θ0)`` for them without storing it, so memory grows
with the clients that have actually trained, not with the registered count.

``InMemoryClientStore`` is the implementation for now; a memory-mapped store
for 100k clients implements the same four methods.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol


class ClientStateStore(Protocol):
    def get(self, client_id: int) -> Any: ...

    def put(self, client_id: int, state: Any) -> None: ...

    def items(self) -> Iterator[tuple[int, Any]]: ...

    def __len__(self) -> int: ...


class InMemoryClientStore:
    """Client states in a dict.  ``initial`` builds the state of a client that has not trained yet."""

    def __init__(self, initial: Callable[[], Any] | None) -> None:
        self._initial = initial
        self._states: dict[int, Any] = {}

    def get(self, client_id: int) -> Any:
        state = self._states.get(client_id)
        if state is None and self._initial is not None:
            return self._initial()
        return state

    def put(self, client_id: int, state: Any) -> None:
        if state is not None:
            self._states[int(client_id)] = state

    def items(self) -> Iterator[tuple[int, Any]]:
        return iter(sorted(self._states.items()))

    def __len__(self) -> int:
        return len(self._states)
