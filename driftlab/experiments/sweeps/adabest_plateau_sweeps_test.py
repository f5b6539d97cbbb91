"""Every shipped AdaBest sweep decays β when ‖h‖ plateaus, as the AdaBest paper does in all its experiments
(Section 3.4.3: "We apply this decay in our experiments when norm of h plateaus"), and says whose each part is:
the practice the paper's, its numbers (which the paper does not give) ours, and that the authors' code keeps β
constant."""

from __future__ import annotations

import pytest

from driftlab.algorithms.adabest import BetaPlateau
from driftlab.experiments.sweep import load_sweep, plan
from driftlab.experiments.sweep.shipped import sweep_names
from driftlab.experiments.sweeps.settings_provenance_test import provenance

ADABEST_SWEEPS = sorted(name for name in sweep_names() if name.startswith("adabest-"))
RULE = BetaPlateau(factor=0.1, patience=10, threshold=1e-4)


def test_the_adabest_sweeps_are_found():
    assert len(ADABEST_SWEEPS) == 9


@pytest.mark.parametrize("name", ADABEST_SWEEPS)
def test_every_adabest_run_decays_beta_on_a_plateau_and_no_other_method_is_touched(name):
    spec = load_sweep(name)
    for scale in (None, *sorted(spec.scales)):
        runs = plan(spec, scale)
        adabest = [run for run in runs if run.config.algorithm.name == "adabest"]
        assert adabest, f"{name}: no AdaBest run at scale {scale}"
        assert all(run.config.algorithm.beta_plateau == RULE for run in adabest)
        assert all(not hasattr(run.config.algorithm, "beta_plateau") for run in runs if run not in adabest)


@pytest.mark.parametrize("name", ADABEST_SWEEPS)
def test_the_decay_is_credited_to_the_paper_its_numbers_to_us_and_the_authors_code_holds_beta_constant(name):
    parts = provenance(load_sweep(name).description)
    assert "β decayed when ‖h‖ plateaus (its Section 3.4.3)" in parts["paper"]
    assert parts["code"].startswith(": nothing") and "holds β constant" in parts["code"]
    assert "algorithm.beta_plateau" in parts["ours"] and "the paper gives none" in parts["ours"]
    assert "β held constant" not in parts["ours"]
