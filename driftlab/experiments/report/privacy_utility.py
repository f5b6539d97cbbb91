"""The privacy-utility trade-off of a report's runs: final test accuracy against ε, the figure DP papers publish.

Runs are placed by what they vary besides privacy: a panel per setting and a line per method, both
named without their privacy part, and a point per privacy configuration (a value of a sweep axis
that sets ``privacy.*`` keys only, such as ``--grid privacy.noise_multiplier=[0.5, 1, 2]``, or, for
runs outside a sweep, the ``privacy.*`` keys that tell them apart). A point is the mean over seeds of
the final test accuracy at the mean ε the seeds spent by their last round (Noble et al., "Differentially
Private Federated Learning on Heterogeneous Data", AISTATS 2022, Figure 2 plots test accuracy against
ε this way). Runs without noise (ε = ∞) cannot sit on an ε axis: they are each line's reference,
drawn level. With a single noise level per method there is one point per line, so the figure shows
instead how ε and accuracy grow together over the rounds of that run (``by_rounds``).

Data only: ``plots.privacy_figure`` draws it, ``render.privacy_utility_section`` writes it up.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from driftlab.experiments.report.epsilon import (
    EPSILON_KEY,
    PRIVACY_SECTION,
    EpsilonSummary,
    any_private,
    epsilon_summary,
    recorded_number,
    run_noise_multiplier,
)
from driftlab.experiments.report.labels import (
    _describe,
    _differing_keys,
    algorithm_label,
    flatten_config,
    label_standalone,
    recorded_labels,
)
from driftlab.experiments.report.read import RunData, Setting
from driftlab.experiments.report.tables import Spread, _csv_number, _last, epsilon_columns, spread, write_csv

PRIVACY_CSV = "privacy.csv"


@dataclass(frozen=True)
class PrivacyPoint:
    """The seeds of one method, setting and privacy configuration: ε at their end and their final test accuracy."""

    label: str  # the privacy axis values (``noise_multiplier=1``), or the privacy keys telling runs apart; "" if none
    runs: tuple[RunData, ...]
    epsilon: EpsilonSummary
    accuracy: Spread | None  # final test accuracy over seeds; None when no run evaluated it
    noise_multiplier: float | None  # z, when all seeds agree on one
    # (mean ε after the round, mean test accuracy then) at each evaluated round where every seed recorded both
    trajectory: tuple[tuple[float, float], ...]

    @property
    def drawable(self) -> bool:
        """Whether the point has a place on an ε axis: a finite ε for every seed and an accuracy."""
        high = self.epsilon.high
        return self.accuracy is not None and high is not None and math.isfinite(high)

    @property
    def no_noise(self) -> bool:
        """ε = ∞ for every seed (no [privacy], or no noise): the line's non-private reference."""
        return self.epsilon.accounted and self.epsilon.low == math.inf


@dataclass(frozen=True)
class PrivacyLine:
    method: str
    points: tuple[PrivacyPoint, ...]  # by ε, then label

    @property
    def drawn(self) -> tuple[PrivacyPoint, ...]:
        return tuple(point for point in self.points if point.drawable)

    @property
    def references(self) -> tuple[PrivacyPoint, ...]:
        return tuple(point for point in self.points if point.no_noise and point.accuracy is not None)


@dataclass(frozen=True)
class PrivacyPanel:
    setting: str
    lines: tuple[PrivacyLine, ...]

    @property
    def drawable(self) -> bool:
        return any(line.drawn for line in self.lines)


@dataclass(frozen=True)
class PrivacyUtility:
    """Every private and non-private run of a report placed on (panel, line, point); see the module docstring."""

    panels: tuple[PrivacyPanel, ...]
    by_rounds: bool  # at most one noise level per line: plot each run's ε after every round against its accuracy
    deltas: tuple[float, ...]

    @property
    def points(self) -> list[tuple[PrivacyPanel, PrivacyLine, PrivacyPoint]]:
        return [(panel, line, point) for panel in self.panels for line in panel.lines for point in line.points]

    @property
    def unaccounted(self) -> int:
        """Runs that were private but recorded no ε (no privacy.delta): they are on no ε axis."""
        return sum(len(point.runs) for _, _, point in self.points if not point.epsilon.accounted)


def privacy_utility(settings: Sequence[Setting], documents: Sequence[dict[str, Any]]) -> PrivacyUtility | None:
    """The privacy-utility data of the runs of ``settings`` (the sweep documents give their axes); None when no run
    is private."""
    runs = [run for setting in settings for run in setting.runs]
    if not any_private(runs):
        return None
    places = _sweep_places([run for run in runs if run.sweep is not None], documents)
    places.update(_standalone_places([run for run in runs if id(run) not in places]))
    grouped: dict[str, dict[str, dict[str, list[RunData]]]] = {}
    for run in runs:  # settings, then methods, in report order
        panel, line, point = places[id(run)]
        grouped.setdefault(panel, {}).setdefault(line, {}).setdefault(point, []).append(run)
    panels = tuple(
        PrivacyPanel(
            panel,
            tuple(
                PrivacyLine(line, _sorted_points([_point(label, group) for label, group in points.items()]))
                for line, points in lines.items()
            ),
        )
        for panel, lines in grouped.items()
    )
    by_rounds = all(len(line.drawn) <= 1 for panel in panels for line in panel.lines)
    deltas = tuple(
        sorted(
            {
                delta
                for panel in panels
                for line in panel.lines
                for point in line.points
                for delta in point.epsilon.deltas
            }
        )
    )
    return PrivacyUtility(panels, by_rounds, deltas)


def _point(label: str, runs: Sequence[RunData]) -> PrivacyPoint:
    multipliers = {run_noise_multiplier(run) for run in runs}
    return PrivacyPoint(
        label=label,
        runs=tuple(runs),
        epsilon=epsilon_summary(runs),
        accuracy=spread([_last(run.records, "test_accuracy") for run in runs]),
        noise_multiplier=multipliers.pop() if len(multipliers) == 1 else None,
        trajectory=_trajectory(runs),
    )


def _sorted_points(points: Sequence[PrivacyPoint]) -> tuple[PrivacyPoint, ...]:
    """Drawable points by ε (a line joins them in that order), then the rest by label."""
    return tuple(sorted(points, key=lambda p: (not p.drawable, p.epsilon.mean if p.drawable else 0.0, p.label)))


def _trajectory(runs: Sequence[RunData]) -> tuple[tuple[float, float], ...]:
    """(mean ε after round t, mean test accuracy at t) over the rounds at which every seed recorded a finite pair."""
    by_round: dict[int, list[tuple[float, float]]] = {}
    for run in runs:
        for record in run.records:
            epsilon, accuracy = recorded_number(record.get(EPSILON_KEY)), record.get("test_accuracy")
            if (
                epsilon is not None
                and math.isfinite(epsilon)
                and isinstance(accuracy, (int, float))
                and math.isfinite(accuracy)
            ):
                by_round.setdefault(record["round"], []).append((epsilon, float(accuracy)))
    return tuple(
        (statistics.fmean(e for e, _ in pairs), statistics.fmean(a for _, a in pairs))
        for _, pairs in sorted(by_round.items())
        if len(pairs) == len(runs)
    )


# ---------------------------------------------------------------- where a run goes: (panel, line, point)


def _is_privacy_assignment(assignment: Any) -> bool:
    key = str(assignment).split("=", 1)[0].strip()
    return key == PRIVACY_SECTION or key.startswith(PRIVACY_SECTION + ".")


def _is_privacy_axis(axis: dict[str, Any]) -> bool:
    """An axis whose values set ``privacy.*`` keys and nothing else: its values are points, not settings or methods."""
    assignments = [a for value in axis.get("values") or [] if isinstance(value, dict) for a in value.get("set") or []]
    return bool(assignments) and all(_is_privacy_assignment(a) for a in assignments)


def _sweep_places(runs: Sequence[RunData], documents: Sequence[dict[str, Any]]) -> dict[int, tuple[str, str, str]]:
    """(panel, line, point) of each sweep run, from its sweep's axes: the labels of its privacy axes make the point.

    sweep.json names each run's setting and method by its axis values' labels joined with ", "; the axis values
    behind them are found by rebuilding every combination. A run no combination matches (or more than one, told
    apart differently) keeps its setting and method whole, with no point label.
    """
    places: dict[int, tuple[str, str, str]] = {}
    by_name = {str(document.get("name")): document for document in documents}
    for name, document in by_name.items():
        members = [run for run in runs if run.sweep == name]
        if not members:
            continue
        axes = [
            axis
            for axis in document.get("axes") or []
            if isinstance(axis, dict) and isinstance(axis.get("values"), list)
        ]
        candidates: dict[tuple[str, str], set[tuple[str, str, str]]] = {}
        for combo in itertools.product(
            *([(axis, value) for value in axis["values"] if isinstance(value, dict)] for axis in axes)
        ):
            labels = {
                role: [
                    (str(value.get("label")), _is_privacy_axis(axis))
                    for axis, value in combo
                    if axis.get("role") == role
                ]
                for role in ("setting", "method")
            }
            key = (
                ", ".join(label for label, _ in labels["setting"]) or name,
                ", ".join(label for label, _ in labels["method"]),
            )
            candidates.setdefault(key, set()).add(
                (
                    ", ".join(label for label, private in labels["setting"] if not private),
                    ", ".join(label for label, private in labels["method"] if not private),
                    ", ".join(
                        label for axis, value in combo if _is_privacy_axis(axis) for label in [str(value.get("label"))]
                    ),
                )
            )
        has_method_axes = any(axis.get("role") == "method" for axis in axes)
        for run in members:
            found = candidates.get((run.setting, run.method if has_method_axes else ""), set())
            if len(found) != 1:
                places[id(run)] = (run.setting, run.method, "")
                continue
            setting, method, point = next(iter(found))
            if not method:  # no method axis besides privacy ones: the algorithm names the line
                method = (
                    algorithm_label(flatten_config(run.config), recorded_labels([run]))
                    if has_method_axes
                    else run.method
                )
            places[id(run)] = (setting or name, method, point)
    return places


def _standalone_places(runs: Sequence[RunData]) -> dict[int, tuple[str, str, str]]:
    """(panel, line, point) of runs outside a sweep: their labels as if no run had a [privacy] section, and the
    ``privacy.*`` keys that tell apart the runs of one line (``privacy.noise_multiplier=0.5``; "no privacy")."""
    if not runs:
        return {}
    stripped = [
        dataclasses.replace(run, config={k: v for k, v in run.config.items() if k != PRIVACY_SECTION}) for run in runs
    ]
    label_standalone(stripped)
    lines: dict[tuple[str, str], list[tuple[RunData, dict[str, Any]]]] = {}
    for run, bare in zip(runs, stripped, strict=True):
        keys = {k: v for k, v in flatten_config(run.config).items() if k.startswith(PRIVACY_SECTION + ".")}
        lines.setdefault((bare.setting, bare.method), []).append((run, keys))
    places = {}
    for (setting, method), members in lines.items():
        # Told apart among the private runs; a run without [privacy] is "no privacy", not "privacy.clip=None, ...".
        differing = _differing_keys([keys for _, keys in members if keys])
        for run, keys in members:
            # "[privacy]": a private run whose own keys do not tell it apart (another run has one key more)
            point = (_describe(keys, differing) or "[privacy]") if keys else "no privacy"
            places[id(run)] = (setting, method, point)
    return places


# ---------------------------------------------------------------- CSV


PRIVACY_COLUMNS = (
    "setting",
    "method",
    "point",
    "seeds",
    "noise_multiplier",
    "final_accuracy_mean",
    "final_accuracy_std",
)


def write_privacy_csv(out: Path, utility: PrivacyUtility) -> Path:
    """``privacy.csv``: one row per point (the figure's data); ε as in the tables (``inf``: no noise; empty: not
    accounted)."""
    rows = [
        [
            panel.setting,
            line.method,
            point.label,
            len(point.runs),
            _csv_number(point.noise_multiplier),
            _csv_number(point.accuracy.mean) if point.accuracy else "",
            _csv_number(point.accuracy.std) if point.accuracy else "",
            *epsilon_columns(point.epsilon),
        ]
        for panel, line, point in utility.points
    ]
    return write_csv(out / PRIVACY_CSV, [*PRIVACY_COLUMNS, "epsilon", "epsilon_min", "epsilon_max", "delta"], rows)


__all__ = [
    "PRIVACY_CSV",
    "PrivacyLine",
    "PrivacyPanel",
    "PrivacyPoint",
    "PrivacyUtility",
    "privacy_utility",
    "write_privacy_csv",
]
