"""Seeded client sampling: which registered clients are asked to train in round t.

Three modes, each drawn from (seed, ``Stream.CLIENT_SAMPLING``, round) alone:

* ``uniform``: ``m`` clients uniformly without replacement (the FedProx
  authors' code, used with ``n_k``-weighted averaging);
* ``weighted``: ``m`` independent draws with probability ``p_k = n_k / n``
  (FedProx Algorithm 2, used with a simple average).  A client drawn twice is
  trained once and counts twice (``multiplicity``);
* ``poisson``: every registered client independently with probability
  ``q = participation``, so the cohort's size varies (Binomial(N, q)) and a
  round may select nobody.  This is the sampling that client-level DP
  accounting assumes: the privacy amplification of the sampled Gaussian
  mechanism (Mironov, Talwar and Zhang 2019, "Rényi Differential Privacy of
  the Sampled Gaussian Mechanism"; Abadi et al. 2016, "Deep Learning with
  Differential Privacy"; McMahan et al. 2018 for clients) holds when each
  client's participation is an independent coin of probability q, which a
  fixed-size cohort is not.

``m = clients_per_round(participation, N)`` is the cohort of ``uniform`` and
``weighted`` and the *expected* cohort of ``poisson``.  Memory planning sizes
a round by it (``experiments.run.compatibility``: the batch plans and model copies
of a round's clients, estimates that are lower bounds of what a run holds); a
poisson round may exceed it.  What a round holds at once stays bounded
whatever its size: the engine trains a round in waves of ``setup.wave_size``
clients, a number fixed by the memory budget and the model's size, never by
the cohort, and folds each message into the server update as its client
finishes (``ordered_fold``).

Over-selection (``[system]`` ``over_selection = f``; Bonawitz et al. 2019, "Towards Federated Learning at
Scale: System Design", §2.2): ``uniform`` and ``weighted`` draw ``count = over_selected(m, f, N, mode)``
clients (draws for ``weighted``) instead of ``m``, from the same stream, so ``count = m`` is the sample
without over-selection; the engine then keeps the first ``m`` to finish.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from driftlab.randomness import Stream, generator

SAMPLING_MODES = ("uniform", "weighted", "poisson")


@dataclass(frozen=True)
class ClientSample:
    client_ids: np.ndarray  # sorted, unique
    multiplicity: np.ndarray  # how often each was drawn (all ones for "uniform")


def clients_per_round(participation: float, num_registered: int) -> int:
    """``max(1, ⌊participation · N + ½⌋)`` (halves round up, unlike Python's ``round``)."""
    return max(1, math.floor(participation * num_registered + 0.5))


def over_selected(cohort: int, over_selection: float, num_registered: int, mode: str) -> int:
    """``⌈(1 + f) · m⌉`` clients (``uniform``, at most the ``N`` registered) or draws (``weighted``) for a cohort of ``m``.

    The product is rounded to 9 decimals before the ceiling, so ``f = 0.1`` of ``m = 10`` is 11, not the 12 that
    ``1.1 · 10 = 11.000000000000002`` would give.
    """
    if over_selection < 0 or not math.isfinite(over_selection):
        raise ValueError(f"over_selection must be a finite number at least 0, got {over_selection}")
    if mode == "poisson" and over_selection > 0:
        raise ValueError(
            'a poisson cohort has no fixed size to over-select: set sampling.mode = "uniform" or "weighted", or over_selection = 0'
        )
    count = math.ceil(round((1.0 + over_selection) * cohort, 9))
    return min(count, num_registered) if mode == "uniform" else count


def sample_clients(
    seed: int,
    round_index: int,
    registered: np.ndarray,
    sizes: np.ndarray,
    participation: float,
    mode: str,
    count: int | None = None,
) -> ClientSample:
    """Draw round ``round_index``'s clients from ``registered`` (ids) with sample counts ``sizes``.

    ``count`` replaces ``m = clients_per_round(participation, N)`` as the number of ``uniform`` clients or ``weighted``
    draws (over-selection: ``over_selected``); None draws ``m``, and ``count = m`` draws exactly what None does.
    ``poisson`` draws one uniform number per registered client, in the order of ``registered``, and takes the
    clients whose number is below ``participation``: client k's draw does not depend on the others' outcomes, and
    the sample may be empty."""
    if len(registered) == 0:
        raise ValueError(f"round {round_index}: no registered clients to sample from")
    rng = generator(seed, Stream.CLIENT_SAMPLING, round_index)
    if mode == "poisson":
        if count is not None:
            raise ValueError(
                "a poisson sample has no count: each registered client is drawn with probability participation"
            )
        chosen = np.sort(np.asarray(registered)[rng.random(len(registered)) < participation])
        return ClientSample(chosen.astype(np.int64), np.ones(len(chosen), dtype=np.int64))
    if count is None:
        count = clients_per_round(participation, len(registered))
    elif count < 1 or (mode == "uniform" and count > len(registered)):
        raise ValueError(
            f"round {round_index}: cannot draw {count} clients from {len(registered)} registered ones ({mode} sampling)"
        )
    if mode == "uniform":
        chosen = np.sort(rng.choice(registered, size=count, replace=False))
        return ClientSample(chosen.astype(np.int64), np.ones(len(chosen), dtype=np.int64))
    if mode == "weighted":
        probabilities = sizes / sizes.sum()
        draws = rng.choice(registered, size=count, replace=True, p=probabilities)
        ids, counts = np.unique(draws, return_counts=True)
        return ClientSample(ids.astype(np.int64), counts.astype(np.int64))
    raise ValueError(f"unknown sampling mode {mode!r}; valid modes: {', '.join(SAMPLING_MODES)}")


@dataclass(frozen=True)
class CohortDraw:
    """Round ``round_index``'s sample among the clients the server can reach (``candidates``, the clock policy's) and
    its cohort m, the draws the server awaits: ``⌈(1 + f) m⌉`` clients (draws) with over-selection f, which a poisson
    sample refuses (its cohort is every selected client); f = 0 draws exactly the sample of a run without it."""

    seed: int
    participation: float
    mode: str  # sampling.mode
    client_sizes: np.ndarray  # n_k of every client, indexed by id
    round_index: int

    def __call__(self, candidates: np.ndarray, over_selection: float) -> tuple[ClientSample, int]:
        sizes = self.client_sizes[candidates]
        if self.mode == "poisson":
            over_selected(1, over_selection, len(candidates), self.mode)  # refuses over-selection
            sample = sample_clients(self.seed, self.round_index, candidates, sizes, self.participation, self.mode)
            return sample, int(sample.multiplicity.sum())
        cohort = clients_per_round(self.participation, len(candidates))
        count = over_selected(cohort, over_selection, len(candidates), self.mode)
        sample = sample_clients(self.seed, self.round_index, candidates, sizes, self.participation, self.mode, count)
        return sample, cohort

    def nobody(self) -> ClientSample:
        """The sample of a round with nobody to draw."""
        nobody = np.zeros(0, dtype=np.int64)
        return ClientSample(nobody, nobody)
