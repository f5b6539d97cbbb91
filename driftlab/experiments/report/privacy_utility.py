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

This module is the report's privacy section (``SECTION``, a ``section.ReportSection``): the note on what the ε
column means under each setting with private runs (``privacy_note``), the data (``privacy_utility``), its figure
(``privacy_figure``, saved as ``privacy-utility.png`` by ``plot_privacy``), the section closing report.md
(``privacy_utility_section``) and ``privacy.csv``. The ε of a run itself is ``epsilon``'s, which the tables share.
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
    EpsilonSummary,
    any_private,
    epsilon_summary,
    recorded_number,
    run_noise_multiplier,
)
from driftlab.experiments.report.epsilon import SECTION as PRIVACY_SECTION
from driftlab.experiments.report.labels import (
    _describe,
    _differing_keys,
    algorithm_label,
    flatten_config,
    label_standalone,
    recorded_labels,
)
from driftlab.experiments.report.plots import ReportFigure, save_figure, use_log_scale
from driftlab.experiments.report.read import RunData, Setting
from driftlab.experiments.report.section import ReportSection
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


# ---------------------------------------------------------------- the figure


# The privacy-utility figure spans every setting (a panel each); no setting's file ends in "-utility".
PRIVACY_FIGURE = "privacy-utility"
PANELS_PER_ROW = 3
REFERENCE_DASHES = ("--", ":", "-.")  # the level lines of a method's noiseless runs


def privacy_figure(utility: PrivacyUtility) -> ReportFigure | None:
    """Test accuracy against ε: a panel per setting, a line per method (see ``privacy_utility``); None when no
    panel has a point with a finite ε and an accuracy."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    panels = [panel for panel in utility.panels if panel.drawable]
    if not panels:
        return None
    columns = min(PANELS_PER_ROW, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(6 * columns, 4.5 * rows))
    axes = list(figure.subplots(rows, columns, squeeze=False).flat)
    # One colour per method across panels, so a method is the same line everywhere.
    methods = list(dict.fromkeys(line.method for panel in panels for line in panel.lines))
    banded = False
    for axis, panel in zip(axes[: len(panels)], panels, strict=True):
        epsilons: list[float] = []
        for line in panel.lines:
            colour = f"C{methods.index(line.method) % 10}"
            for x, y, std in _privacy_curve(line.drawn, utility.by_rounds):
                epsilons += x
                percent = [100 * v for v in y]
                marker = "o" if len(x) <= 30 else None
                axis.plot(x, percent, color=colour, marker=marker, markersize=4, linewidth=1.5, label=line.method)
                if any(s is not None for s in std):
                    bars = [0 if s is None else 100 * s for s in std]
                    axis.errorbar(x, percent, yerr=bars, fmt="none", ecolor=colour, capsize=3, linewidth=1)
                    banded = True
            references = line.references
            for index, reference in enumerate(references):
                level = 100 * reference.accuracy.mean  # type: ignore[union-attr]  # references have an accuracy
                # Several noiseless runs of a method (no [privacy], and clipping alone) are told apart by their label.
                what = "no noise" if len(references) == 1 else reference.label or "no noise"
                dash = REFERENCE_DASHES[index % len(REFERENCE_DASHES)]
                axis.axhline(level, color=colour, linestyle=dash, linewidth=1, label=f"{line.method}, {what} (ε = ∞)")
        delta = f" (δ = {format_delta(utility.deltas)})" if len(utility.deltas) == 1 else ""
        axis.set_title(f"{panel.setting}: test accuracy vs ε")
        axis.set_xlabel(f"ε{delta}" + (" after each round" if utility.by_rounds else " at the end of the run"))
        axis.set_ylabel("test accuracy (%)" if utility.by_rounds else "final test accuracy (%)")
        if use_log_scale(epsilons):
            axis.set_xscale("log")
            # ε read as plain numbers at 1-2-5 steps (0.5, 1, 2, 5), not 2×10^0 labels crowding the minor ticks
            axis.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axis.xaxis.set_minor_formatter(NullFormatter())
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize="small")
    for axis in axes[len(panels) :]:
        axis.set_visible(False)
    return ReportFigure(PRIVACY_FIGURE, privacy_caption(utility, banded, len(panels)), figure, False)


def _privacy_curve(points, by_rounds: bool) -> list[tuple[list[float], list[float], list[float | None]]]:
    """(ε, accuracy, sample std or None) per curve of a line: its points by ε, or each point's rounds when
    ``by_rounds``."""
    if not by_rounds:
        if not points:
            return []
        return [([p.epsilon.mean for p in points], [p.accuracy.mean for p in points], [p.accuracy.std for p in points])]
    curves = []
    for point in points:
        if point.trajectory:
            epsilons, accuracies = zip(*point.trajectory, strict=True)
            curves.append((list(epsilons), list(accuracies), [None] * len(epsilons)))
        else:  # no round at which every seed recorded both: the end of the run alone
            curves.append(([point.epsilon.mean], [point.accuracy.mean], [point.accuracy.std]))
    return curves


def privacy_caption(utility: PrivacyUtility, banded: bool, panels: int) -> str:
    """What ``privacy_figure`` drew: which points, which ε, what the dashed lines and bars are, what was left out."""
    if utility.by_rounds:
        what = (
            "test accuracy vs ε after each evaluated round (one noise level per method, so each run's rounds "
            "trace the trade-off as ε grows), mean over seeds"
        )
    else:
        what = (
            "final test accuracy vs ε at the end of each run, one point per privacy configuration (the noise "
            "multipliers of a sweep axis, say), mean over seeds"
        )
        if banded:
            what += ", bars: ± 1 sample std"
    what += "; one line per method" + ("" if panels == 1 else ", one panel per setting")
    if len(utility.deltas) > 1:
        what += f"; ε at each run's δ ({format_delta(utility.deltas)})"
    if any(line.references for panel in utility.panels for line in panel.lines):
        what += "; dashed: the method without noise (ε = ∞)"
    if utility.unaccounted:
        runs = f"{utility.unaccounted} private run{'s' if utility.unaccounted != 1 else ''}"
        what += f"; {runs} without privacy.delta (no ε) not drawn"
    left_out = [panel.setting for panel in utility.panels if not panel.drawable]
    if left_out:
        what += f"; no point with a finite ε and a test accuracy in {', '.join(left_out)}"
    return what


def plot_privacy(utility: PrivacyUtility, out_dir: Path) -> tuple[ReportFigure, Path] | None:
    """Save ``privacy_figure`` as ``privacy-utility.png``; (figure, path), or None when there is nothing to draw."""
    item = privacy_figure(utility)
    if item is None:
        return None
    return item, save_figure(item, out_dir / f"{PRIVACY_FIGURE}.png")


# ---------------------------------------------------------------- the text


def format_delta(deltas: Sequence[float]) -> str:
    return ", ".join(f"{delta:g}" for delta in deltas)


def privacy_note(setting: Setting) -> list[str]:
    """What the ε column of a setting with private runs means; nothing for a setting without them."""
    if not any_private(setting.runs):
        return []
    deltas = sorted({d for runs in setting.methods.values() for d in epsilon_summary(runs).deltas})
    at = ""
    if deltas:
        at = f" at δ = {format_delta(deltas)}" if len(deltas) == 1 else f" at each run's δ ({format_delta(deltas)})"
    return [
        f"ε: client-level (ε, δ)-differential privacy{at} of everything the server released through the last round "
        "(every round's model, not only the best one), mean over seeds; ∞: no noise (no [privacy] section, or "
        "noise_multiplier 0); —: not accounted (privacy.delta unset). With central noise the server is trusted; "
        "metrics computed on clients' data (train loss, client accuracies) are diagnostics outside the guarantee.",
        "",
    ]


def privacy_utility_section(utility: PrivacyUtility, figure: tuple[str, str] | None) -> list[str]:
    """The report's privacy-utility section: what the figure ((file name, caption)) shows and where its points come
    from, or why nothing was drawn; the points are in privacy.csv either way."""
    lines = ["## Privacy and utility", ""]
    if figure is not None:
        if utility.by_rounds:
            lines.append(
                "Each method ran at one noise level, so the figure follows each run's ε (accounted after every round) "
                "against its test accuracy at that round. For one point per noise level, sweep an axis of noise "
                "multipliers: `driftlab sweep CONFIG --grid 'privacy.noise_multiplier=[0.5, 1, 2]'`."
            )
        else:
            lines.append(
                "One point per privacy configuration of a method (the values of the sweep's privacy axis, or the "
                "privacy keys that tell its runs apart): the final test accuracy against the ε spent by the end of the "
                "run, means over seeds."
            )
        name, caption = figure
        lines += ["", f"![privacy and utility: {caption}]({name})", "", f"*{caption[0].upper()}{caption[1:]}.*"]
    elif not any(panel.drawable for panel in utility.panels):
        lines.append("No private run recorded an ε beside a test accuracy (privacy.delta unset?): nothing to draw.")
    if len(lines) > 2:
        lines.append("")
    return [*lines, f"The points, one row per method and privacy configuration: `{PRIVACY_CSV}`.", ""]


# ---------------------------------------------------------------- the report's privacy section


__all__ = [
    "PRIVACY_CSV",
    "PRIVACY_FIGURE",
    "PrivacyLine",
    "PrivacyPanel",
    "PrivacyPoint",
    "PrivacyUtility",
    "format_delta",
    "plot_privacy",
    "privacy_caption",
    "privacy_figure",
    "privacy_note",
    "privacy_utility",
    "privacy_utility_section",
    "write_privacy_csv",
]

_EXPORTS = {name: globals()[name] for name in __all__}
# the report's privacy section; its parts in ``ReportSection``'s order: name, setting note, data, figure, text, CSV
SECTION = ReportSection(
    "privacy", privacy_note, privacy_utility, plot_privacy, privacy_utility_section, write_privacy_csv, _EXPORTS
)
