"""The ε column of the report's tables: ε(δ) at the end of each run, over the seeds of a method.

A run with a ``[privacy]`` section records, after every round, ``privacy_epsilon`` (ε at the run's
``privacy.delta`` for everything the server released so far: ``driftlab.privacy.accounting``; absent
when δ is unset), ``privacy_clip``, ``privacy_noise_std`` and ``privacy_clipped_fraction``. The ε of a
run is the one its last compared round recorded: the released models and aggregates of the whole run
(every round's, not only the best one's) are what the guarantee covers. A run without noise (no
``[privacy]``, or a zero noise multiplier) has ε = ∞; a private run without δ has no ε ("—": not
accounted). Seeds of one method share ε, which depends on the sampling rate q, the noise multiplier z,
the rounds T and δ only; they differ when a seed stopped early, and the tables then say so.

Reads records, never imports Opacus or torch. The privacy-utility data, figure and write-up built on these numbers
are ``privacy_utility``'s; the tables only put ε beside rounds and accuracy.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from driftlab.experiments.report.run_data import RunData

# Where the accounting is read: the config section that turns it on, and the metrics its mechanism records.
SECTION = "privacy"
EPSILON_KEY = "privacy_epsilon"
NOISE_STD_KEY = "privacy_noise_std"
METRIC_PREFIX = "privacy_"
# metrics.jsonl is strict JSON (no Infinity literal): an unbounded ε may arrive as one of these strings.
_INFINITE_TEXTS = ("inf", "+inf", "infinity", "+infinity", "∞")


def accounted_section(run: RunData) -> dict[str, Any] | None:
    """The run's ``[privacy]`` section as config.json holds it, or None for a run without one."""
    section = run.config.get(SECTION)
    return section if isinstance(section, dict) else None


def is_private(run: RunData) -> bool:
    """Whether the run had a ``[privacy]`` section (in its config, or in the metrics the mechanism wrote)."""
    if accounted_section(run) is not None:
        return True
    return any(key.startswith(METRIC_PREFIX) for record in run.records for key in record)


def recorded_number(value: Any) -> float | None:
    """A number as a record holds it: a JSON number, or ``"inf"``/``"Infinity"`` for ∞; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in _INFINITE_TEXTS:
        return math.inf
    return None


def run_epsilon(run: RunData) -> float | None:
    """ε at the run's last compared round: ∞ without noise, None for a private run that was not accounted (no δ)."""
    if not is_private(run):
        return math.inf
    last = run.records[-1] if run.records else {}
    epsilon = recorded_number(last.get(EPSILON_KEY))
    if epsilon is not None:
        return epsilon
    # No ε recorded: a run that added no noise still has ε = ∞ (clipping alone protects nothing).
    section = accounted_section(run) or {}
    unnoised = section.get("noise_multiplier") == 0 and section.get("target_epsilon") is None
    if recorded_number(last.get(NOISE_STD_KEY)) == 0 or unnoised:
        return math.inf
    return None


def run_delta(run: RunData) -> float | None:
    """The δ a private run's ε holds at (``privacy.delta``); None without one."""
    delta = (accounted_section(run) or {}).get("delta")
    return recorded_number(delta)


def run_noise_multiplier(run: RunData) -> float | None:
    """z of a private run: config.json's ``privacy.noise_multiplier``, else the one run.json records as resolved
    (a run that gave ``privacy.target_epsilon`` instead); None when neither says."""
    section = accounted_section(run) or {}
    configured = recorded_number(section.get("noise_multiplier"))
    if configured is not None and section.get("target_epsilon") is None:
        return configured
    resolved = (run.info or {}).get(SECTION)
    return recorded_number(resolved.get("noise_multiplier")) if isinstance(resolved, dict) else None


@dataclass(frozen=True)
class EpsilonSummary:
    """ε at the end of each seed's run (∞: no noise; None: not accounted) and the δ values they hold at."""

    values: tuple[float | None, ...]
    deltas: tuple[float, ...]
    private: bool  # whether any of the runs had a [privacy] section

    @property
    def accounted(self) -> bool:
        """Whether every seed has an ε (∞ counts: no noise is a known, unbounded ε)."""
        return bool(self.values) and None not in self.values

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.accounted else None  # type: ignore[arg-type]

    @property
    def low(self) -> float | None:
        return min(self.values) if self.accounted else None  # type: ignore[type-var]

    @property
    def high(self) -> float | None:
        return max(self.values) if self.accounted else None  # type: ignore[type-var]

    @property
    def seeds_differ(self) -> bool:
        """Whether the seeds spent different ε (one stopped early): the mean then hides a spread."""
        low, high = self.low, self.high
        return low is not None and high is not None and not math.isclose(low, high, rel_tol=1e-9, abs_tol=1e-12)


def epsilon_summary(runs: Sequence[RunData]) -> EpsilonSummary:
    """ε of each run (the seeds of one method) at its end, and the δ values of the private ones."""
    deltas = {delta for run in runs if (delta := run_delta(run)) is not None}
    return EpsilonSummary(
        tuple(run_epsilon(run) for run in runs), tuple(sorted(deltas)), any(is_private(run) for run in runs)
    )


def any_private(runs: Sequence[RunData]) -> bool:
    return any(is_private(run) for run in runs)


__all__ = [
    "EPSILON_KEY",
    "NOISE_STD_KEY",
    "SECTION",
    "EpsilonSummary",
    "accounted_section",
    "any_private",
    "epsilon_summary",
    "is_private",
    "recorded_number",
    "run_delta",
    "run_epsilon",
    "run_noise_multiplier",
]
