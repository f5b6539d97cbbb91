"""The seam through which a report carries a part only some runs have (``ReportSection``).

``make_report`` writes each setting's tables and figures itself; a section adds, where its runs are present, a note
under each setting's heading, then data built over every setting, a figure and a write-up that follow the settings in
report.md, and a CSV of its own. The sections a report runs are ``registry.REPORT_SECTIONS``; the report's generic
modules (``__init__``, ``render``, ``plots``, ``tables``) name none of them, and ``Report`` holds each section's data
under the section's ``name``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from driftlab.experiments.report.plots import ReportFigure
from driftlab.experiments.report.read import Setting


@dataclass(frozen=True)
class ReportSection:
    """One part of the report that only some runs have: each callable is a pure function of what it is given."""

    name: str  # ``Report.<name>``: the section's data, None for a report of runs without it
    # the lines under a setting's heading (what its extra columns mean); [] for a setting without such runs
    setting_note: Callable[[Setting], list[str]]
    # (settings, sweep documents) -> the section's data; None when no run has it (nothing else is then written)
    build: Callable[[Sequence[Setting], Sequence[dict[str, Any]]], Any]
    # (data, folder) -> (figure, the PNG saved there), or None when there is nothing to draw
    draw: Callable[[Any, Path], tuple[ReportFigure, Path] | None]
    # (data, (file name, caption) of the figure or None) -> the section's Markdown, after every setting's
    write_up: Callable[[Any, tuple[str, str] | None], list[str]]
    write_csv: Callable[[Path, Any], Path]  # (folder, data) -> the CSV written there
    exports: Mapping[str, Any]  # public names a reader imports from ``driftlab.experiments.report``


def drawn_figure(drawn: tuple[ReportFigure, Path] | None) -> tuple[str, str] | None:
    """(file name, caption) of a section's saved figure, as its ``write_up`` takes it; None when nothing was drawn."""
    return None if drawn is None else (drawn[1].name, drawn[0].caption)


__all__ = ["ReportSection", "drawn_figure"]
