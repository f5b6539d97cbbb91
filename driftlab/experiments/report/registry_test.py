"""The report's sections: every section's public names are the package's own, and two sections may not share one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import driftlab.experiments.report as report_package
from driftlab.experiments.report import registry
from driftlab.experiments.report.plots import ReportFigure
from driftlab.experiments.report.section import drawn_figure


def test_every_export_of_a_section_is_the_package_attribute_of_that_name():
    (section,) = registry.REPORT_SECTIONS
    assert section.name == "privacy" and "privacy_utility" in section.exports
    for name, value in section.exports.items():
        assert getattr(report_package, name) is value and name in report_package.__all__
    # the export wins over the section's module of the same name, which importing it made a package attribute
    assert callable(report_package.privacy_utility) and not isinstance(report_package.privacy_utility, type(registry))


def test_two_sections_exporting_one_name_are_refused(monkeypatch):
    (section,) = registry.REPORT_SECTIONS
    twin = dataclasses.replace(section, name="twin", exports={"privacy_figure": None, "other": None})
    monkeypatch.setattr(registry, "REPORT_SECTIONS", (section, twin))
    with pytest.raises(ValueError, match=r"\['privacy_figure'\]"):
        registry.section_exports()


def test_a_report_reads_each_sections_data_by_its_name():
    report = report_package.Report("", [], [], [], [], [], [], [], sections={"privacy": "data"})
    assert report.privacy == "data" and report_package.Report("", [], [], [], [], [], [], []).privacy is None
    with pytest.raises(AttributeError, match="no attribute 'unknown'"):
        _ = report.unknown


def test_a_drawn_figure_is_given_to_the_write_up_as_its_file_name_and_caption():
    figure = ReportFigure("privacy-utility", "test accuracy vs ε", None, False)
    assert drawn_figure((figure, Path("/out/privacy-utility.png"))) == ("privacy-utility.png", "test accuracy vs ε")
    assert drawn_figure(None) is None
