"""What the backends' tests share: a round of client tasks over a few unequal toy clients.

The backend tests (augmentation, modes, objectives, buffers, vectorized, stacked) each train a round of clients whose
sizes differ (short, padded last batches; unequal step counts); the way they lay the clients' rows out and plan their
batches stands here once, so a test names only what it changes.  Nothing here is used by a run.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from driftlab.simulation.backends.local_training import ClientTask, batch_plan, steps_for_epochs
from driftlab.simulation.seam import NO_CORRECTION


def client_tasks(
    sizes: Sequence[int],
    batch_size: int,
    seed: int,
    corrections: Sequence | None = None,
    steps: Callable[[int, int], int] | None = None,
    round_index: int = 1,
    first_row: int = 0,
    shuffled: bool = False,
    augment_key: Callable[[int], int] | None = None,
    stop_gamma: float | None = None,
) -> list[ClientTask]:
    """One round's tasks for clients of ``sizes`` examples whose rows follow each other from ``first_row``.

    Client ``k`` runs ``steps(k, its steps per epoch)`` steps (two epochs unless told) of
    ``batch_plan(seed, round_index, k, size, batch_size, ·)`` with ``corrections[k]`` (``NO_CORRECTION`` for all
    without), its rows in a seeded order of its own with ``shuffled``, its per-step key ``augment_key(k)`` (0 without)
    and, with ``stop_gamma``, γ-inexact stopping checked after every epoch.
    """
    corrections = [NO_CORRECTION] * len(sizes) if corrections is None else corrections
    tasks, offset = [], first_row
    for client_id, (size, correction) in enumerate(zip(sizes, corrections, strict=True)):
        per_epoch = steps_for_epochs(size, batch_size, 1)
        count = 2 * per_epoch if steps is None else steps(client_id, per_epoch)
        rows = torch.arange(offset, offset + size)
        if shuffled:
            rows = rows[torch.randperm(size, generator=torch.Generator().manual_seed(client_id))]
        tasks.append(
            ClientTask(
                client_id,
                rows,
                batch_plan(seed, round_index, client_id, size, batch_size, count),
                correction,
                stop_gamma=stop_gamma,
                steps_per_epoch=0 if stop_gamma is None else per_epoch,
                augment_key=0 if augment_key is None else augment_key(client_id),
            )
        )
        offset += size
    return tasks
