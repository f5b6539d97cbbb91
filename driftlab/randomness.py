"""Every random draw of a run derives from (experiment seed, stream, round, client id).

No generator is carried from one round to the next, so a run resumed at round
``t`` draws exactly what an uninterrupted run draws there, and two algorithms
run with the same seed see the same client samples, the same minibatches and
the same availability draws (algorithms.md, "Reproducibility rule").

Per-example randomness that must not depend on how a backend batches its work
(data augmentation) uses counter-based keys instead of a generator: a base key
per (seed, round, client id) from ``augmentation_key``, mixed with the local
step and the example's slot in its minibatch by ``example_keys`` (splitmix64,
vectorised in torch int64 arithmetic).
"""

from __future__ import annotations

import enum

import numpy as np
import torch


class Stream(enum.IntEnum):
    """Independent purposes that draw random numbers."""

    MODEL_INIT = 1
    CLIENT_SAMPLING = 2
    MINIBATCHES = 3
    AVAILABILITY = 4
    FISHER_SAMPLE = 5
    PARTITION = 6
    DATA_GENERATION = 7
    AUGMENTATION = 8
    EVALUATION_SAMPLE = 9  # the clients whose data the train loss is evaluated on
    PRIVACY_NOISE = 10  # central DP noise on a round's sum (driftlab.privacy)
    PRIVACY_LOCAL_NOISE = 11  # local DP noise on one client's message
    PRIVACY_CLIP_COUNT = 12  # the noise on adaptive clipping's count of unclipped clients
    SYSTEM_PROFILE = 13  # a client's device speed and bandwidths (driftlab.simulation.time.profiles)
    ASYNC_DISPATCH = 14  # which idle client an asynchronous run dispatches next, and its training seed
    PERSONAL_MINIBATCHES = 15  # a personalized model's own local steps (Ditto's v_k), apart from the global model's
    FINETUNE_MINIBATCHES = 16  # evaluation.finetune_steps: each client's fine-tuning of the evaluated model
    VALIDATION_SPLIT = (
        17  # which of a client's training rows are held out as its validation rows (data.validation_fraction)
    )
    BYZANTINE_CLIENTS = 18  # which clients are Byzantine (driftlab.attacks; one draw per run: round 0, no client)
    ATTACK_NOISE = 19  # a Byzantine client's Gaussian-noise update, per (round, client)
    BACKDOOR_POISON = 20  # which rows of a backdoor client's batch carry the trigger, per (round, client)
    CLIENT_SUBSET = 21  # which users data.max_clients keeps with data.client_choice = "random" (one draw per data set)
    ROBUST_BUCKETING = 22  # the permutation robust.bucket_size buckets a round's updates by (per round, no client)


NO_CLIENT = -1


def generator(seed: int, stream: Stream, round_index: int = 0, client_id: int = NO_CLIENT) -> np.random.Generator:
    """A numpy generator determined by ``(seed, stream, round, client id)`` alone.

    ``client_id=-1`` is for draws that belong to the round as a whole.
    """
    if seed < 0 or round_index < 0:
        raise ValueError(f"seed and round must be non-negative, got seed={seed}, round={round_index}")
    # SeedSequence hashes the whole tuple, so neighbouring tuples give unrelated streams.
    entropy = (int(seed), int(stream), int(round_index), int(client_id) + 1)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def torch_seed(seed: int, stream: Stream, round_index: int = 0, client_id: int = NO_CLIENT) -> int:
    """A 63-bit integer seed for ``torch.manual_seed`` from the same tuple."""
    return int(generator(seed, stream, round_index, client_id).integers(0, 2**63 - 1))


def seeded_torch_generator(
    seed: int, stream: Stream, round_index: int = 0, client_id: int = NO_CLIENT
) -> torch.Generator:
    return torch.Generator().manual_seed(torch_seed(seed, stream, round_index, client_id))


# ---------------------------------------------------------------- counter-based keys

_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment
_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB


def _signed64(value: int) -> int:
    """``value mod 2**64`` as a signed 64-bit integer (the int64 with the same bits)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 ``z``: torch's ``>>`` is arithmetic, so clear the copied sign bits."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, elementwise on an int64 tensor (wrap-around arithmetic; same bits as on uint64)."""
    z = (z ^ _shift_right(z, 30)) * _signed64(_MIX_1)
    z = (z ^ _shift_right(z, 27)) * _signed64(_MIX_2)
    return z ^ _shift_right(z, 31)


def augmentation_key(seed: int, round_index: int, client_id: int, purpose: Stream = Stream.MINIBATCHES) -> int:
    """The base key (a signed 64-bit integer) of a client's augmentation draws in a round; ``purpose`` is the
    minibatch stream of the steps they augment (a personalized model's own steps draw their own keys)."""
    if purpose == Stream.MINIBATCHES:
        rng = generator(seed, Stream.AUGMENTATION, round_index, client_id)
    else:
        rng = np.random.default_rng(
            np.random.SeedSequence(
                (int(seed), int(Stream.AUGMENTATION), int(purpose), int(round_index), int(client_id) + 1)
            )
        )
    return int(rng.integers(-(2**63), 2**63 - 1, dtype=np.int64, endpoint=True))


def example_keys(base: int | torch.Tensor, step: int | torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The 64-bit key (int64) of the example in slot ``slots`` of local step ``step`` of the client with base key ``base``.

    ``key = mix64(mix64(base + γ·(step+1)) + γ·(slot+1))`` with splitmix64's
    ``γ``: a function of the four numbers only, so a backend may compute the
    keys of any set of examples at once (arguments broadcast: e.g. ``base``
    ``[C, 1]`` and ``slots`` ``[1, B]`` give ``[C, B]`` keys).  ``slots`` is the
    example's column in the step's ``[B]`` batch-plan row.
    """
    slots = torch.as_tensor(slots, dtype=torch.int64)
    base = torch.as_tensor(base, dtype=torch.int64, device=slots.device)
    step = torch.as_tensor(step, dtype=torch.int64, device=slots.device)
    gamma = _signed64(_GOLDEN_GAMMA)
    per_step = mix64(base + (step + 1) * gamma)
    return mix64(per_step + (slots + 1) * gamma)
