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

# Where the names are looked up, in this order: each module's own __all__ lists them.  directory comes first, so
# that its names (read by `driftlab sweep --status` and the reports) import no torch.
_MODULES = ("directory", "spec", "planning", "execution")


def _module(name: str) -> Any:
    return importlib.import_module(f"{__name__}.{name}")


def __getattr__(name: str) -> Any:
    if name == "__all__":
        value: Any = sorted(exported for module in _MODULES for exported in _module(module).__all__)
    else:
        defining = None if name.startswith("__") else next((m for m in _MODULES if name in _module(m).__all__), None)
        if defining is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(_module(defining), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__getattr__("__all__")})
