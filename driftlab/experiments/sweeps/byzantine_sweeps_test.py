"""The shipped Byzantine sweep plans what its description says: 5 of 25 clients attack, Krum is told f = 5, CClip's
radius is the code's τ in the units of a released change, each robust rule runs without and with the paper's bucketing
(s = 2, 13 buckets, enough for Krum's f = 5), and every cell runs every seed.

(It is also planned at each of its scales by ``driftlab/experiments/sweep/sweep_test.py`` and its description's three
parts are checked by ``settings_provenance_test.py``.)
"""

from __future__ import annotations

import pytest

from driftlab.attacks.byzantine import byzantine_clients
from driftlab.experiments.sweep import load_sweep, plan
from driftlab.robust.bucketing import bucket_count, check_bucket_count

NAME = "byzantine-bucketing-mnist"


@pytest.mark.parametrize("scale", [None, "paper"])
def test_every_attack_meets_every_aggregator_on_three_seeds(scale):
    runs = plan(load_sweep(NAME), scale)
    cells = {(run.setting, run.method) for run in runs}
    assert len(cells) == 4 * 11 and len(runs) == 3 * len(cells)
    methods = {run.method for run in runs}
    robust = methods - {"mean"}
    assert {method for method in robust if method.endswith(", s=2")} == {f"{m}, s=2" for m in robust if "s=2" not in m}
    for run in runs:
        config = run.config
        assert (config.data.num_clients, config.sampling.participation, config.client.steps) == (25, 1.0, 1)
        assert (config.rounds, config.model.name) == ((600, "cnn") if scale == "paper" else (200, "mlp"))
        assert config.client.lr == 0.01 and config.client.batch_size == 32
        if config.attack is not None:
            assert len(byzantine_clients(config.attack.byzantine, config.seed, 25)) == 5
        if config.robust is not None and config.robust.aggregator == "krum":
            assert config.robust.byzantine == 5
        if config.robust is not None and config.robust.aggregator == "centered_clipping":
            assert config.robust.radius == pytest.approx(config.client.lr * 10)  # the code's τ = 10, gradient units
            assert config.server.lr == (10.0 if config.robust.momentum else 1.0)  # the code's undamped momentum step
        if config.robust is not None:
            assert config.robust.bucket_size == (2 if run.method.endswith(", s=2") else None)
            if config.robust.bucket_size is not None:  # the paper's 13 buckets, and Krum's f = 5 counts them
                assert bucket_count(25, config.robust.bucket_size) == 13
                check_bucket_count(config.robust.settings, 25, config.robust.bucket_size)
