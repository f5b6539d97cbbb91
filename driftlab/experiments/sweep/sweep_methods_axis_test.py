"""A tuned axis that applies to some methods only (``methods = ["FedProx"]``, issue 29): FedDyn's α or FedProx's μ is
no hyper-parameter of FedAvg, whose runs are planned once and reported untuned beside the tuned methods' picks."""

from __future__ import annotations

import csv
import json

import pytest

from driftlab.errors import ConfigError
from driftlab.experiments.cli_test import driftlab_cli
from driftlab.experiments.sweep import plan, run_sweep, sweep_document, sweep_from_table
from driftlab.experiments.sweep.sweep_status import sweep_status

TINY = ["data.num_clients=6", "client.epochs=1", "sampling.participation=0.5", "evaluation.every=1"]
METHODS = {
    "name": "method",
    "role": "method",
    "values": [
        {"label": "FedAvg", "set": ["algorithm.name=fedavg"]},
        {"label": "FedProx", "set": ["algorithm.name=fedprox"]},
        {"label": "FedDyn", "set": ["algorithm.name=feddyn"]},
    ],
}
SETTINGS = {
    "name": "data",
    "role": "setting",
    "values": [{"label": "syn(0,0)", "set": ["data.synthetic_alpha=0", "data.synthetic_beta=0"]}],
}


def tuned(name: str, key: str, label: str, values, methods: list[str] | None = None) -> dict:
    """A tuned axis over ``key`` (values labelled ``label=v``), for ``methods`` only when given."""
    axis = {"name": name, "role": "tuned", "values": [{"label": f"{label}={v}", "set": [f"{key}={v}"]} for v in values]}
    return axis if methods is None else {**axis, "methods": methods}


MU = tuned("mu", "algorithm.mu", "μ", (0.01, 1), ["FedProx"])
ALPHA = tuned("alpha", "algorithm.alpha", "α", (0.01, 0.1), ["FedDyn"])
LR = tuned("lr", "client.lr", "lr", (0.01, 0.1))


def table(**changes) -> dict:
    base = {
        "base": "synthetic-fedprox",
        "overrides": [*TINY, "rounds=2", "data.validation_fraction=0.2"],
        "seeds": [0, 1],
        "axes": [SETTINGS, METHODS, MU],
    }
    return {**base, **changes}


def spec(**changes):
    return sweep_from_table(table(**changes), "test sweep", "methods")


# ---------------------------------------------------------------- planning


def test_an_axis_for_one_method_multiplies_its_runs_only_and_leaves_the_others_as_without_tuned_axes():
    runs = plan(spec())
    assert [(r.dir, r.method, r.tuned, r.tuned_method) for r in runs if r.seed == 0] == [
        ("runs/syn-0-0/fedavg/seed-0", "FedAvg", "", ""),
        ("runs/syn-0-0/fedprox/mu-0.01/seed-0", "FedProx (μ=0.01)", "μ=0.01", "FedProx"),
        ("runs/syn-0-0/fedprox/mu-1/seed-0", "FedProx (μ=1)", "μ=1", "FedProx"),
        ("runs/syn-0-0/feddyn/seed-0", "FedDyn", "", ""),
    ]
    assert len(runs) == 2 * (1 + 2 + 1)
    # FedAvg's and FedDyn's runs are those of the same sweep without the μ axis: same directories, overrides and configs
    untuned = {r.dir: r for r in plan(spec(axes=[SETTINGS, METHODS]))}
    for run in runs:
        if not run.tuned:
            same = untuned[run.dir]
            assert (run.method, run.overrides, run.config.fingerprint()) == (
                same.method,
                same.overrides,
                same.config.fingerprint(),
            )
    assert {r.config.algorithm.mu for r in runs if r.tuned_method == "FedProx"} == {0.01, 1}


def test_a_run_is_tuned_over_the_product_of_the_tuned_axes_that_apply_to_its_method():
    runs = plan(spec(axes=[SETTINGS, METHODS, LR, MU, ALPHA], seeds=[0]))
    tuned = {r.method.split(" (")[0]: [] for r in runs}
    for run in runs:
        tuned[run.method.split(" (")[0]].append(run.tuned)
    assert tuned == {
        "FedAvg": ["lr=0.01", "lr=0.1"],
        "FedProx": ["lr=0.01, μ=0.01", "lr=0.01, μ=1", "lr=0.1, μ=0.01", "lr=0.1, μ=1"],
        "FedDyn": ["lr=0.01, α=0.01", "lr=0.01, α=0.1", "lr=0.1, α=0.01", "lr=0.1, α=0.1"],
    }
    assert [r.dir for r in runs if r.tuned_method == "FedDyn"][-1] == "runs/syn-0-0/feddyn/lr-0.1-alpha-0.1/seed-0"
    assert all(r.config.algorithm.alpha == float(r.tuned.split("α=")[1]) for r in runs if r.tuned_method == "FedDyn")


def test_methods_naming_every_method_plans_what_no_methods_plans():
    every_method = plan(spec(axes=[SETTINGS, METHODS, {**LR, "methods": ["FedProx", "FedAvg", "FedDyn"]}]))
    no_methods = plan(spec(axes=[SETTINGS, METHODS, LR]))
    assert [(r.dir, r.method, r.overrides) for r in every_method] == [
        (r.dir, r.method, r.overrides) for r in no_methods
    ]
    assert len(no_methods) == 3 * 2 * 2 and all(r.tuned for r in no_methods)


def test_sweep_json_names_the_axis_methods_and_gives_untuned_runs_no_tuned_entry():
    s = spec()
    document = sweep_document(s, plan(s), None, [])
    assert document["axes"][2]["methods"] == ["FedProx"] and "methods" not in document["axes"][1]
    entries = {entry["dir"]: entry for entry in document["runs"]}
    assert set(entries["runs/syn-0-0/fedavg/seed-0"]) == {"dir", "setting", "method", "seed", "overrides"}
    assert entries["runs/syn-0-0/fedprox/mu-1/seed-1"]["tuned_method"] == "FedProx"
    assert document["tuning"] == {"metric": "validation_accuracy", "rule": "final", "axes": ["mu"]}


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        (
            [SETTINGS, {**METHODS, "methods": ["FedAvg"]}, MU],
            "axis 'method' has role = 'method' and `methods`.*mark the axis role = \"tuned\"",
        ),
        ([{**SETTINGS, "methods": ["FedAvg"]}, METHODS, MU], "axis 'data' has role = 'setting' and `methods`"),
        (
            [SETTINGS, METHODS, {**MU, "methods": ["FedProxx"]}],
            r"methods lists 'FedProxx', which is no value of the method axes \(did you mean 'FedProx'\?\)",
        ),
        ([SETTINGS, METHODS, {**MU, "methods": []}], "`methods` is empty, so the axis would tune no run"),
        ([SETTINGS, METHODS, {**MU, "methods": "FedProx"}], "`methods` must be a list of method labels"),
        ([SETTINGS, METHODS, {**MU, "methods": ["FedProx", "FedProx"]}], "lists a method twice"),
        ([SETTINGS, {**MU, "methods": ["FedProx"]}], 'no axis with role = "method"'),
        ([SETTINGS, METHODS, {**MU, "methods": ["syn(0,0)"]}], "'syn\\(0,0\\)', which is no value of the method axes"),
    ],
)
def test_bad_methods_are_refused_when_the_sweep_is_read(axes, message):
    with pytest.raises(ConfigError, match=message):
        spec(axes=axes)


# ---------------------------------------------------------------- running and reporting


def final(run_dir, key):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r[key] for r in reversed(records) if key in r)


@pytest.mark.slow
def test_a_tiny_sweep_picks_the_tuned_method_on_validation_and_reports_the_others_untuned(tmp_path):
    # FedProx is tuned over its lr, one value far too small to learn in 2 rounds: its candidates differ, and the pick
    # must be the one best on validation. FedAvg has no tuned axis: one run per seed, a row of its own.
    lr = tuned("lr", "client.lr", "lr", (1e-5, 0.1), ["FedProx"])
    methods = {**METHODS, "values": METHODS["values"][:2]}
    s = spec(axes=[SETTINGS, methods, lr])
    out = tmp_path / "sweep"
    outcomes = run_sweep(s, out, jobs=2, log=lambda _: None)
    assert sorted(o.status for o in outcomes) == ["complete"] * 6
    assert sorted(state.dir for state in sweep_status(out)) == sorted(r.dir for r in plan(s))
    validation = {
        value: [final(out / f"runs/syn-0-0/fedprox/lr-{value}/seed-{seed}", "validation_accuracy") for seed in (0, 1)]
        for value in ("1e-05", "0.1")
    }
    assert sum(validation["0.1"]) != sum(validation["1e-05"])  # the candidates differ
    best = max(validation, key=lambda v: sum(validation[v]))

    from driftlab.experiments.report import make_report

    report = make_report([out], tmp_path / "report", plots=False)
    rows = {row.method: row for row in report.accuracy}
    assert list(rows) == ["FedAvg", "FedProx"]  # the untuned method's row beside the tuned method's pick
    fedavg_test = [final(out / f"runs/syn-0-0/fedavg/seed-{seed}", "test_accuracy") for seed in (0, 1)]
    assert rows["FedAvg"].seeds == 2 and rows["FedAvg"].final_accuracy.mean == pytest.approx(sum(fedavg_test) / 2)
    picked_test = [final(out / f"runs/syn-0-0/fedprox/lr-{best}/seed-{seed}", "test_accuracy") for seed in (0, 1)]
    assert rows["FedProx"].final_accuracy.mean == pytest.approx(sum(picked_test) / 2)
    assert f"FedProx is reported at its tuned value lr={float(best):g}, picked on validation" in report.markdown
    assert "FedAvg has no tuned axis" in report.markdown
    with (tmp_path / "report" / "tuning.csv").open() as handle:
        grid = list(csv.DictReader(handle))
    assert {row["method"] for row in grid} == {"FedProx"} and len(grid) == 2  # tuning.csv lists the tuned method only
    assert [row["tuned_value"] for row in grid if row["picked"] == "1"] == [f"lr={float(best):g}"]
    appendix = report.markdown.split("## Appendix: tuned grids", 1)[1]
    assert "| FedProx |" in appendix and "| FedAvg |" not in appendix


@pytest.mark.slow
def test_halving_ranks_the_tuned_methods_candidates_only_and_dry_run_lists_the_runs(tmp_path):
    lr = tuned("lr", "client.lr", "lr", (1e-5, 0.03, 0.1), ["FedProx"])
    methods = {**METHODS, "values": METHODS["values"][:2]}
    overrides = [*TINY, "rounds=3", "data.validation_fraction=0.2"]
    s = spec(axes=[SETTINGS, methods, lr], seeds=[0], halving={"first": 1}, overrides=overrides)
    logged: list[str] = []
    outcomes = run_sweep(s, tmp_path / "sweep", jobs=2, log=logged.append)
    status = {o.run.dir: o.status for o in outcomes}
    assert status["runs/syn-0-0/fedavg/seed-0"] == "complete"  # never a candidate: runs to its rounds
    assert sorted(v for d, v in status.items() if "/fedprox/" in d) == ["complete", "stopped", "stopped"]
    halved = [line.strip() for line in logged if "halving " in line and " at round" in line]
    assert halved == ["halving syn(0,0) / FedProx at round 1: 1 of 3 values go on"]

    sweep_file = tmp_path / "methods.toml"
    sweep_file.write_text(json_to_toml(table(axes=[SETTINGS, methods, lr], seeds=[0])))
    listed = driftlab_cli("sweep", sweep_file, "--out", tmp_path / "listed", "--dry-run")
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[1] for line in listed.stdout.splitlines()] == [
        "runs/syn-0-0/fedavg/seed-0",
        "runs/syn-0-0/fedprox/lr-1e-05/seed-0",
        "runs/syn-0-0/fedprox/lr-0.03/seed-0",
        "runs/syn-0-0/fedprox/lr-0.1/seed-0",
    ]


def json_to_toml(content: dict) -> str:
    """A sweep table as TOML (JSON's strings, numbers and lists are TOML's; tables become inline tables)."""

    def value(v):
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v, ensure_ascii=False)

    lines = [f"{k} = {value(v)}" for k, v in content.items() if k != "axes"]
    for axis in content.get("axes", []):
        lines += ["", "[[axes]]", *(f"{k} = {value(v)}" for k, v in axis.items())]
    return "\n".join(lines) + "\n"


def test_the_report_keeps_an_untuned_methods_row_and_says_why_it_has_no_pick(tmp_path):
    from driftlab.experiments.report import make_report
    from driftlab.experiments.report.tuning_test import tuned_sweep

    # hand-built: FedAvg untuned (runs/fedavg/seed-s, no `tuned` entry), FedProx tuned over μ
    report = make_report([tuned_sweep(tmp_path / "s")], tmp_path / "report", plots=False)
    assert [row.method for row in report.accuracy] == ["FedAvg", "FedProx"]
    assert [row.method for row in report.accuracy if row.seeds == 2] == ["FedAvg", "FedProx"]
    assert "FedAvg has no tuned axis (none applies to it): its rows are its one configuration's runs" in report.markdown
    assert {cell.method for cell in report.tuning.cells} == {"FedProx"} and report.tuning.untuned == {
        "tuned": ["FedAvg"]
    }
