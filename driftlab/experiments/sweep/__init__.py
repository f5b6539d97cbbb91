"""Sweeps: a grid of config variants times a list of seeds, run in parallel processes, resumable.

A sweep file (TOML; shipped ones are listed by ``driftlab presets``) names a base config, overrides,
seeds, targets, named scales and labelled axes; ``driftlab.experiments.sweep.spec`` shows one.

The output directory holds ``sweep.json`` (the plan: axes, labels and every run's
overrides) and ``runs/<setting>/<method>/seed-<s>/``, each an ordinary run
directory. Running the same sweep again skips complete runs, resumes interrupted
ones from their checkpoints (bit-identical to an uninterrupted run), retries failed
ones and leaves diverged ones alone; ``driftlab sweep --status`` (``sweep_status``)
reads where each run stands from the directories alone.

The package does one job per module:

    spec        sweep files and ``--grid`` axes: reading and validating them, the shipped sweeps
    planning    every run of a spec at a scale (validated configs, labels, run directories), sweep.json
    directory   a sweep directory's files, run directory names, where each run stands (imports no torch)
    execution   running the pending runs through an executor, and the entry point of each run's interpreter

Every public name of those modules is importable from here; importing this package
imports none of them until a name is used, so ``directory`` stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module of this package that defines it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        (
            "GRID_FORMS",
            "HALVING_FORM",
            "METHOD_SECTIONS",
            "ROLES",
            "SWEEP_PACKAGE",
            "Axis",
            "AxisValue",
            "Halving",
            "Role",
            "Scale",
            "SweepSpec",
            "grid_axis",
            "grid_description",
            "is_sweep_source",
            "load_sweep",
            "parse_halving",
            "short_keys",
            "sweep_from_config",
            "sweep_from_table",
            "sweep_names",
            "validate_seeds",
        ),
        "spec",
    ),
    **dict.fromkeys(
        ("SWEEP_FORMAT", "PlannedRun", "plan", "run_note", "scoped_override", "sweep_document"), "planning"
    ),
    **dict.fromkeys(
        (
            "FAILURE_FILE",
            "HALVING_FILE",
            "HALVING_RUNGS_FILE",
            "JOBS_FILE",
            "SWEEP_FILE",
            "RunStatus",
            "run_directory_holder",
            "run_status",
            "slug",
        ),
        "directory",
    ),
    **dict.fromkeys(
        (
            "EXIT_BUSY",
            "EXIT_COMPLETE",
            "EXIT_DIVERGED",
            "EXIT_FAILED",
            "EXIT_INTERRUPTED",
            "RunOutcome",
            "die_with_parent",
            "process_gone",
            "run_sweep",
            "worker_main",
        ),
        "execution",
    ),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
