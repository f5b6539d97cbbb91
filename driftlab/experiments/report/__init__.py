"""Reports over finished (or unfinished) runs: the tables and figures the papers use to compare methods.

``make_report(inputs, out_dir)`` reads run directories (``config.json`` +
``metrics.jsonl`` [+ ``run.json``]), sweep directories (``sweep.json``) or any
folder holding them, and writes into ``out_dir``::

    report.md       per setting: communication to reach each target, accuracy, local SGD steps, run info, plots
    targets.csv     rounds, model-equivalents and bits to each target (one row per setting, target, method)
    savings.csv     the savings ratios of the communication tables (one row per method and baseline)
    accuracy.csv    final and best test accuracy and BMTA (or train loss and distance) as mean and std over seeds
    steps.csv       total local SGD steps, steps to each target, and their fraction of the reference method
    runs.csv        one row per run: directory, seed, status, rounds done, wall time, machine, round it was cut to
                    (with timed runs, targets.csv, accuracy.csv and runs.csv add simulated seconds)
    rounds_long.csv every run's per-round metrics in long form: run, method, seed, setting, round, metric, value
                    (for pandas or seaborn: ``rounds_long``)
    tuning.csv      with tuned axes: every tuned value's validation score and test metric, and which was picked
    privacy.csv     with private runs: each method's final test accuracy and ε per privacy configuration
    <setting>-*.png the figures (<setting>: the sweep's directory name for the setting, else its label's slug)
    privacy-utility.png  with private runs: test accuracy against ε, a panel per setting, a line per method

What is measured, and where it comes from:

- Rounds and communication to reach a target test accuracy (FedDyn, Acar et al.
  2021, Tables 1 and 2): the first *evaluated* round with ``test_accuracy >=
  target``; communication in model-equivalents relative to one FedAvg round,
  ``Σ_{t ≤ hit} upload_bits_t / (32 · P · |S_t|)`` (P parameters, |S_t| selected
  clients), so a SCAFFOLD round counts 2 and a compressed upload a fraction; and
  the exact bits up and down. A method that never reaches the target gets a
  "N+" entry (N rounds run) and ratios against it are bounds.
- Final and best test accuracy as mean ± sample standard deviation over seeds
  (AdaBest Table 2), and EFL's BMTA, the best over rounds of the mean local
  test accuracy of the clients. With personalized runs (records with
  ``personal_test_accuracy_mean`` or ``client_test_accuracy_std``, issue 26) the
  accuracy table names the model and the test data of each column (server model,
  global test set; own model, own split; server model, clients' splits), gives a
  BMTA for the clients' own models beside the server model's, each with the
  standard deviation over clients at its best round, and accuracy.csv adds
  ``personal_bmta_*`` columns. A method without personal models is its server
  model on the clients' splits there (EFL Table 2's FedAvg row), marked ‡.
- Total local SGD steps and the steps spent to reach a target, as a fraction of
  a reference method (the decaying-K paper's Table 1).
- ``‖h‖`` and ``‖θ‖`` per round (AdaBest Figure 1) and FedProx's dissimilarity
  ``B(θ)²`` and gradient variance (Li et al. 2020, Definition 2, Figure 4).
- With client-level differential privacy (``[privacy]``): ε(δ) at the end of each run beside
  its accuracy (``epsilon``; ∞ without noise), and accuracy against ε (``privacy_utility``: the
  points of a sweep axis over noise multipliers, or each run's rounds at one noise level).
  A report of runs without ``[privacy]`` has no ε column and no privacy file.
- With simulated time (``[system]``): the simulated seconds at the end of the first evaluated round
  reaching each target (``time to target``; FedBuff, Nguyen et al. 2022, compares synchronous and
  asynchronous training by it), the whole run's simulated time, and test accuracy and training loss
  against simulated time (``<setting>-time.png``). An asynchronous (FedBuff) run's rounds are server
  updates, and its curves and rows say so. A report of untimed runs has none of these.

Curves are means over seeds with a band of ± one sample standard deviation, the
± of the tables; each caption names what its figure draws. Rows, legends and
file names use a sweep's own labels. Stand-alone runs of one setting with
different ``rounds`` are compared up to the shortest one's last round (a note
names the runs cut); a sweep's runs keep the lengths the sweep planned.

The package reads (``read``: run and sweep directories, no torch), labels stand-alone runs
(``labels``), computes the tables' numbers and writes them as CSV (``tables``), renders the
Markdown (``render``) and draws the figures (``plots``, matplotlib on demand). A part only some runs have, with its
own data, figure, text and CSV (the privacy-utility section: ``privacy_utility``), is a ``section.ReportSection``
listed in ``registry``; ``Report`` holds its data under the section's name. Importing the package imports no torch:
only a run's plugins may.

Example:
    >>> from driftlab.experiments.report import make_report
    >>> report = make_report(["driftlab-demo"], "driftlab-demo/report", targets=[0.6])  # doctest: +SKIP
    >>> print(report.markdown)                                                          # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from driftlab.errors import ConfigError
from driftlab.experiments.report.epsilon import EpsilonSummary, epsilon_summary, is_private, run_epsilon
from driftlab.experiments.report.labels import algorithm_label, flatten_config, label_standalone
from driftlab.experiments.report.plots import (
    BAND_LEGEND,
    BAND_NOTE,
    ReportFigure,
    figure_stems,
    plot_setting,
    setting_figures,
    target_style,
)
from driftlab.experiments.report.read import (
    PendingRun,
    RunData,
    Setting,
    collect,
    cut_to_shortest,
    read_metrics,
    read_run,
    read_sweep,
)
from driftlab.experiments.report.registry import REPORT_SECTIONS, section_exports
from driftlab.experiments.report.render import (
    accuracy_section,
    communication_section,
    cut_note,
    instability_note,
    runs_section,
    steps_section,
    sweep_summary,
    time_note,
    unreached_section,
)
from driftlab.experiments.report.rounds_long import ROUNDS_LONG_CSV, write_rounds_long_csv
from driftlab.experiments.report.section import drawn_figure
from driftlab.experiments.report.seeds import (
    SeedsRow,
    baseline_for,
    check_baseline,
    seeds_rows,
    seeds_section,
    write_seeds_csv,
)
from driftlab.experiments.report.tables import (
    AccuracyRow,
    Savings,
    Spread,
    StepsRow,
    TargetOutcome,
    TargetRow,
    savings,
    spread,
    target_outcome,
    target_row,
    write_tables,
)
from driftlab.experiments.report.tuning import (
    TuningResult,
    apply_tuning,
    tuning_appendix,
    tuning_note,
    write_tuning_csv,
)
from driftlab.experiments.run.run_directory import METRICS_FILE
from driftlab.owned_folder import OwnedFolder, claim, first_line, refusal


@dataclass
class Report:
    """What ``make_report`` wrote, and the numbers behind it."""

    markdown: str
    files: list[Path]
    runs: list[RunData]
    settings: list[Setting]
    targets: list[TargetRow]
    savings: list[Savings]
    accuracy: list[AccuracyRow]
    steps: list[StepsRow]
    tuning: TuningResult | None = None  # None: no sweep had a tuned axis
    # each section's data by its name (``registry.REPORT_SECTIONS``), None where no run has the section's part;
    # read as attributes: ``report.privacy`` is the privacy-utility data
    sections: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        if name != "sections" and name in _SECTION_NAMES:
            return self.sections.get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def make_report(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    targets: Sequence[float] | None = None,
    steps_reference: str | None = None,
    plots: bool = True,
    baseline: str | None = None,
    force: bool = False,
) -> Report:
    """Read the runs under ``inputs`` and write ``report.md``, CSV tables and figures into ``out_dir``.

    Args:
      inputs: run directories, sweep directories, or folders holding either anywhere beneath them.
        A run reachable from two inputs counts once.
      out_dir: where the report goes (created).
      targets: target test accuracies (fractions); default: the sweeps' targets, else the runs'
        ``evaluation.target_accuracy``.
      steps_reference: the method label whose local SGD steps the others are compared with; default:
        the sweep's ``steps_reference``, else the method with constant local work that spent most steps.
      plots: write the PNG figures.
      baseline: the method label the others are compared with, paired by seed, in the "Over seeds" section
        (written where some method ran two seeds or more); default: each setting's first method.
      force: replace files of the report's names in ``out_dir`` that driftlab did not write (``--force``);
        without it such a file stops the report before anything is written (``driftlab.owned_folder``).

    Returns:
      A ``Report`` with the Markdown text, the files written and every number in the tables.

    Raises:
      ConfigError: an input that holds no runs, a malformed file (named, with its line), a bad target
        or an unknown ``steps_reference``.
    """
    settings, documents = collect(inputs)
    # Tuned axes (``tuning``): each method's rows are its runs at the value picked on validation; the grid is an appendix.
    tuned = apply_tuning(settings, documents)
    runs = [run for setting in settings for run in setting.runs]
    chosen_targets = _targets_for(targets, documents, runs)
    requested_reference = _reference_for(steps_reference, documents, settings)
    check_baseline(baseline, {method for setting in settings for method in setting.methods})
    seed_rows: list[SeedsRow] = []
    target = Path(out_dir)
    # Refused early for the names every report writes; the figures' names are known once drawn (``_publish``).
    claimable(target, force)
    with tempfile.TemporaryDirectory(prefix="driftlab-report-") as staging:
        out = Path(staging)  # every file is written here first, then moved into the user's folder once all may be
        report = _write_report(
            inputs,
            out,
            settings,
            documents,
            tuned,
            runs,
            chosen_targets,
            requested_reference,
            baseline,
            seed_rows,
            plots,
        )
        report.files = _publish(out, target, report.files, force)
    return report


def _write_report(
    inputs: Sequence[str | Path],
    out: Path,
    settings: list[Setting],
    documents: list[dict[str, Any]],
    tuned: TuningResult | None,
    runs: list[RunData],
    chosen_targets: list[float],
    requested_reference: str | None,
    baseline: str | None,
    seed_rows: list[SeedsRow],
    plots: bool,
) -> Report:
    """The report's files written into ``out`` (a staging folder ``make_report`` then publishes)."""
    target_rows: list[TargetRow] = []
    savings_rows: list[Savings] = []
    accuracy_rows: list[AccuracyRow] = []
    step_rows: list[StepsRow] = []
    files: list[Path] = []
    lines = [REPORT_TITLE, ""]
    sources = ", ".join(f"`{p}`" for p in inputs)
    lines.append(
        f"{len(runs)} runs in {len(settings)} setting{'s' if len(settings) != 1 else ''}, read from {sources}."
    )
    for document in documents:
        lines.append(sweep_summary(document, [run for run in runs if run.sweep == str(document.get("name"))]))
    lines.append("")
    if chosen_targets and any(s.is_classifier for s in settings):
        lines += [
            "Communication is counted as in FedDyn (Acar et al. 2021) Tables 1 and 2: model-equivalents are uploaded bits "
            "over 32 · parameters · selected clients, summed over rounds, so one FedAvg round counts 1 and one SCAFFOLD round 2; "
            "bits are exact. A method that did not reach a target shows `N+`: the N rounds (and the communication) it spent "
            "without reaching it, a lower bound; ratios against it are bounds (`>`, `<`). With several seeds an entry is the mean "
            "over seeds, each seed that missed the target counted at the rounds it ran, so it is `+` unless every seed reached it. "
            "The savings column \"vs X\" is X's model-equivalents over this method's.",
            "",
        ]
    unknown_parameters = [run for run in runs if run.num_parameters is None]
    if unknown_parameters:
        lines += [
            f"{len(unknown_parameters)} runs have no run.json (parameter count unknown): their model-equivalent cells are empty.",
            "",
        ]
    torn = [run for run in runs if run.torn_line is not None]
    for run in torn:
        lines.append(
            f"`{run.path / METRICS_FILE}` line {run.torn_line} was torn (the run was killed mid-write) and is ignored."
        )
    if torn:
        lines.append("")

    stems = figure_stems(settings)
    for setting in settings:
        lines += [f"## {setting.label}", ""]
        lines += cut_note(setting)
        lines += instability_note(setting.runs)
        for part in REPORT_SECTIONS:
            lines += part.setting_note(setting)
        lines += time_note(setting)
        lines += tuning_note(tuned, setting.label)
        by_method: dict[str, dict[float, TargetRow]] = {method: {} for method in setting.methods}
        if setting.is_classifier:
            unreached: list[tuple[float, list[TargetRow]]] = []
            for target in chosen_targets:
                section, rows, entries = communication_section(setting, target)
                if any(row.seeds_reached for row in rows):
                    lines += section
                else:
                    unreached.append((target, rows))  # identical tables: one compact table for all of them
                target_rows += rows
                savings_rows += entries
                for row in rows:
                    by_method[row.method][target] = row
            if unreached:
                lines += unreached_section(setting, [target for target, _ in unreached], unreached[0][1])
            if not chosen_targets:
                lines += [
                    "No target accuracy given (pass targets, or set evaluation.target_accuracy in the runs): no communication tables.",
                    "",
                ]
        section, rows = accuracy_section(setting)
        lines += section
        accuracy_rows += rows
        if setting.is_classifier:
            compared = baseline_for(list(setting.methods), baseline)
            rows = seeds_rows(setting.label, setting.methods, chosen_targets, compared)
            section = seeds_section(rows, chosen_targets, compared)
            if section:
                lines += section
                seed_rows += rows
        section, rows = steps_section(
            setting, by_method, chosen_targets if setting.is_classifier else [], requested_reference
        )
        lines += section
        step_rows += rows
        lines += runs_section(setting)

        if plots:
            figures = plot_setting(setting, out, chosen_targets if setting.is_classifier else [], stems[setting.label])
            files += [path for _, path in figures]
            if figures:
                lines += ["### Figures", ""]
                if any(figure.banded for figure, _ in figures):
                    lines += [BAND_NOTE, ""]
                for figure, path in figures:
                    lines += [
                        f"![{setting.label}: {figure.caption}]({path.name})",
                        "",
                        f"*{figure.caption[0].upper()}{figure.caption[1:]}.*",
                        "",
                    ]

    built = {part.name: part.build(settings, documents) for part in REPORT_SECTIONS}
    for part in REPORT_SECTIONS:
        data = built[part.name]
        if data is not None:
            drawn = part.draw(data, out) if plots else None
            if drawn is not None:
                files.append(drawn[1])
            lines += part.write_up(data, drawn_figure(drawn))

    lines += tuning_appendix(tuned)
    markdown = "\n".join(lines).rstrip() + "\n"
    report_path = out / "report.md"
    report_path.write_text(markdown)
    files.insert(0, report_path)
    files += write_tables(out, target_rows, savings_rows, accuracy_rows, step_rows, chosen_targets, settings)
    files += [part.write_csv(out, built[part.name]) for part in REPORT_SECTIONS if built[part.name] is not None]
    files += write_tuning_csv(out, tuned)
    files += write_seeds_csv(out, seed_rows, chosen_targets)
    files += write_rounds_long_csv(out, settings)
    return Report(markdown, files, runs, settings, target_rows, savings_rows, accuracy_rows, step_rows, tuned, built)


REPORT_COMMAND = "driftlab report"
REPORT_TITLE = "# driftlab report"  # report.md's first line: how a report folder from before manifests is recognised
# The names every report writes (others: figures, and tables only some runs have); checked before anything is drawn.
FIXED_FILES = ("report.md", "targets.csv", "savings.csv", "accuracy.csv", "steps.csv", "runs.csv", ROUNDS_LONG_CSV)


def earlier_report(entry: Path) -> bool:
    """Whether ``entry`` sits in a report folder a driftlab from before manifests wrote (its report.md is ours)."""
    return first_line(entry.parent / "report.md") == REPORT_TITLE


def claimable(out: Path, force: bool) -> None:
    """Refuse, before any work, an ``out`` whose report.md or tables driftlab did not write (unless ``force``)."""
    if os.path.lexists(out) and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory; choose another --out directory")
    if force or not out.is_dir():
        return
    refused = OwnedFolder.read(out, REPORT_COMMAND).foreign(FIXED_FILES, earlier_report)
    if refused:
        raise ConfigError(refusal(out, refused, "choose another --out directory"))


def _publish(staging: Path, out: Path, files: list[Path], force: bool) -> list[Path]:
    """Move the staged report into ``out`` once every name may be written there; returns the files' new paths.

    The files an earlier report wrote there that this one does not (a setting's figures, a table of runs no
    longer read) are removed, so report.md and the files beside it agree; only what the manifest lists as a
    report's is removed.
    """
    names = sorted(entry.name for entry in staging.iterdir())
    owned = claim(out, names, REPORT_COMMAND, force=force, recognise=earlier_report)
    for name, writer in list(owned.files.items()):
        if writer == REPORT_COMMAND and name not in names:
            owned.remove(name)
    for name in names:
        try:
            os.replace(staging / name, out / name)
        except OSError:  # another file system: copied, with the staged file's mode (0o666 less the umask)
            shutil.move(staging / name, out / name)
    return [out / path.name for path in files]


def _targets_for(
    targets: Sequence[float] | None, documents: Sequence[dict[str, Any]], runs: Sequence[RunData]
) -> list[float]:
    if targets is not None:
        chosen = [float(t) for t in targets]
    elif any(document.get("targets") for document in documents):
        chosen = [float(t) for document in documents for t in document.get("targets") or ()]
    else:
        chosen = [
            float(run.config["evaluation"]["target_accuracy"])
            for run in runs
            if run.config.get("evaluation", {}).get("target_accuracy") is not None
        ]
    bad = [t for t in chosen if not 0 < t <= 1]
    if bad:
        raise ConfigError(f"target accuracies must be fractions in (0, 1], got {bad}; write 0.97 for 97%")
    return sorted(set(chosen))


def _reference_for(
    requested: str | None, documents: Sequence[dict[str, Any]], settings: Sequence[Setting]
) -> str | None:
    if requested is not None:
        methods = {method for setting in settings for method in setting.methods}
        if requested not in methods:
            raise ConfigError(
                f"steps_reference {requested!r} is not a method of these runs; the methods are: {', '.join(sorted(methods))}"
            )
        return requested
    return next((document["steps_reference"] for document in documents if document.get("steps_reference")), None)


_SECTION_NAMES = frozenset(part.name for part in REPORT_SECTIONS)
_SECTION_EXPORTS = section_exports()
# The sections' public names, bound here as the package's own: importing a section's module made the module an
# attribute of this package, and a module may share its name with one of its exports (privacy_utility), which wins.
globals().update(_SECTION_EXPORTS)


__all__ = [
    "BAND_LEGEND",
    "BAND_NOTE",
    "AccuracyRow",
    "EpsilonSummary",
    "PendingRun",
    "Report",
    "ReportFigure",
    "RunData",
    "Savings",
    "Setting",
    "Spread",
    "StepsRow",
    "TargetOutcome",
    "TargetRow",
    "algorithm_label",
    "collect",
    "cut_to_shortest",
    "epsilon_summary",
    "figure_stems",
    "flatten_config",
    "is_private",
    "label_standalone",
    "make_report",
    "read_metrics",
    "read_run",
    "read_sweep",
    "run_epsilon",
    "savings",
    "setting_figures",
    "spread",
    "sweep_summary",
    "target_outcome",
    "target_row",
    "target_style",
    *_SECTION_EXPORTS,
]
