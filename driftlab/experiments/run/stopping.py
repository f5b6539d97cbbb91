"""``evaluation.stop_at``: whether a run has reached its target or stopped improving, decided from its records alone.

A rule watches one metric m over the evaluated rounds (those whose record holds it), in the rule's direction
(``StopAtConfig.direction``: max or min).  With ``value`` v it is met at the first evaluated round t with
m_t >= v (max) or m_t <= v (min).  With ``patience`` p and ``min_delta`` δ, the best value b starts at the first
evaluated round's, a round improves when m_t > b + δ (max) or m_t < b - δ (min) and then b = m_t, and the rule is met
at the evaluated round at which p evaluated rounds in a row have not improved.  Several rules: the first met.

The decision is a pure function of the records in order (``StopWatch.observe`` one at a time, ``replay`` for the
records a resume keeps), so a run killed and resumed stops at the round a run made in one go stops at: the
patience counter is rebuilt from metrics.jsonl, never checkpointed.  run.json's ``"stopped"`` entry (``Stop.info``)
is read back by ``run_directory.stopped_round``, which sweeps and reports use without importing this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from driftlab.errors import ConfigError
from driftlab.experiments.config.schema import STOP_METRICS, StopAtConfig


@dataclass(frozen=True)
class Stop:
    """A rule met at round ``met_at``: which rule and why, in words."""

    rule: StopAtConfig
    met_at: int
    reason: str

    def info(self, ended_at: int) -> dict[str, Any]:
        """run.json's ``"stopped"`` entry for a run that ended at round ``ended_at`` (after ``met_at`` only when the
        rule was tightened on a resume: rounds already run are never undone)."""
        reason = self.reason
        if ended_at != self.met_at:
            reason += f"; the rule was set after round {ended_at} had run, so the run ended there"
        return {  # under run.json's STOPPED_KEY
            "round": ended_at,
            "met_at": self.met_at,
            "metric": self.rule.metric,
            "reason": reason,
            "rule": self.rule.model_dump(exclude_none=True),
        }


@dataclass
class _Progress:
    """One rule's state over the evaluated rounds seen so far: the best value, its round, and the rounds since."""

    best: float | None = None
    best_round: int = 0
    since: int = 0


@dataclass
class StopWatch:
    """The rules of ``evaluation.stop_at`` over a run's records; ``stop`` is the first rule met (None: none yet)."""

    rules: Sequence[StopAtConfig]
    stop: Stop | None = None
    _progress: list[_Progress] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._progress = [_Progress() for _ in self.rules]

    def replay(self, records: Sequence[dict[str, Any]]) -> Stop | None:
        """Observe the records a resume keeps, in order: the rule they met, if any (the run is then finished)."""
        for record in records:
            if self.observe(record) is not None:
                break
        return self.stop

    def observe(self, record: dict[str, Any]) -> Stop | None:
        """Take a committed round's record; the stop it brings (None: the run goes on, or it stopped already)."""
        if self.stop is not None or not self.rules:
            return None
        evaluated = [key for key in STOP_METRICS if key in record]
        if not evaluated:
            return None  # a round without evaluation (evaluation.every)
        for rule, progress in zip(self.rules, self._progress, strict=True):
            if rule.metric not in record:
                raise ConfigError(
                    f"evaluation.stop_at watches {rule.metric}, but round {record['round']}'s evaluation recorded "
                    f"{', '.join(evaluated)} only; watch one of them (the run resumes with the new stop_at)"
                )
            met = _met(rule, progress, float(record[rule.metric]), int(record["round"]))
            if met is not None:
                self.stop = Stop(rule, int(record["round"]), met)
                return self.stop
        return None


def _met(rule: StopAtConfig, progress: _Progress, value: float, round_index: int) -> str | None:
    """Why ``rule`` is met by ``value`` at ``round_index`` (``progress`` updated), or None."""
    higher = rule.direction == "max"
    if rule.value is not None and (value >= rule.value if higher else value <= rule.value):
        sign = ">=" if higher else "<="
        return f"{rule.metric} = {value:.6g} {sign} {rule.value:g} at round {round_index}"
    if rule.patience is None:
        return None
    if progress.best is None:
        progress.best, progress.best_round = value, round_index
        return None
    improved = value > progress.best + rule.min_delta if higher else value < progress.best - rule.min_delta
    if improved:
        progress.best, progress.best_round, progress.since = value, round_index, 0
        return None
    progress.since += 1
    if progress.since < rule.patience:
        return None
    by = f" by more than {rule.min_delta:g}" if rule.min_delta else ""
    rounds = "evaluated round" if rule.patience == 1 else f"{rule.patience} evaluated rounds"
    return (
        f"{rule.metric} has not improved{by} on its best, {progress.best:.6g} at round {progress.best_round}, "
        f"for {rounds} (round {round_index})"
    )


__all__ = ["Stop", "StopWatch"]
