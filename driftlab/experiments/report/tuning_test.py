"""Tuned axes in reports: hand-built sweep directories whose picks can be worked out on paper."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from driftlab.errors import ConfigError
from driftlab.experiments.config import load_config
from driftlab.experiments.report.read import collect
from driftlab.experiments.report.tuning import (
    Tuning,
    ValueRuns,
    apply_tuning,
    ranked_values,
    run_score,
    tuning_appendix,
    tuning_from_keys,
)

BASE_RECORD = {"num_selected": 2, "local_steps": 10, "upload_bits": 640, "download_bits": 640}


def records(validation, test, key="validation_accuracy"):
    """One record per round with the given validation and test accuracies (None: that round not evaluated)."""
    out = []
    for index, (v, t) in enumerate(zip(validation, test, strict=True)):
        record = {"round": index + 1, **BASE_RECORD}
        if v is not None:
            record.update({key: v, "test_accuracy": t, "test_loss": 1.0 - t})
        out.append(record)
    return out


def write_run(path: Path, records_: list[dict], seed: int, status: str = "complete") -> None:
    path.mkdir(parents=True, exist_ok=True)
    config = load_config(None).to_dict()
    config["seed"], config["rounds"] = seed, len(records_)
    (path / "config.json").write_text(json.dumps(config))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records_))
    info = {
        "format": 1,
        "status": status,
        "rounds": len(records_),
        "rounds_done": records_[-1]["round"],
        "num_parameters": 10,
    }
    (path / "run.json").write_text(json.dumps(info))


# FedProx's μ grid, two seeds: μ=0.01 is best on test (0.91) but μ=0.1 is best on validation (0.81).
GRID = {
    "μ=0.01": {"dir": "mu-0.01", "validation": [(0.5, 0.70), (0.5, 0.72)], "test": [(0.5, 0.90), (0.5, 0.92)]},
    "μ=0.1": {"dir": "mu-0.1", "validation": [(0.6, 0.80), (0.6, 0.82)], "test": [(0.5, 0.80), (0.5, 0.81)]},
    "μ=1": {"dir": "mu-1", "validation": [(0.4, 0.60), (0.4, 0.60)], "test": [(0.4, 0.60), (0.4, 0.60)]},
}


def tuned_sweep(root: Path, tuning: dict | None = None, stopped: dict[str, int] | None = None) -> Path:
    """A sweep with FedAvg (untuned) and FedProx tuned over μ, seeds 0 and 1, as `driftlab sweep` lays it out."""
    runs = []
    for seed in (0, 1):
        write_run(root / f"runs/fedavg/seed-{seed}", records([0.5, 0.6], [0.6, 0.65]), seed)
        runs.append(
            {"dir": f"runs/fedavg/seed-{seed}", "setting": "", "method": "FedAvg", "seed": seed, "overrides": []}
        )
    for label, value in GRID.items():
        for seed in (0, 1):
            run_dir = f"runs/fedprox/{value['dir']}/seed-{seed}"
            write_run(root / run_dir, records(value["validation"][seed], value["test"][seed]), seed)
            if stopped and label in stopped:
                (root / run_dir / "halving.json").write_text(
                    json.dumps({"round": stopped[label], "message": "stopped"})
                )
            runs.append(
                {
                    "dir": run_dir,
                    "setting": "",
                    "method": f"FedProx ({label})",
                    "seed": seed,
                    "overrides": [],
                    "tuned": label,
                    "tuned_method": "FedProx",
                }
            )
    document = {
        "format": 1,
        "name": "tuned",
        "rounds": [2],
        "seeds": [0, 1],
        "targets": [],
        "runs": runs,
        "tuning": tuning or {"metric": "validation_accuracy", "rule": "final", "axes": ["mu"]},
    }
    (root / "sweep.json").write_text(json.dumps(document))
    return root


def test_the_pick_is_made_on_validation_not_on_test(tmp_path):
    settings, documents = collect([tuned_sweep(tmp_path)])
    result = apply_tuning(settings, documents)
    (setting,) = settings
    # the rows a report compares: FedAvg, and FedProx at the value best on validation (μ=0.1), not on test (μ=0.01)
    assert list(setting.methods) == ["FedAvg", "FedProx"]
    assert [run.path.parent.name for run in setting.methods["FedProx"]] == ["mu-0.1", "mu-0.1"]
    assert all(run.method == "FedProx" for run in setting.methods["FedProx"])
    (pick,) = result.picks(setting.label)
    assert pick.value == "μ=0.1" and pick.validation[0] == pytest.approx(0.81) and pick.test[0] == pytest.approx(0.805)
    best_on_test = max(result.cells, key=lambda cell: cell.test[0])
    assert best_on_test.value == "μ=0.01" and not best_on_test.picked
    appendix = "\n".join(tuning_appendix(result))
    assert "| FedProx | μ=0.1 | 2 | 81.00% ± 1.41 | 80.50% ± 0.71 | ✓ picked |" in appendix
    assert "| FedProx | μ=0.01 | 2 | 71.00% ± 1.41 | 91.00% ± 1.41 |  |" in appendix


def test_a_value_stopped_by_halving_is_never_picked_and_says_so(tmp_path):
    settings, documents = collect([tuned_sweep(tmp_path, stopped={"μ=0.1": 1})])
    result = apply_tuning(settings, documents)
    assert [run.path.parent.name for run in settings[0].methods["FedProx"]] == ["mu-0.01", "mu-0.01"]
    assert "| FedProx | μ=0.1 | 2 | 81.00% ± 1.41 | 80.50% ± 0.71 | stopped by halving at round 1 |" in tuning_appendix(
        result
    )


def test_a_known_metric_the_runs_did_not_record_names_the_keys_they_did(tmp_path):
    root = tuned_sweep(tmp_path, tuning={"metric": "validation_loss", "rule": "best", "axes": ["mu"]})
    with pytest.raises(ConfigError, match=r"tuning_metric 'validation_loss' is in no record .*validation_accuracy"):
        apply_tuning(*collect([root]))


def test_a_metric_missing_from_every_record_is_an_error_when_the_report_reads_them(tmp_path):
    root = tuned_sweep(tmp_path, tuning={"metric": "my_score", "rule": "final"})
    with pytest.raises(ConfigError, match="tuning_metric 'my_score' is in no record"):
        apply_tuning(*collect([root]))


def test_untuned_sweeps_are_left_as_they_are(tmp_path):
    write_run(tmp_path / "runs/fedavg/seed-0", records([0.5], [0.5]), 0)
    (tmp_path / "sweep.json").write_text(
        json.dumps(
            {
                "format": 1,
                "name": "plain",
                "runs": [{"dir": "runs/fedavg/seed-0", "setting": "", "method": "FedAvg", "seed": 0}],
            }
        )
    )
    settings, documents = collect([tmp_path])
    assert apply_tuning(settings, documents) is None and list(settings[0].methods) == ["FedAvg"]


# ---------------------------------------------------------------- scores by hand


def test_run_scores_by_hand():
    rs = records([0.5, None, 0.7, 0.6], [0, 0, 0, 0])
    assert run_score(rs, Tuning("validation_accuracy", "final")) == 0.6
    assert run_score(rs, Tuning("validation_accuracy", "best")) == 0.7
    assert run_score(rs, Tuning("validation_accuracy", "rounds_to:0.65")) == 3  # round 2 was not evaluated
    assert run_score(rs, Tuning("validation_accuracy", "rounds_to:0.9")) == math.inf
    losses = records([0.9, 0.4, 0.5], [0, 0, 0], key="validation_loss")
    assert Tuning("validation_loss").lower_is_better and not Tuning().lower_is_better
    assert run_score(losses, Tuning("validation_loss", "best")) == 0.4
    assert run_score(losses, Tuning("validation_loss", "rounds_to:0.45")) == 2
    assert math.isnan(run_score(records([None], [0]), Tuning()))


def test_ranking_means_over_seeds_puts_diverged_last_and_breaks_ties_in_axis_order():
    def value(*finals, diverged=False):
        return ValueRuns(tuple(tuple(records([f], [0])) for f in finals), diverged)

    values = {"a": value(0.5, 0.9), "b": value(0.8, 0.7), "c": value(0.99, 0.99, diverged=True), "d": value(0.75, 0.75)}
    # means: a 0.7, b 0.75, d 0.75 (tied with b, listed after it), c diverged (last despite its 0.99)
    assert ranked_values(values, Tuning()) == ["b", "d", "a", "c"]
    assert ranked_values({"x": value(0.6), "y": value(0.6)}, Tuning()) == ["x", "y"]
    # rounds_to: reaching sooner wins; values that never reach it are ordered by their final metric
    slow = ValueRuns((tuple(records([0.1, 0.9], [0, 0])),))
    fast = ValueRuns((tuple(records([0.9, 0.9], [0, 0])),))
    never_high, never_low = value(0.5), value(0.3)
    assert ranked_values(
        {"n1": never_low, "slow": slow, "n2": never_high, "fast": fast}, Tuning(rule="rounds_to:0.8")
    ) == ["fast", "slow", "n2", "n1"]


@pytest.mark.parametrize(
    ("metric", "rule", "message"),
    [
        ("validaton_accuracy", None, "did you mean 'validation_accuracy'"),
        ("validation_los", None, "did you mean 'validation_loss'"),
        (None, "last", 'tuning_rule must be "final", "best" or "rounds_to:<target>"'),
        (None, "rounds_to:high", "the target after rounds_to: must be a number"),
        ("", None, "must name a record key"),
    ],
)
def test_misspelt_metrics_and_bad_rules_are_refused_when_the_sweep_is_read(metric, rule, message):
    with pytest.raises(ConfigError, match=message):
        tuning_from_keys(metric, rule, "sweep s")


def test_any_other_record_key_is_accepted_at_load():
    assert tuning_from_keys("personal_test_accuracy_mean", "rounds_to:0.8", "s") == Tuning(
        "personal_test_accuracy_mean", "rounds_to:0.8"
    )
    assert tuning_from_keys("my_custom_score", None, "s").rule == "final"
    assert tuning_from_keys(None, None, "s") == Tuning("validation_accuracy", "final")


def test_write_tuning_csv_has_a_row_per_value(tmp_path):
    from driftlab.experiments.report.tuning import write_tuning_csv

    settings, documents = collect([tuned_sweep(tmp_path / "s")])
    (path,) = write_tuning_csv(tmp_path, apply_tuning(settings, documents))
    rows = list(csv.DictReader(path.open()))
    assert [(r["tuned_value"], r["picked"]) for r in rows] == [("μ=0.01", "0"), ("μ=0.1", "1"), ("μ=1", "0")]
    assert float(rows[1]["validation_mean"]) == pytest.approx(0.81) and float(rows[0]["test_mean"]) == pytest.approx(
        0.91
    )


def test_the_report_shows_test_numbers_at_the_validation_pick_and_the_grid_in_an_appendix(tmp_path):
    from driftlab.experiments.report import make_report

    report = make_report(
        [tuned_sweep(tmp_path / "s", stopped={"μ=1": 1})], tmp_path / "report", targets=[0.6], plots=False
    )
    rows = {row.method: row for row in report.accuracy}
    assert list(rows) == ["FedAvg", "FedProx"]
    # FedProx's final test accuracy is μ=0.1's (0.80, 0.81), never μ=0.01's better 0.90, 0.92
    assert rows["FedProx"].final_accuracy.mean == pytest.approx(0.805) and rows[
        "FedProx"
    ].final_accuracy.std == pytest.approx(0.00707, abs=1e-5)
    assert (
        "FedProx is reported at its tuned value μ=0.1, picked on validation (final validation_accuracy: 81.00% ± 1.41 over 2 seeds)"
        in report.markdown
    )
    assert "## Appendix: tuned grids" in report.markdown
    assert "| FedProx | μ=1 | 2 | 60.00% ± 0.00 | 60.00% ± 0.00 | stopped by halving at round 1 |" in report.markdown
    assert {run.path.parent.name for run in report.runs if run.method == "FedProx"} == {"mu-0.1"}
    assert (tmp_path / "report" / "tuning.csv") in report.files
