"""``import driftlab``: the public names, each imported when first used, so importing the package imports no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

import driftlab


def test_import_driftlab_imports_no_torch():
    code = "import sys; import driftlab; from driftlab import ConfigError, __version__; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_public_names_are_those_of_their_modules():
    # `from driftlab import run` and `driftlab.run` import the runner (and torch) when first used
    from driftlab.errors import ConfigError
    from driftlab.experiments import config, report, sweep
    from driftlab.experiments.run import runner

    assert driftlab.ConfigError is ConfigError is config.ConfigError
    assert (driftlab.run, driftlab.RunResult) == (runner.run, runner.RunResult)
    assert (driftlab.ExperimentConfig, driftlab.load_config) == (config.ExperimentConfig, config.load_config)
    assert (driftlab.load_sweep, driftlab.run_sweep, driftlab.make_report) == (
        sweep.load_sweep,
        sweep.run_sweep,
        report.make_report,
    )
    from driftlab.experiments.run import loading

    assert (driftlab.load_model, driftlab.load_run) == (loading.load_model, loading.load_run)
    assert all(hasattr(driftlab, name) for name in driftlab.__all__)
    assert set(driftlab.__all__) <= set(dir(driftlab))
    with pytest.raises(AttributeError, match="module 'driftlab' has no attribute 'no_such_name'"):
        driftlab.no_such_name  # noqa: B018
