"""The report's sections (``section.ReportSection``), in the order report.md closes with them.

A new part of the report that only some runs have is one module defining a ``ReportSection`` and one element here.
"""

from __future__ import annotations

from driftlab.experiments.report.privacy_utility import SECTION as PRIVACY
from driftlab.experiments.report.section import ReportSection

REPORT_SECTIONS: tuple[ReportSection, ...] = (PRIVACY,)


def section_exports() -> dict[str, object]:
    """Every section's public names (``ReportSection.exports``), which ``driftlab.experiments.report`` re-exports."""
    exports: dict[str, object] = {}
    for section in REPORT_SECTIONS:
        clash = set(exports) & set(section.exports)
        if clash:
            raise ValueError(f"report sections export the same names {sorted(clash)}: rename one section's")
        exports.update(section.exports)
    return exports


__all__ = ["REPORT_SECTIONS", "section_exports"]
