"""The report's figures: curves per method, the mean over seeds with a ± one-sample-std band.

Test accuracy against rounds and against bits sent (with a line per target),
the mean client test accuracy of each client's own model and of the server model on the clients' splits
(personalized runs, issue 26), training loss (and, for the quadratic, the distance to the minimizer), ``‖h‖``
and ``‖θ‖`` per round (AdaBest Figure 1), and FedProx's dissimilarity ``B(θ)²``
and gradient variance (Li et al. 2020, Definition 2, Figure 4). With timed runs
(``[system]``), test accuracy and training loss against simulated time, the axis
FedBuff (Nguyen et al. 2022) compares synchronous and asynchronous training on;
an asynchronous run's rounds are server updates, and its legend entry and the
round axis say so. Each caption names what its figure draws. matplotlib is
imported when a figure is drawn.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from driftlab.experiments.report.read import RunData, Setting
from driftlab.experiments.report.render import duration_unit, format_target
from driftlab.experiments.sweep.directory import slug

# Target lines: a dash pattern and a grey each, told apart in the legend, in print and without colour.
TARGET_STYLES = (
    ("dotted", ":", "black"),
    ("dashed", "--", "dimgray"),
    ("dash-dotted", "-.", "black"),
    ("long-dashed", (0, (8, 4)), "dimgray"),
    ("densely dotted", (0, (1, 1)), "black"),
)
BAND_LEGEND = "shaded: ± 1 sample std over seeds"
BAND_NOTE = (
    "Lines are means over seeds; shaded bands are the mean ± one sample standard deviation over seeds "
    "(ddof = 1, the ± of the tables), drawn where at least two seeds recorded the value."
)
# Short names for captions, long ones for the panels' titles.
PANEL_NAMES = {
    "drift_norm": "drift norm",
    "model_norm": "‖θ‖",
    "dissimilarity_b2": "B(θ)²",
    "gradient_variance": "gradient variance",
}


@dataclass(frozen=True)
class Series:
    """One method's curve: x, the mean over seeds, and the sample standard deviation (None where under 2 seeds recorded it)."""

    x: list[float]
    mean: list[float]
    std: list[float | None]


@dataclass
class ReportFigure:
    """A figure of one setting, built but not yet saved, and a caption saying what it draws."""

    suffix: str  # the file is <setting>-<suffix>.png
    caption: str
    figure: Any  # matplotlib.figure.Figure
    banded: bool  # whether it shows a ± std band (BAND_NOTE applies)


def _series(runs: Sequence[RunData], key: str, x_key: str = "round") -> Series:
    """Mean and sample standard deviation of ``key`` over seeds at each round where some seed recorded it.

    ``x_key="bits"`` puts the round at the cumulative bits up and down (mean over seeds at that round);
    ``x_key="time"`` at the simulated ``time_end`` of the round (mean over the timed seeds; untimed runs
    have no point). Against rounds and time the curve starts at round 0, time 0, with the initial model's
    value where run.json records it (``RunData.initial``); a log axis of bits has no 0, so that one starts
    at round 1.
    """
    by_round: dict[int, list[tuple[float, float]]] = {}
    for run in runs:
        if x_key == "time" and not run.timed:
            continue
        start = run.initial.get(key)
        if x_key in ("round", "time") and start is not None and math.isfinite(start):
            by_round.setdefault(0, []).append((0, start))
        bits = 0
        for record in run.records:
            bits += record["upload_bits"] + record["download_bits"]
            value = record.get(key)
            if (
                value is None
                or not math.isfinite(value)
                or (x_key == "time" and not isinstance(record.get("time_end"), (int, float)))
            ):
                continue
            x = bits if x_key == "bits" else record["time_end"] if x_key == "time" else record["round"]
            by_round.setdefault(record["round"], []).append((x, value))
    series = Series([], [], [])
    for round_ in sorted(by_round):
        points = by_round[round_]
        values = [v for _, v in points]
        series.x.append(statistics.fmean(x for x, _ in points))
        series.mean.append(statistics.fmean(values))
        series.std.append(statistics.stdev(values) if len(values) >= 2 else None)
    return series


# Method labels that already say a run is asynchronous (the report names asynchronous FedAvg "FedBuff").
ASYNCHRONOUS_WORDS = ("async", "fedbuff")


def curve_label(method: str, runs: Sequence[RunData]) -> str:
    """A method's legend entry: its label, its seeds when several, and "asynchronous" for a FedBuff run whose label
    does not say so already (its rounds are server updates)."""
    label = method + (f" ({len(runs)} seeds)" if len(runs) > 1 else "")
    if any(run.asynchronous for run in runs) and not any(word in method.lower() for word in ASYNCHRONOUS_WORDS):
        label += ", asynchronous"
    return label


def rounds_name(setting: Setting) -> str:
    """What a setting's "rounds" are: communication rounds, an asynchronous run's server updates, or both."""
    kinds = {run.asynchronous for run in setting.runs}
    if kinds == {True}:
        return "server updates"
    return "rounds (asynchronous runs: server updates)" if True in kinds else "rounds"


def round_axis_label(setting: Setting) -> str:
    kinds = {run.asynchronous for run in setting.runs}
    if kinds == {True}:
        return "server update"
    return "communication round (asynchronous runs: server update)" if True in kinds else "communication round"


def _draw(
    axis, setting: Setting, key: str, x_key: str = "round", scale: float = 1.0, x_scale: float = 1.0
) -> tuple[bool, bool]:
    """Plot ``key`` per method, the mean over seeds with a ± sample-std band; whether a line and whether a band were drawn.

    ``x_scale`` multiplies x (simulated seconds into the axis's unit)."""
    drawn = banded = False
    for index, (method, runs) in enumerate(setting.methods.items()):
        series = _series(runs, key, x_key)
        if not series.x:
            continue
        if x_scale != 1.0:
            series = Series([x_scale * x for x in series.x], series.mean, series.std)
        (line,) = axis.plot(
            series.x,
            [scale * m for m in series.mean],
            label=curve_label(method, runs),
            linewidth=1.5,
            # The method's own colour of the default cycle, so that it keeps it in a panel where another has no line.
            color=f"C{index % 10}",
            # Markers show where the measurements are when they are sparse (evaluation or dissimilarity every N rounds).
            marker="o" if len(series.x) <= 30 else None,
            markersize=3,
        )
        if any(std is not None for std in series.std):
            # NaN leaves a gap where fewer than two seeds recorded the value.
            low = [math.nan if s is None else scale * (m - s) for m, s in zip(series.mean, series.std, strict=True)]
            high = [math.nan if s is None else scale * (m + s) for m, s in zip(series.mean, series.std, strict=True)]
            axis.fill_between(series.x, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
            banded = True
        drawn = True
    return drawn, banded


def _legend(axis, banded: bool) -> None:
    from matplotlib.patches import Patch

    handles, labels = axis.get_legend_handles_labels()
    if banded:
        handles.append(Patch(facecolor="gray", alpha=0.3, label=BAND_LEGEND))
        labels.append(BAND_LEGEND)
    axis.legend(handles, labels, fontsize="small")


def _drawable(setting: Setting, key: str, timed: bool = False) -> bool:
    """Whether some run (some timed run, with ``timed``) recorded a finite ``key`` (what ``_draw`` needs to draw a line)."""
    return any(
        isinstance(r.get(key), (int, float))
        and math.isfinite(r[key])
        and (not timed or isinstance(r.get("time_end"), (int, float)))
        for run in setting.runs
        if run.timed or not timed
        for r in run.records
    )


def time_axis(setting: Setting) -> tuple[str, float]:
    """(unit, units per simulated second) of a setting's time axis: s, min or h, chosen by its longest timed run."""
    span = max((run.simulated_time or 0.0 for run in setting.runs if run.timed), default=0.0)
    unit, per_unit = duration_unit(span)
    return unit, 1.0 / per_unit


# A log axis only pays when the values span at least this factor; over a narrower range it shows
# labels like 2.2975×10^0 and no more than a linear one would.
LOG_SPAN = 10.0
# A target line is drawn only within this many percentage points of the best accuracy drawn: an 80%
# line over curves at 10% squeezes the curves flat against the bottom of the axis.
TARGET_REACH_POINTS = 10.0


def use_log_scale(values: Sequence[float]) -> bool:
    """Whether a log axis suits ``values``: all positive and spanning at least ``LOG_SPAN``."""
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return bool(finite) and min(finite) > 0 and max(finite) / min(finite) >= LOG_SPAN


def drawn_targets(targets: Sequence[float], best_accuracy: float | None) -> tuple[list[float], list[float]]:
    """(targets drawn, targets left to a note): a target is drawn when within ``TARGET_REACH_POINTS`` of the best accuracy (fractions)."""
    if best_accuracy is None:
        return [], list(targets)
    reach = best_accuracy + TARGET_REACH_POINTS / 100
    return [t for t in targets if t <= reach], [t for t in targets if t > reach]


def round_axis_limits(last_round: int) -> tuple[float, float]:
    """The round axis spans round 0 (the initial model) to the last round, at least one round wide, with a
    margin of 4% each side so that the markers at both ends are drawn whole."""
    span = float(max(1, last_round))
    return (-0.04 * span, 1.04 * span)


def _values(setting: Setting, key: str) -> list[float]:
    return [
        r[key]
        for run in setting.runs
        for r in run.records
        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
    ]


def target_style(index: int) -> tuple[str, Any, str, float]:
    """(name, dash pattern, colour, width) of the ``index``-th target line; every index gets its own."""
    name, dash, colour = TARGET_STYLES[index % len(TARGET_STYLES)]
    extra = index // len(TARGET_STYLES)
    return (f"{'thick ' * extra}{name}", dash, colour, 1.2 + 1.0 * extra)


def _captioned(what: str, banded: bool) -> str:
    return what + ("; lines: mean over seeds, shaded: ± 1 sample std" if banded else "")


def setting_figures(setting: Setting, targets: Sequence[float]) -> list[ReportFigure]:
    """The figures of one setting whose data exists, each captioned from what was actually drawn on it."""
    # The object-oriented API needs no pyplot state or backend switch, so a report made
    # inside a notebook leaves its plotting setup alone.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    figures: list[ReportFigure] = []

    rounds = rounds_name(setting)
    time_unit, time_scale = time_axis(setting)

    def panel(
        axis, key: str, title: str, ylabel: str, x_key: str = "round", scale: float = 1.0, log_y: bool = False
    ) -> bool:
        """Draw one quantity on ``axis``; whether it has a ± std band."""
        _, banded = _draw(axis, setting, key, x_key, scale, time_scale if x_key == "time" else 1.0)
        axis.set_title(title)
        axis.set_xlabel(
            "cumulative bits sent (upload + download)"
            if x_key == "bits"
            else f"simulated time ({time_unit})"
            if x_key == "time"
            else round_axis_label(setting)
        )
        axis.set_ylabel(ylabel)
        if x_key == "bits":
            axis.set_xscale("log")
        elif x_key == "time":
            axis.xaxis.set_major_formatter(ScalarFormatter(useOffset=False))  # plain numbers in the chosen unit
            axis.ticklabel_format(axis="x", style="plain", useOffset=False)
        else:
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
            axis.set_xlim(*round_axis_limits(max((run.rounds_done for run in setting.runs), default=1)))
        if log_y and use_log_scale(_values(setting, key)):
            axis.set_yscale("log")
        else:
            axis.yaxis.set_major_formatter(ScalarFormatter(useOffset=False))  # plain numbers, no ×10^k offset
            axis.ticklabel_format(axis="y", style="plain", useOffset=False)
        axis.grid(alpha=0.3, which="both")
        return banded

    if setting.is_classifier and _drawable(setting, "test_accuracy"):
        for suffix, x_key, what in (("accuracy", "round", rounds), ("accuracy-vs-bits", "bits", "bits sent")):
            figure = Figure(figsize=(7, 4.5))
            axis = figure.subplots()
            banded = panel(
                axis,
                "test_accuracy",
                f"{setting.label}: test accuracy vs {what}",
                "test accuracy (%)",
                x_key,
                scale=100,
            )
            styles = []
            accuracies = _values(setting, "test_accuracy")
            shown, beyond = drawn_targets(targets, max(accuracies) if accuracies else None)
            for index, target in enumerate(targets):
                if target not in shown:
                    continue
                name, dash, colour, width = target_style(index)
                axis.axhline(
                    100 * target, color=colour, linestyle=dash, linewidth=width, label=f"target {format_target(target)}"
                )
                styles.append(f"{format_target(target)} {name}")
            _legend(axis, banded)
            caption = _captioned(f"test accuracy vs {what}", banded)
            if styles:
                caption += f"; target {'lines' if len(styles) > 1 else 'line'}: {', '.join(styles)}"
            if beyond:
                listed = ", ".join(format_target(t) for t in beyond)
                caption += f"; target {listed} not drawn: far above the best accuracy any run recorded ({100 * max(accuracies):.1f}%)"
            figures.append(ReportFigure(suffix, caption, figure, banded))
    if setting.is_classifier and _drawable(setting, "personal_test_accuracy_mean"):
        figures.append(personal_figure(setting, rounds, panel))
    # Training loss is what FedProx's Figure 1 plots; for the quadratic, also the distance to x*.
    curves = [("train_loss", "loss", "train loss")]
    if not setting.is_classifier:
        curves.append(("distance_to_minimizer", "distance", "distance to the minimizer ‖θ − x*‖"))
    for key, suffix, ylabel in curves:
        if _drawable(setting, key):
            figure = Figure(figsize=(7, 4.5))
            axis = figure.subplots()
            # Log scale only when every value is positive: the quadratic's objective ½zx² − x is negative near x*.
            banded = panel(axis, key, f"{setting.label}: {ylabel} vs {rounds}", ylabel, log_y=True)
            _legend(axis, banded)
            figures.append(ReportFigure(suffix, _captioned(f"{ylabel} vs {rounds}", banded), figure, banded))

    for suffix, panels in (
        (
            "norms",
            (
                ("drift_norm", "drift norm (‖c‖, ‖mean λ_k‖ or ‖h‖: docs/algorithms.md)", "drift norm"),
                ("model_norm", "norm of the server model ‖θ‖", "‖θ‖"),
            ),
        ),
        (
            "dissimilarity",
            (
                ("dissimilarity_b2", "dissimilarity B(θ)²", "B(θ)²"),
                ("gradient_variance", "gradient variance E‖∇F_k − ∇f‖²", "E‖∇F_k − ∇f‖²"),
            ),
        ),
    ):
        present = [(key, title, ylabel) for key, title, ylabel in panels if _drawable(setting, key)]
        if not present:
            continue
        figure = Figure(figsize=(6 * len(present), 4.5))
        axes = figure.subplots(1, len(present), squeeze=False)[0]
        banded = False
        for axis, (key, title, ylabel) in zip(axes, present, strict=True):
            panel_banded = panel(axis, key, f"{setting.label}: {title}", ylabel, log_y=True)
            _legend(axis, panel_banded)
            banded = banded or panel_banded
        what = " and ".join(PANEL_NAMES[key] for key, _, _ in present) + f" vs {rounds}"
        figures.append(ReportFigure(suffix, _captioned(what, banded), figure, banded))
    timed = time_figure(setting, targets, panel)
    if timed is not None:  # beside the accuracy figures: time is the other axis runs are compared on
        figures.insert(sum(f.suffix in ("accuracy", "accuracy-vs-bits") for f in figures), timed)
    return figures


def personal_figure(setting: Setting, rounds: str, panel) -> ReportFigure:
    """The mean over clients of their test accuracy (issue 26; EFL's BMTA is its best point): each client's own model
    on its own split, and the server model on the clients' splits, a panel each. ``panel`` draws one quantity
    (``setting_figures``). A method without own models has no line in the first panel: its clients' own model is the
    server model of the second."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.5))
    axes = figure.subplots(1, 2)
    banded = False
    for axis, key, title in (
        (axes[0], "personal_test_accuracy_mean", "own model, own split"),
        (axes[1], "client_test_accuracy_mean", "server model, clients' splits"),
    ):
        panel_banded = panel(axis, key, f"{setting.label}: {title}", "mean client test accuracy (%)", scale=100)
        _legend(axis, panel_banded)
        banded = banded or panel_banded
    what = (
        f"mean client test accuracy vs {rounds}: each client's own model on its own test split (left; methods that keep "
        "personal models or fine-tune) and the server model on the clients' splits (right)"
    )
    return ReportFigure("personal", _captioned(what, banded), figure, banded)


def time_figure(setting: Setting, targets: Sequence[float], panel) -> ReportFigure | None:
    """Test accuracy (with the target lines) and training loss against simulated time, a panel each, when some run
    of the setting is timed; None otherwise. ``panel`` draws one quantity (``setting_figures``)."""
    from matplotlib.figure import Figure

    present = [
        (key, ylabel, scale, log_y)
        for key, ylabel, scale, log_y in (
            ("test_accuracy", "test accuracy (%)", 100.0, False),
            ("train_loss", "train loss", 1.0, True),
        )
        if (key != "test_accuracy" or setting.is_classifier) and _drawable(setting, key, timed=True)
    ]
    if not present:
        return None
    unit, _ = time_axis(setting)
    figure = Figure(figsize=(6 * len(present), 4.5))
    axes = figure.subplots(1, len(present), squeeze=False)[0]
    banded, styles = False, []
    for axis, (key, ylabel, scale, log_y) in zip(axes, present, strict=True):
        name = ylabel.removesuffix(" (%)")
        panel_banded = panel(axis, key, f"{setting.label}: {name} vs simulated time", ylabel, "time", scale, log_y)
        if key == "test_accuracy":
            accuracies = _values(setting, "test_accuracy")
            shown, _ = drawn_targets(targets, max(accuracies) if accuracies else None)
            for index, target in enumerate(targets):
                if target in shown:
                    line_name, dash, colour, width = target_style(index)
                    axis.axhline(
                        100 * target,
                        color=colour,
                        linestyle=dash,
                        linewidth=width,
                        label=f"target {format_target(target)}",
                    )
                    styles.append(f"{format_target(target)} {line_name}")
        _legend(axis, panel_banded)
        banded = banded or panel_banded
    names = " and ".join(ylabel.removesuffix(" (%)") for _, ylabel, _, _ in present)
    caption = _captioned(f"{names} vs simulated time ({unit}; a point per round at its end, mean over seeds)", banded)
    if styles:
        caption += f"; target {'lines' if len(styles) > 1 else 'line'}: {', '.join(styles)}"
    untimed = [method for method, runs in setting.methods.items() if not any(run.timed for run in runs)]
    if untimed:
        caption += f"; untimed runs not drawn: {', '.join(untimed)}"
    return ReportFigure("time", caption, figure, banded)


def plot_setting(
    setting: Setting, out_dir: Path, targets: Sequence[float], stem: str | None = None
) -> list[tuple[ReportFigure, Path]]:
    """Save the figures of one setting as ``<stem>-<suffix>.png`` (stem: the setting's slug); (figure, path) of each."""
    written = []
    for item in setting_figures(setting, targets):
        path = out_dir / f"{stem or slug(setting.label)}-{item.suffix}.png"
        save_figure(item, path)
        written.append((item, path))
    return written


def save_figure(item: ReportFigure, path: Path) -> Path:
    """Lay ``item``'s figure out and save it as a PNG at ``path`` (120 dpi, the report's every figure)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    item.figure.tight_layout()
    FigureCanvasAgg(item.figure)
    item.figure.savefig(path, dpi=120)
    return path


_SAFE_STEM = re.compile(r"[a-z0-9][a-z0-9.+_-]*")


def figure_stems(settings: Sequence[Setting]) -> dict[str, str]:
    """A file-name stem per setting, unique within the report.

    A sweep's setting keeps its directory name under ``runs/`` (the sweep's planning makes it
    safe and unique: ``lr=-1`` and ``lr=1`` differ); other settings use the slug
    of their label, numbered when two slugs collide.
    """
    stems: dict[str, str] = {}
    used: set[str] = set()
    for setting in settings:
        directory = next((run.setting_dir for run in setting.runs if run.setting_dir), None)
        base = directory if directory and _SAFE_STEM.fullmatch(directory) else slug(setting.label)
        stem, number = base, 2
        while stem in used:
            stem, number = f"{base}-{number}", number + 1
        used.add(stem)
        stems[setting.label] = stem
    return stems
