"""Which clients are Byzantine, and the seeded streams of the attacks' draws.

A run names its attackers either as a ``fraction`` of its N clients, drawn
once from the run seed, or as a fixed list of client ids; they attack from
round ``start_round`` on (rounds count from 1).  The set is a property of the
clients, not of the round: the same seed and N give the same set in every
round, and a round's attackers are those of the set that report in it (client
sampling decides how many that is).  Count: f = ⌊fraction · N⌋ (never more than
asked).  Draws come from ``driftlab.randomness.generator``
with (seed, stream, round, client id) alone, so a resumed run draws what an
uninterrupted one does.

The draws use ``Stream.BYZANTINE_CLIENTS``, ``Stream.ATTACK_NOISE`` and ``Stream.BACKDOOR_POISON``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from driftlab.randomness import NO_CLIENT, Stream, generator, seeded_torch_generator


@dataclass(frozen=True)
class Byzantine:
    """The attackers of a run: ``fraction`` of the clients (drawn from the seed) or the fixed ``clients``."""

    fraction: float | None = None
    clients: tuple[int, ...] | None = None
    start_round: int = 1

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.clients is None):
            raise ValueError(
                "attack: give exactly one of fraction (drawn from the seed) and clients (a fixed list of ids)"
            )
        if self.fraction is not None and not 0 <= self.fraction < 1:
            raise ValueError(f"attack.fraction must be in [0, 1), got {self.fraction}")
        if self.clients is not None:
            if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in self.clients):
                raise ValueError(f"attack.clients must be non-negative client ids, got {self.clients!r}")
            if len(set(self.clients)) != len(self.clients):
                raise ValueError(f"attack.clients lists a client twice: {self.clients!r}")
        if not isinstance(self.start_round, int) or self.start_round < 1:
            raise ValueError(f"attack.start_round must be a round number ≥ 1, got {self.start_round!r}")


def byzantine_count(fraction: float, num_clients: int) -> int:
    """f = ⌊fraction · N⌋, robust to fraction · N landing a hair below an integer (0.29 · 100)."""
    return math.floor(fraction * num_clients + 1e-9)


def byzantine_clients(settings: Byzantine, seed: int, num_clients: int) -> tuple[int, ...]:
    """The sorted ids of the run's Byzantine clients among ids 0 … N − 1."""
    if settings.clients is not None:
        outside = [c for c in settings.clients if c >= num_clients]
        if outside:
            raise ValueError(f"attack.clients names ids {outside} but the run has clients 0 … {num_clients - 1}")
        return tuple(sorted(settings.clients))
    count = byzantine_count(settings.fraction, num_clients)
    rng = generator(seed, Stream.BYZANTINE_CLIENTS, 0, NO_CLIENT)
    return tuple(sorted(int(c) for c in rng.choice(num_clients, size=count, replace=False)))


def attackers_in_round(
    settings: Byzantine, seed: int, num_clients: int, round_index: int, reporting: tuple[int, ...] | list[int]
) -> tuple[int, ...]:
    """The reporting clients that attack in round ``round_index`` (none before ``start_round``), in reporting order."""
    if round_index < settings.start_round:
        return ()
    byzantine = set(byzantine_clients(settings, seed, num_clients))
    return tuple(c for c in reporting if c in byzantine)


def noise_generator(seed: int, round_index: int, client_id: int) -> torch.Generator:
    """The torch generator of client ``client_id``'s attack noise in round ``round_index``."""
    return seeded_torch_generator(seed, Stream.ATTACK_NOISE, round_index, client_id)


def poison_generator(seed: int, round_index: int, client_id: int) -> torch.Generator:
    """The torch generator of client ``client_id``'s backdoor poisoning choices in round ``round_index``."""
    return seeded_torch_generator(seed, Stream.BACKDOOR_POISON, round_index, client_id)
