"""The instability warning: a run whose evaluated train loss stays above its initial model's.

The divergence tests stop only real blow-ups (a loss 1000 times the initial one, a norm 1000
times the model's starting scale, a non-finite number).  A run whose loss hovers far above
where it started (``client.lr=5`` on the synthetic preset: 199.5 against 2.996 after 20
rounds, accuracy swinging between 9% and 65%) finishes "complete" all the same; it
deserves a warning, given once per run:

- the round's record in metrics.jsonl gets ``"instability": "<one-line message>"`` in the
  round where it is first detected,
- run.json gets ``"instability": {"round": R, "message": "..."}``,
- the progress output (or, without one, a ``UnstableRunWarning``) says so.

The rule (``[evaluation]`` keys): the run is flagged in an evaluated round ``t`` when its
train loss has been above ``instability_factor`` times the initial model's at every
evaluation from round ``s`` to ``t`` and ``t - s + 1 >= instability_rounds``.  With
evaluation every round that is ``instability_rounds`` rounds in a row; with sparser
evaluation it is every evaluation over at least that many rounds.

A resumed run replays its records (``InstabilityWatch.replay``): a record that already
holds the flag means it is never given again, and the streak of rounds above the
threshold goes on where it was, so a resumed run is flagged in the very round an
uninterrupted one would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

INSTABILITY_KEY = "instability"  # the key of the flag in a round's record and in run.json


class UnstableRunWarning(UserWarning):
    """A run's evaluated train loss stayed above its initial model's (``driftlab.experiments.run.instability``)."""


@dataclass
class InstabilityWatch:
    """Watches a run's records for the instability rule; ``initial_loss`` is asked for only when a record has a train loss."""

    factor: float
    rounds: int  # 0: off
    initial_loss: Callable[[], float | None]  # the initial model's train loss (computed once, on first use)
    streak_start: int | None = None  # the first evaluated round of the current run of losses above the threshold
    flagged: dict[str, Any] | None = None  # {"round": R, "message": ...} once flagged

    def replay(self, records: Iterable[dict[str, Any]]) -> None:
        """Take in the records of an earlier process (a resume): the streak, and the flag if one was given."""
        for record in records:
            if isinstance(record.get(INSTABILITY_KEY), str):
                self.flagged = {"round": record["round"], "message": record[INSTABILITY_KEY]}
            else:
                self._track(record)

    def observe(self, record: dict[str, Any]) -> str | None:
        """The message when ``record``'s round is the first that shows instability, else None."""
        if self.flagged is not None or not self._track(record):
            return None
        start, round_index = self.streak_start, record["round"]
        if round_index - start + 1 < self.rounds:
            return None
        initial = self.initial_loss()
        since = (
            f"in round {round_index}"
            if start == round_index
            else f"at every evaluation of rounds {start}-{round_index}"
        )
        message = (
            f"unstable run: the train loss was above {self.factor:g} times the initial model's {initial:.4g} {since} "
            f"(now {record['train_loss']:.4g}); the run goes on, but lower client.lr (or server.lr) or set client.clip_norm "
            f"to make it converge (evaluation.instability_factor and evaluation.instability_rounds set this warning; 0 rounds = off)"
        )
        self.flagged = {"round": round_index, "message": message}
        return message

    def _track(self, record: dict[str, Any]) -> bool:
        """Update the streak from an evaluated record; whether the record's loss is above the threshold."""
        loss = record.get("train_loss")
        if not self.rounds or not isinstance(loss, (int, float)):
            return False  # off, or a round without evaluation: the streak neither grows nor breaks
        initial = self.initial_loss()
        if initial is None or initial <= 0 or loss <= self.factor * initial:
            self.streak_start = (
                None  # an objective that can be negative (the quadratic clients') has no scale to compare with
            )
            return False
        if self.streak_start is None:
            self.streak_start = record["round"]
        return True


__all__ = ["INSTABILITY_KEY", "InstabilityWatch", "UnstableRunWarning"]
