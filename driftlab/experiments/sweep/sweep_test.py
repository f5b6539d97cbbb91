import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from driftlab.experiments.config import ConfigError, load_config
from driftlab.experiments.run.runner import read_run_info
from driftlab.experiments.sweep import (
    FAILURE_FILE,
    GRID_FORMS,
    SweepSpec,
    grid_axis,
    load_sweep,
    plan,
    process_gone,
    run_status,
    run_sweep,
    short_keys,
    slug,
    sweep_document,
    sweep_from_config,
    sweep_from_table,
    sweep_names,
)
from driftlab.experiments.sweep.testing import sweep_command

TINY = ["data.num_clients=6", "client.epochs=1", "sampling.participation=0.5", "evaluation.every=1"]


def tiny_spec(**changes) -> SweepSpec:
    table = {
        "base": "synthetic-fedprox",
        "overrides": [*TINY, "rounds=3"],
        "seeds": [0, 1],
        "targets": [0.5],
        "axes": [
            {
                "name": "data",
                "role": "setting",
                "values": [{"label": "syn(0,0)", "set": ["data.synthetic_alpha=0", "data.synthetic_beta=0"]}],
            },
            {
                "name": "mu",
                "values": [{"label": "μ=0", "set": ["algorithm.mu=0"]}, {"label": "μ=1", "set": ["algorithm.mu=1"]}],
            },
        ],
    }
    table.update(changes)
    return sweep_from_table(table, "test sweep", "tiny")


def metrics(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        record.pop("round_seconds")
    return records


# ---------------------------------------------------------------- planning


def test_plan_crosses_axes_and_seeds_in_order_with_overrides_applied_in_order():
    runs = plan(tiny_spec(), extra_overrides=["rounds=4"])
    assert [(r.setting, r.method, r.seed) for r in runs] == [
        ("syn(0,0)", "μ=0", 0),
        ("syn(0,0)", "μ=0", 1),
        ("syn(0,0)", "μ=1", 0),
        ("syn(0,0)", "μ=1", 1),
    ]
    assert runs[2].dir == "runs/syn-0-0/mu-1/seed-0"
    # sweep overrides, then the axes, then the command line, then the seed
    assert runs[3].overrides == (
        *TINY,
        "rounds=3",
        "data.synthetic_alpha=0",
        "data.synthetic_beta=0",
        "algorithm.mu=1",
        "rounds=4",
        "seed=1",
    )
    config = load_config("synthetic-fedprox", runs[3].overrides)
    assert (config.rounds, config.seed, config.algorithm.mu, config.data.synthetic_alpha) == (4, 1, 1.0, 0.0)


def test_axis_role_is_inferred_from_the_sections_it_sets():
    spec = tiny_spec()
    assert [a.role for a in spec.axes] == ["setting", "method"]
    assert grid_axis("data.synthetic_alpha=[0, 0.5]").role == "setting"
    assert grid_axis("server.lr=1,0.5").role == "method"


def test_grid_axis_reads_toml_lists_and_comma_lists():
    axis = grid_axis("algorithm.mu=[0, 0.01, 1]")
    assert [v.set for v in axis.values] == [("algorithm.mu=0",), ("algorithm.mu=0.01",), ("algorithm.mu=1",)]
    assert [v.label for v in grid_axis("algorithm.name=fedavg,scaffold").values] == ["name=fedavg", "name=scaffold"]
    assert [v.set for v in grid_axis('data.name=["synthetic_iid", "synthetic"]').values] == [
        ("data.name=synthetic_iid",),
        ("data.name=synthetic",),
    ]
    with pytest.raises(ConfigError, match="KEY=\\[v1, v2"):
        grid_axis("algorithm.mu")


@pytest.mark.parametrize("override", ["seed=3", 'seed="a"', "seed=true", " seed = 1"])
def test_a_seed_override_is_refused_rather_than_replaced_by_each_runs_seed(override):
    spec = sweep_from_config("synthetic-fedavg", ["client.lr=0.05,0.1"], [0, 1], name="s")
    with pytest.raises(ConfigError, match=r"would be replaced by each run's seed.*--seeds"):
        plan(spec, extra_overrides=["rounds=2", override])
    assert len(plan(spec, extra_overrides=["rounds=2", "data.seed=3"])) == 4  # the data seed is a setting of its own


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("client.lr=[0.1, 0.2", r"'\[0.1, 0.2' is not a TOML list"),
        ("client.lr=0.1, 0.2]", r"'0.1, 0.2\]' is not a TOML list"),
        ("algorithm.mu=0,0", "lists 0 twice"),
        ("algorithm.mu=[0, 0.0, 1]", "lists 0 and 0.0, one value, twice"),
        ("algorithm.name=fedavg,scaffold,fedavg", "lists fedavg twice"),
        ("algorithm.mu=[]", "lists no values"),
        ("algorithm.mu=", "must be KEY="),
        ("algorithm.mu", "must be KEY="),
        ("=0,1", "must be KEY="),
        ("algorithm.mu=0,,1", "an empty value between commas"),
        ("algorithm.mu=0,", "an empty value between commas"),
        ('data.name="a,b"', "neither a TOML value nor a bare word"),
        ("client.lr={kind='exponential', initial=0.1}", "neither a TOML value nor a bare word"),
        ("client lr=0,1", "is not a config key"),
    ],
)
def test_grid_parsing_is_strict_and_shows_the_text_and_both_forms(assignment, message):
    with pytest.raises(ConfigError, match=message) as caught:
        grid_axis(assignment)
    assert f"--grid {assignment!r}" in str(caught.value)
    if "twice" not in message:
        assert GRID_FORMS in str(caught.value)


def test_a_bad_grid_is_refused_before_any_run_starts(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"(?s)run mu=0 / muu=0 \(seed 0\).*algorithm.muu"):
        run_sweep(
            sweep_from_config("synthetic-fedprox", ["algorithm.mu=0,1", "algorithm.muu=0,1"], [0], "s"),
            out,
            log=lambda _: None,
        )
    assert not out.exists()


@pytest.mark.slow
def test_cli_rejects_an_unclosed_grid_list_with_exit_2_and_creates_nothing(tmp_path):
    out = tmp_path / "out"
    command = sweep_command("synthetic-fedprox", "--grid", "client.lr=[0.1, 0.2", "--out", str(out))
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "driftlab: error: --grid 'client.lr=[0.1, 0.2'" in result.stderr and "KEY=v1,v2" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


def test_grid_values_are_labelled_by_the_last_key_component_with_safe_directory_names():
    spec = sweep_from_config(
        "synthetic-fedprox",
        ["client.lr=[0.1, 0.02]", "algorithm.mu=0.01", 'data.name=["synthetic", "synthetic_iid"]'],
        [0],
        "g",
    )
    runs = plan(spec)
    assert [(r.setting, r.method) for r in runs[:2]] == [
        ("name=synthetic", "lr=0.1, mu=0.01"),
        ("name=synthetic_iid", "lr=0.1, mu=0.01"),
    ]
    assert [r.dir for r in runs] == [
        "runs/name-synthetic/lr-0.1-mu-0.01/seed-0",
        "runs/name-synthetic-iid/lr-0.1-mu-0.01/seed-0",
        "runs/name-synthetic/lr-0.02-mu-0.01/seed-0",
        "runs/name-synthetic-iid/lr-0.02-mu-0.01/seed-0",
    ]
    # the sign stays, so x=-1 and x=1 never share a directory; odd characters become hyphens
    values = grid_axis('server.momentum=[-1, 1, "../a b"]').values
    assert [(v.label, v.dir_name) for v in values] == [
        ("momentum=-1", "momentum--1"),
        ("momentum=1", "momentum-1"),
        ("momentum=../a b", "momentum-..-a-b"),
    ]
    for name in [*(v.dir_name for v in values), *(part for run in runs for part in run.dir.split("/"))]:
        assert name and name not in (".", "..") and not name.startswith("-") and "/" not in name
    # keys ending alike keep as much of themselves as tells them apart
    assert short_keys(["client.lr", "server.lr", "algorithm.mu"]) == ["client.lr", "server.lr", "mu"]
    both = plan(sweep_from_config("synthetic-fedprox", ["client.lr=0.1", "server.lr=1,0.5"], [0], "g"))
    assert [(r.method, r.dir) for r in both] == [
        ("client.lr=0.1, server.lr=1", "runs/client.lr-0.1-server.lr-1/seed-0"),
        ("client.lr=0.1, server.lr=0.5", "runs/client.lr-0.1-server.lr-0.5/seed-0"),
    ]


@pytest.mark.parametrize("name", sweep_names())
def test_shipped_sweeps_keep_their_run_directories(name):
    # Sweep-file labels are slugged as a whole, as before readable --grid labels came: finished runs stay where they are.
    for scale in [None, *load_sweep(name).scales]:
        for run in plan(load_sweep(name), scale):
            method = (
                [slug(run.tuned_method), slug(run.tuned)] if run.tuned else [slug(run.method)]
            )  # a tuned run lives under its method
            expected = ["runs", *([slug(run.setting)] if run.setting else []), *method, f"seed-{run.seed}"]
            assert run.dir == "/".join(expected)


def test_method_label_defaults_to_the_algorithm_when_no_axis_names_methods():
    spec = sweep_from_config("synthetic-fedavg", ["data.synthetic_alpha=[0, 1]"], [3], name="grid")
    runs = plan(spec)
    assert [(r.setting, r.method, r.seed) for r in runs] == [
        ("synthetic_alpha=0", "FedAvg", 3),
        ("synthetic_alpha=1", "FedAvg", 3),
    ]
    assert runs[0].dir == "runs/synthetic-alpha-0/fedavg/seed-3"


def test_labels_that_collapse_to_one_directory_are_rejected():
    values = [{"label": "μ 1", "set": ["algorithm.mu=1"]}, {"label": "μ-1", "set": ["algorithm.mu=0"]}]
    with pytest.raises(ConfigError, match="same directory"):
        plan(tiny_spec(axes=[{"name": "mu", "values": values}]))


def test_a_bad_key_in_any_run_fails_the_plan_and_names_the_run():
    values = [{"label": "ok", "set": ["algorithm.mu=0"]}, {"label": "typo", "set": ["algorithm.muu=1"]}]
    with pytest.raises(ConfigError, match=r"(?s)run typo \(seed 0\).*algorithm.muu"):
        plan(tiny_spec(axes=[{"name": "mu", "values": values}]))


def _method_spec(**changes) -> SweepSpec:
    methods = [
        {"label": "FedAvg", "set": ["algorithm.name=fedavg"]},
        {"label": "FedProx", "set": ["algorithm.name=fedprox", "algorithm.mu=0.01"]},
        {"label": "SCAFFOLD", "set": ["algorithm.name=scaffold"]},
    ]
    return tiny_spec(seeds=[0], axes=[{"name": "method", "role": "method", "values": methods}], **changes)


def test_a_scoped_override_sets_a_key_for_the_runs_of_one_label_only():
    runs = plan(_method_spec(), extra_overrides=["FedProx:algorithm.mu=0.5", "rounds=2"])
    assert [r.config.rounds for r in runs] == [2, 2, 2]
    assert [r.overrides[-4:] for r in runs] == [
        ("rounds=3", "algorithm.name=fedavg", "rounds=2", "seed=0"),
        ("algorithm.mu=0.01", "algorithm.mu=0.5", "rounds=2", "seed=0"),
        ("rounds=3", "algorithm.name=scaffold", "rounds=2", "seed=0"),
    ]
    assert runs[1].config.algorithm.mu == 0.5
    # in the sweep file's own overrides too, and a label holding "=" (a --grid's) scopes as well
    runs = plan(_method_spec(overrides=[*TINY, "rounds=3", "FedProx:algorithm.mu=0.25"]))
    assert runs[1].config.algorithm.mu == 0.01  # the axis value's `set` comes after the sweep's overrides
    grid = sweep_from_config("synthetic-fedprox", ["algorithm.name=fedavg,fedprox"], [0], name="g")
    runs = plan(grid, extra_overrides=[*TINY, "rounds=2", "name=fedprox:algorithm.mu=0.3"])
    assert [getattr(r.config.algorithm, "mu", None) for r in runs] == [None, 0.3]


def test_a_sweep_wide_key_of_one_method_names_its_owners_and_the_scoped_form(built_in_algorithms_only):
    with pytest.raises(ConfigError) as raised:
        plan(_method_spec(), extra_overrides=["algorithm.mu=0.5"])
    message = str(raised.value)
    assert "run FedAvg (seed 0)" in message and "mu is a key of 'fedprox', 'adabest', not of 'fedavg'" in message
    assert (
        "'algorithm.mu=0.5' is set for every run of the sweep, but algorithm.mu is a key of fedprox, adabest only, which the runs of "
        "'FedProx' use; set it for those runs alone with a scoped override: 'FedProx:algorithm.mu=0.5'"
    ) in message


def test_a_scope_that_is_no_label_is_refused_with_the_labels():
    with pytest.raises(ConfigError) as raised:
        plan(_method_spec(), extra_overrides=["Fedprox:algorithm.mu=0.5"])
    assert str(raised.value) == (
        "override 'Fedprox:algorithm.mu=0.5': 'Fedprox' is not the label of a value of the sweep's axes, so it cannot scope the "
        "override (did you mean 'FedProx'?); labels: 'FedAvg', 'FedProx', 'SCAFFOLD'"
    )
    from driftlab.experiments.sweep import scoped_override

    # a colon inside a value is no scope

    assert scoped_override("data.loader=my_module:load", ["FedAvg"]) == (None, "data.loader=my_module:load")
    assert scoped_override("FedAvg: client.lr = 0.1", ["FedAvg"]) == ("FedAvg", " client.lr = 0.1")


def test_a_dotted_key_bomb_or_a_deep_grid_is_refused_in_little_memory(tmp_path):
    import tracemalloc

    bomb = tmp_path / "bomb.toml"
    bomb.write_text('base = "synthetic-fedavg"\n' + "x." * 50_000 + "x = 1\n")  # tomllib took 7.8 GB on this
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=r"bomb.toml: line 2: a dotted key nested more than 32 levels deep"):
            load_sweep(bomb)
        with pytest.raises(ConfigError, match=r"line 1 is nested too deeply .*at most 32 levels"):
            sweep_from_config("synthetic-fedavg", ["client.lr=" + "[" * 50_000 + "]" * 50_000], [0], name="deep")
        with pytest.raises(ConfigError, match=r"nested too deeply"):
            sweep_from_config(
                "synthetic-fedavg", ["client.lr=0.1,{a=" + "[" * 50_000 + "]" * 50_000 + "}"], [0], name="deep"
            )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000  # the texts themselves are 100 kB each


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"bas": "x"}, "unknown key"),
        ({"base": 3}, "`base` must name the config"),
        ({"seeds": []}, "non-empty list"),
        ({"seeds": [0, 0]}, "a seed twice"),
        ({"targets": [97.2]}, "fractions in"),
        ({"steps_reference": "nope"}, "steps_reference='nope' is not a method label"),
        ({"axes": [{"name": "a", "values": [{"label": "x"}]}]}, "each value is"),
        ({"axes": [{"name": "a", "values": [{"label": "x", "set": ["k"]}]}]}, "section.key=value"),
        (
            {"axes": [{"name": "a", "role": "row", "values": [{"label": "x", "set": ["seed=1"]}]}]},
            'role must be "setting" or "method"',
        ),
        (
            {"axes": [{"name": "a", "values": [{"label": "x", "set": ["seed=1"]}, {"label": "x", "set": ["seed=2"]}]}]},
            "labels must differ",
        ),
        ({"scales": {"paper": {"override": []}}}, "scales.paper must be a table"),
    ],
)
def test_bad_sweep_files_get_errors_that_name_the_problem(changes, message):
    with pytest.raises(ConfigError, match=message):
        tiny_spec(**changes)


def test_unknown_scale_lists_the_known_ones():
    spec = tiny_spec(scales={"paper": {"overrides": ["rounds=5"], "seeds": [4]}})
    with pytest.raises(ConfigError, match="no scale 'full'; its scales: paper"):
        plan(spec, scale="full")
    runs = plan(spec, scale="paper")
    assert {r.seed for r in runs} == {4} and all("rounds=5" in r.overrides for r in runs)


def test_a_variant_can_add_overrides_at_one_scale():
    values = [
        {"label": "a", "set": ["algorithm.mu=0"]},
        {"label": "b", "set": ["algorithm.mu=1"], "at_scale": {"paper": ["client.epochs=3"]}},
    ]
    spec = tiny_spec(seeds=[0], axes=[{"name": "m", "values": values}], scales={"paper": {"overrides": ["rounds=7"]}})
    default, paper = plan(spec), plan(spec, "paper")
    assert "client.epochs=3" not in default[1].overrides
    assert paper[1].overrides[-3:] == ("algorithm.mu=1", "client.epochs=3", "seed=0")
    assert load_config("synthetic-fedprox", paper[1].overrides).client.epochs == 3
    assert load_config("synthetic-fedprox", paper[0].overrides).client.epochs == 1
    with pytest.raises(ConfigError, match="at_scale names 'full', which is not under \\[scales\\]"):
        tiny_spec(axes=[{"name": "m", "values": [{"label": "a", "set": [], "at_scale": {"full": ["rounds=2"]}}]}])


def test_sweep_file_base_is_read_relative_to_the_file(tmp_path):
    (tmp_path / "base.toml").write_text("rounds = 2\n[data]\nnum_clients = 5\n")
    (tmp_path / "s.toml").write_text(
        'base = "base.toml"\n[[axes]]\nname = "lr"\nvalues = [{ label = "a", set = ["client.lr=0.5"] }]\n'
    )
    spec = load_sweep(tmp_path / "s.toml")
    assert spec.name == "s" and Path(spec.base) == tmp_path / "base.toml"
    assert load_config(spec.base, plan(spec)[0].overrides).data.num_clients == 5


def test_missing_sweep_names_the_shipped_ones():
    with pytest.raises(ConfigError, match="shipped sweeps: .*fedprox-figure1"):
        load_sweep("no-such-sweep")


@pytest.mark.parametrize("name", sweep_names())
def test_every_shipped_sweep_plans_at_both_scales(name):
    spec = load_sweep(name)
    assert spec.description and spec.axes
    for scale in [None, *spec.scales]:
        runs = plan(spec, scale)
        assert len(runs) == len({r.dir for r in runs}) >= 2


def test_a_grid_sweep_is_described_by_its_base_axes_and_seeds():
    spec = sweep_from_config(
        "synthetic-fedprox", ["algorithm.mu=[0, 0.01]", "data.partition=iid,dirichlet"], [0, 1], "g"
    )
    assert (
        spec.description
        == "Grid on synthetic-fedprox: algorithm.mu ∈ {0, 0.01} × data.partition ∈ {iid, dirichlet}; seeds 0, 1."
    )
    document = sweep_document(spec, plan(spec), None, [])
    assert document["description"] == spec.description and document["run_note"] == ""


def test_the_description_says_what_was_run_when_it_is_not_the_default_scale():
    spec = load_sweep("fedprox-figure1")
    assert "200 rounds" in spec.description
    default = sweep_document(spec, plan(spec), None, [])
    assert (default["description"], default["run_note"], default["rounds"]) == (spec.description, "", [200])
    short = sweep_document(spec, plan(spec, None, ["rounds=5"]), None, ["rounds=5"])
    assert short["description"] == spec.description + "\n(run here with: rounds=5)"
    assert (short["spec_description"], short["run_note"], short["command_overrides"], short["rounds"]) == (
        spec.description,
        "(run here with: rounds=5)",
        ["rounds=5"],
        [5],
    )
    paper = sweep_document(spec, plan(spec, "paper", ["rounds=7"]), "paper", ["rounds=7"])
    assert paper["run_note"] == "(run here with: scale paper (seeds 0, 1, 2, 3, 4); rounds=7)"
    quadratic = load_sweep("decaying-k-quadratic")
    at_paper = sweep_document(quadratic, plan(quadratic, "paper"), "paper", [])
    assert at_paper["run_note"] == "(run here with: scale paper (rounds=3000))" and at_paper["rounds"] == [3000]


def test_slug():
    assert slug("Dirichlet 0.3, 10%") == "dirichlet-0.3-10pct"
    assert slug("constant K, decaying γ") == "constant-k-decaying-gamma"


# ---------------------------------------------------------------- running


@pytest.mark.slow
def test_sweep_runs_in_parallel_skips_finished_runs_and_extends_rounds_exactly(tmp_path):
    # evaluation every 2 rounds: round 3 is evaluated only while it is the last round
    spec = tiny_spec(overrides=[*TINY, "rounds=3", "evaluation.every=2"])
    logged: list[str] = []
    outcomes = run_sweep(spec, tmp_path / "s", jobs=2, log=logged.append)
    assert [o.status for o in outcomes] == ["complete"] * 4
    assert "4 to run in 2 process(es)" in logged[0]
    document = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert [r["method"] for r in document["runs"]] == ["μ=0", "μ=0", "μ=1", "μ=1"] and document["targets"] == [0.5]
    first = metrics(tmp_path / "s" / outcomes[0].run.dir)
    assert [r["round"] for r in first] == [1, 2, 3]
    assert ["test_accuracy" in r for r in first] == [False, True, True]

    logged.clear()
    again = run_sweep(spec, tmp_path / "s", jobs=2, log=logged.append)
    assert [o.status for o in again] == ["complete"] * 4 and "4 already finished, 0 to run" in logged[0]

    # more rounds: every run resumes (from round 0: a completed run keeps no checkpoint by default) and matches a run made in one go
    logged.clear()
    run_sweep(spec, tmp_path / "s", jobs=1, extra_overrides=["rounds=5"], log=logged.append)
    assert sum("(resuming)" in line for line in logged) == 4
    straight = run_sweep(spec, tmp_path / "straight", jobs=1, extra_overrides=["rounds=5"], log=lambda _: None)
    for outcome in straight:
        extended = metrics(tmp_path / "s" / outcome.run.dir)
        assert extended == metrics(tmp_path / "straight" / outcome.run.dir)
        assert ["test_accuracy" in r for r in extended] == [False, True, False, True, True]


@pytest.mark.slow
def test_changed_overrides_in_an_existing_sweep_directory_are_refused(tmp_path):
    spec = tiny_spec(seeds=[0], axes=[{"name": "mu", "values": [{"label": "m", "set": ["algorithm.mu=0"]}]}])
    run_sweep(spec, tmp_path, jobs=1, log=lambda _: None)
    changed = tiny_spec(seeds=[0], axes=[{"name": "mu", "values": [{"label": "m", "set": ["algorithm.mu=1"]}]}])
    with pytest.raises(ConfigError, match="only rounds may change"):
        run_sweep(changed, tmp_path, jobs=1, log=lambda _: None)
    with pytest.raises(ConfigError, match="holds sweep 'tiny' at scale 'default'"):
        run_sweep(SweepSpec(name="other", base="synthetic-fedprox"), tmp_path, jobs=1, log=lambda _: None)


@pytest.mark.slow
def test_failed_runs_are_recorded_and_retried_and_diverged_runs_are_left_alone(tmp_path):
    values = [
        {"label": "fine", "set": ["algorithm.mu=0"]},
        {"label": "no data", "set": ["data.name=mnist", "model.name=mlp", f"data.root={tmp_path / 'absent'}"]},
        {"label": "diverges", "set": ["client.lr=1e6"]},
    ]
    spec = tiny_spec(seeds=[0], axes=[{"name": "m", "role": "method", "values": values}])
    outcomes = {o.run.method: o for o in run_sweep(spec, tmp_path / "s", jobs=2, log=lambda _: None)}
    assert outcomes["fine"].status == "complete"
    assert outcomes["no data"].status == "failed" and "absent" in outcomes["no data"].message
    assert (tmp_path / "s" / outcomes["no data"].run.dir / FAILURE_FILE).exists()
    assert outcomes["diverges"].status == "diverged" and "non-finite" in outcomes["diverges"].message
    assert read_run_info(tmp_path / "s" / outcomes["diverges"].run.dir)["status"] == "diverged"

    logged: list[str] = []
    again = {o.run.method: o for o in run_sweep(spec, tmp_path / "s", jobs=2, log=logged.append)}
    assert "1 to run" in logged[0]  # only the failed run is retried
    assert again["no data"].status == "failed" and again["diverges"].status == "diverged"
    retried = run_sweep(spec, tmp_path / "s", jobs=2, retry_diverged=True, log=logged.append)
    assert [o.status for o in retried] == ["complete", "failed", "diverged"]


def test_run_status_reads_the_run_directory(tmp_path):
    assert run_status(tmp_path / "none", 5) == "pending"
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    assert run_status(run_dir, 5) == "interrupted"
    (run_dir / "run.json").write_text(json.dumps({"status": "complete", "rounds_done": 5}))
    assert run_status(run_dir, 5) == "complete"
    assert run_status(run_dir, 8) == "interrupted"  # rounds raised since: resume
    (run_dir / "run.json").write_text(json.dumps({"status": "running", "rounds_done": 2}))
    assert run_status(run_dir, 5) == "interrupted"
    (run_dir / FAILURE_FILE).write_text("boom")
    assert run_status(run_dir, 5) == "failed"


def _long_sweep(tmp_path: Path, epochs: int) -> tuple[list[str], list[Path]]:
    """A sweep of two FedProx runs (mu 0 and 1) of 400 rounds, too long to finish within a test: the ``driftlab
    sweep`` command that runs it into ``tmp_path/out`` (its last word), and the two runs' directories."""
    sweep_file = tmp_path / "s.toml"
    sweep_file.write_text(
        'base = "synthetic-fedprox"\n'
        f'overrides = ["data.num_clients=6", "client.epochs={epochs}", "sampling.participation=0.5", "rounds=400", '
        '"checkpoint_every=1000"]\n'
        "seeds = [0]\n"
        '[[axes]]\nname = "mu"\nvalues = [{ label = "a", set = ["algorithm.mu=0"] }, { label = "b", set = ["algorithm.mu=1"] }]\n'
    )
    out = tmp_path / "out"
    command = sweep_command(str(sweep_file), "--jobs", "2", "--no-report", "--out", str(out))
    return command, [out / "runs" / "a" / "seed-0", out / "runs" / "b" / "seed-0"]


def _wait_for_five_rounds(run_dirs: list[Path]) -> None:
    """Wait (two minutes at most) until every run has written the metrics of 5 rounds."""
    deadline = time.time() + 120
    while time.time() < deadline and not all(
        (d / "metrics.jsonl").exists() and len((d / "metrics.jsonl").read_text().splitlines()) >= 5 for d in run_dirs
    ):
        time.sleep(0.2)


def _assert_the_rerun_equals_an_uninterrupted_sweep(tmp_path: Path, command: list[str]) -> str:
    """Run the interrupted sweep's command again: both runs resume, and their metrics equal those of the same sweep
    run straight through into ``tmp_path/straight``.  Returns the rerun's output."""
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.count("(resuming)") == 2
    straight = subprocess.run([*command[:-1], str(tmp_path / "straight")], capture_output=True, text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr
    for name in ("a", "b"):
        run = Path("runs") / name / "seed-0"
        assert metrics(tmp_path / "out" / run) == metrics(tmp_path / "straight" / run)
    return resumed.stdout


@pytest.mark.slow
def test_a_terminated_sweep_checkpoints_its_runs_and_resumes_to_identical_results(tmp_path):
    command, run_dirs = _long_sweep(tmp_path, epochs=2)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_five_rounds(run_dirs)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    for run_dir in run_dirs:
        info = read_run_info(run_dir)
        assert info["status"] == "interrupted" and 5 <= info["rounds_done"] < 400
        assert (run_dir / "checkpoint.safetensors").exists()
    _assert_the_rerun_equals_an_uninterrupted_sweep(tmp_path, command)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _stop(pids: list[int]) -> None:
    for pid in pids:
        if not process_gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 30
    while time.time() < deadline and not all(process_gone(pid) for pid in pids):
        time.sleep(0.1)


def test_process_gone_tells_ended_processes_from_live_ones():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert not process_gone(os.getpid()) and not process_gone(child.pid)
        child.kill()
        deadline = time.time() + 10
        while time.time() < deadline and not process_gone(child.pid):  # a zombie until reaped: ended all the same
            time.sleep(0.05)
        assert process_gone(child.pid)
    finally:
        child.kill()
        child.wait(timeout=10)
    assert process_gone(child.pid)


def test_a_run_stops_at_the_first_termination_signal_and_ignores_the_next_ones():
    # A sweep killed outright signals each run once per exiting thread; only the first may interrupt the checkpoint.
    from driftlab.executors.worker import _stop_at_first_termination

    previous = signal.signal(signal.SIGTERM, _stop_at_first_termination)
    try:
        with pytest.raises(KeyboardInterrupt, match="terminated by signal 15"):
            signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # ignored: no second KeyboardInterrupt
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the sweep's workers through /proc")
def test_runs_die_with_a_killed_sweep_and_the_rerun_equals_an_uninterrupted_sweep(tmp_path):
    command, run_dirs = _long_sweep(tmp_path, epochs=1)
    sweep = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        _wait_for_five_rounds(run_dirs)
        workers = _children(sweep.pid)
        assert len(workers) == 2
        sweep.kill()  # SIGKILL to the sweep alone: no chance to pass anything on to its runs
        sweep.wait(timeout=30)
        deadline = time.time() + 60
        while time.time() < deadline and not all(process_gone(pid) for pid in workers):
            time.sleep(0.1)
        assert all(process_gone(pid) for pid in workers), "a run outlived its sweep"
        for run_dir in run_dirs:
            info = read_run_info(run_dir)  # each run was told to stop: it saved its last round and said so
            assert info["status"] == "interrupted" and 5 <= info["rounds_done"] < 400
            assert (run_dir / "checkpoint.safetensors").exists()
    finally:
        _stop([sweep.pid, *workers])
        with contextlib.suppress(subprocess.TimeoutExpired):
            sweep.wait(timeout=30)
    assert "running elsewhere" not in _assert_the_rerun_equals_an_uninterrupted_sweep(tmp_path, command)


@pytest.mark.slow
def test_a_run_whose_directory_another_process_holds_is_not_started_twice(tmp_path, monkeypatch):
    import fcntl

    from driftlab.executors import processes
    from driftlab.experiments.sweep import directory

    spec = sweep_from_config("synthetic-fedprox", ["algorithm.mu=[0, 1]"], [0], name="s")
    extra = [*TINY, "rounds=2"]
    from driftlab.experiments.sweep.execution import SWEEP_NAMES
    from driftlab.owned_folder import claim

    claim(tmp_path, SWEEP_NAMES, "driftlab sweep")  # as a sweep that started the held run left it: runs/ is driftlab's
    held = tmp_path / "runs" / "mu-1" / "seed-0"
    held.mkdir(parents=True)
    with open(held / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live run holds its directory
        lock.write("4242\n")
        lock.flush()
        logged: list[str] = []
        outcomes = run_sweep(spec, tmp_path, jobs=2, extra_overrides=extra, log=logged.append)
        assert [o.status for o in outcomes] == ["complete", "running"]
        assert outcomes[1].message.startswith("running elsewhere (pid 4242")
        assert any("running elsewhere (pid 4242" in line for line in logged)
        assert sorted(os.listdir(held)) == [".lock"]  # not a byte written beside the other writer
        # Had the lock been taken after the sweep looked, the run itself refuses, and still writes nothing.
        monkeypatch.setattr(directory, "run_directory_holder", lambda run_dir: None)
        monkeypatch.setattr(processes, "run_directory_holder", lambda run_dir: None)
        outcomes = run_sweep(spec, tmp_path, jobs=1, extra_overrides=extra, log=lambda _: None)
        assert [o.status for o in outcomes] == ["complete", "running"] and "running elsewhere" in outcomes[1].message
        assert sorted(os.listdir(held)) == [".lock"]
        monkeypatch.undo()
    outcomes = run_sweep(spec, tmp_path, jobs=1, extra_overrides=extra, log=lambda _: None)
    assert [o.status for o in outcomes] == ["complete", "complete"]


@pytest.mark.slow
def test_spawned_runs_split_the_cores_between_them(tmp_path):
    spec = tiny_spec(
        seeds=[0],
        axes=[
            {
                "name": "m",
                "values": [{"label": "a", "set": ["algorithm.mu=0"]}, {"label": "b", "set": ["algorithm.mu=1"]}],
            }
        ],
    )
    run_sweep(spec, tmp_path, jobs=2, log=lambda _: None)
    threads = [read_run_info(tmp_path / "runs" / name / "seed-0")["machine"]["torch_threads"] for name in ("a", "b")]
    assert threads == [max(1, len(os.sched_getaffinity(0)) // 2)] * 2


README = Path(__file__).resolve().parents[3] / "README.md"


@pytest.mark.slow
@pytest.mark.skipif(not README.exists(), reason="README.md is beside the package only in a source checkout")
def test_readme_sweep_example_and_commands_are_valid(tmp_path):
    import re
    import shlex

    text = README.read_text()
    example = next(
        block for block in re.findall(r"```toml\n(.*?)```", text, re.S) if "[axes]" in block
    )  # the sweep example
    (tmp_path / "example.toml").write_text(example)
    runs = plan(load_sweep(tmp_path / "example.toml"))
    assert len(runs) == 12 and {r.method for r in runs} == {"FedAvg", "FedProx"}
    for name in sweep_names():
        assert f"`{name}`" in text, f"README does not list the shipped sweep {name}"
    commands = [line.split("#")[0].strip() for line in text.splitlines() if line.startswith("driftlab sweep ")]
    assert commands
    for command in commands:
        args = shlex.split(command)[2:]
        if "--status" in args:
            continue  # reads a sweep directory: sweep_status_test runs it
        args[args.index("--out") + 1] = str(tmp_path / "out")
        result = subprocess.run(sweep_command(*args, "--dry-run"), capture_output=True, text=True)
        assert result.returncode == 0, (command, result.stderr)
        assert result.stdout.startswith("pending"), command


@pytest.mark.slow
def test_a_plain_script_without_a_main_guard_can_run_a_sweep(tmp_path):
    # Runs start in fresh interpreters, so the caller's script is not imported again in each of them.
    script = tmp_path / "script.py"
    script.write_text(
        "import driftlab\n"
        "from driftlab.experiments.sweep import sweep_from_config\n"
        f"spec = sweep_from_config('synthetic-fedprox', ['algorithm.mu=[0, 1]'], [0], name='s')\n"
        f"outcomes = driftlab.run_sweep(spec, {str(tmp_path / 'out')!r}, jobs=2, extra_overrides={TINY + ['rounds=2']!r})\n"
        "print([o.status for o in outcomes])\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "['complete', 'complete']"
    assert result.stdout.count("start ") == 2


@pytest.mark.slow
def test_a_sweep_directory_refuses_runs_of_another_configuration(tmp_path):
    spec = sweep_from_config("synthetic-fedprox", ["algorithm.mu=[0]"], [0], name="s")
    run_sweep(spec, tmp_path, jobs=1, extra_overrides=[*TINY, "rounds=2"], log=lambda _: None)
    # same labels, name and axes, but another base config: the finished run must not count as this sweep's
    (tmp_path / "base.toml").write_text('[algorithm]\nname = "fedprox"\n[client]\nlr = 0.5\n')
    changed = SweepSpec(name="s", base=str(tmp_path / "base.toml"), seeds=(0,), axes=spec.axes)
    with pytest.raises(ConfigError, match="holds a run of another configuration"):
        run_sweep(changed, tmp_path, jobs=1, extra_overrides=[*TINY, "rounds=2"], log=lambda _: None)


@pytest.mark.slow
def test_lowering_rounds_is_refused_before_anything_runs(tmp_path):
    spec = sweep_from_config("synthetic-fedprox", ["algorithm.mu=[0]"], [0], name="s")
    run_sweep(spec, tmp_path, jobs=1, extra_overrides=[*TINY, "rounds=3"], log=lambda _: None)
    with pytest.raises(ConfigError, match="has 3 rounds done, more than rounds=2"):
        run_sweep(spec, tmp_path, jobs=1, extra_overrides=[*TINY, "rounds=2"], log=lambda _: None)
    assert not list(tmp_path.glob("runs/*/*/failure.txt"))


def test_a_second_sweep_on_the_same_directory_is_refused(tmp_path):
    import fcntl

    spec = sweep_from_config("synthetic-fedprox", ["algorithm.mu=[0]"], [0], name="s")
    with open(tmp_path / ".sweep.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running sweep holds it
        with pytest.raises(ConfigError, match="another `driftlab sweep` is running on"):
            run_sweep(spec, tmp_path, jobs=1, extra_overrides=[*TINY, "rounds=2"], log=lambda _: None)
    assert not (tmp_path / "runs").exists()


def test_every_public_name_of_the_sweep_modules_is_importable_from_the_package():
    import driftlab.experiments.sweep as package
    from driftlab.experiments.sweep import directory, execution, planning, spec

    modules = (spec, planning, directory, execution)
    for module in modules:
        for name in module.__all__:
            assert getattr(package, name) is getattr(module, name), (module.__name__, name)
    assert sorted(package.__all__) == sorted(name for module in modules for name in module.__all__)
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        package.no_such_name  # noqa: B018


def test_the_sweep_directory_module_imports_no_torch():
    # sweep_status and reports read sweep directories through it
    code = (
        "import sys; import driftlab.experiments.sweep.directory, driftlab.experiments.sweep.sweep_status; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- the user's files in --out


def test_a_users_file_of_a_sweep_s_name_is_left_untouched_until_forced_and_the_sweep_then_resumes(tmp_path, capsys):
    from driftlab import cli

    out = tmp_path / "mine"
    out.mkdir()
    (out / "sweep.json").write_bytes(b'{"my": "own plan"}\n')
    (out / "notes.txt").write_bytes(b"mine")
    command = [
        "sweep",
        "synthetic-fedprox",
        *TINY,
        "rounds=1",
        "--grid",
        "algorithm.mu=0",
        "--seeds",
        "0",
        "--out",
        str(out),
    ]
    assert cli.main([*command, "--no-report"]) == 2
    assert capsys.readouterr().err == (
        f"driftlab: error: {out} already holds sweep.json, not written by driftlab (or changed since); nothing was written: "
        "choose another --out directory, or pass --force to replace it\n"
    )
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "sweep.json"]
    assert (out / "sweep.json").read_bytes() == b'{"my": "own plan"}\n'

    spec = sweep_from_config("synthetic-fedprox", ["algorithm.mu=0"], [0], "mine")
    overrides = [*TINY, "rounds=1"]
    outcomes = run_sweep(spec, out, jobs=1, extra_overrides=overrides, log=lambda _: None, force=True)
    assert [o.status for o in outcomes] == ["complete"] and (out / "notes.txt").read_bytes() == b"mine"
    assert json.loads((out / "sweep.json").read_text())["name"] == "mine"
    logged: list[str] = []
    again = run_sweep(spec, out, jobs=1, extra_overrides=overrides, log=logged.append)  # its own folder now: resumed
    assert [o.status for o in again] == ["complete"] and "1 already finished, 0 to run" in logged[0]


def test_a_sweep_directory_from_before_manifests_is_recognised_as_the_sweep_s_own(tmp_path):
    from driftlab.experiments.sweep.execution import SWEEP_NAMES, earlier_sweep
    from driftlab.owned_folder import claim

    spec = sweep_from_config("synthetic-fedprox", ["algorithm.mu=0"], [0], "old")
    planned = plan(spec, None, TINY)
    (tmp_path / "sweep.json").write_text(
        json.dumps(sweep_document(spec, planned, None, TINY))
    )  # as an older version left it
    (tmp_path / "jobs.json").write_text("{}")
    (tmp_path / "runs").mkdir()
    assert claim(tmp_path, SWEEP_NAMES, "driftlab sweep", recognise=earlier_sweep).files["runs"] == "driftlab sweep"
    (tmp_path / "sweep.json").write_text('{"name": "a user\'s file, no plan"}')
    (tmp_path / ".driftlab-written.json").unlink()
    with pytest.raises(ConfigError, match="holds sweep.json, jobs.json, runs, not written by driftlab"):
        claim(tmp_path, SWEEP_NAMES, "driftlab sweep", recognise=earlier_sweep)


def test_a_users_report_md_in_the_sweep_s_report_folder_stops_the_sweep_before_any_run(tmp_path, capsys):
    from driftlab import cli

    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "report.md").write_bytes(b"mine\n")
    assert (
        cli.main(["sweep", "synthetic-fedprox", *TINY, "rounds=1", "--grid", "algorithm.mu=0", "--out", str(tmp_path)])
        == 2
    )
    assert f"{tmp_path / 'report'} already holds report.md, not written by driftlab" in capsys.readouterr().err
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["report", "report/report.md"]
