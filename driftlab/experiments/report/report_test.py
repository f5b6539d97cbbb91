"""Reports: hand-built run directories whose numbers can be worked out on paper, plus one real end-to-end run.

Fixture convention: every run has P = 10 parameters and 2 selected clients a round,
so one uncompressed upload round is 32 · 10 · 2 = 640 bits = 1 model-equivalent.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest

import driftlab
from driftlab.experiments.config import ConfigError, load_config
from driftlab.experiments.report import (
    BAND_LEGEND,
    BAND_NOTE,
    Setting,
    figure_stems,
    make_report,
    read_metrics,
    savings,
    setting_figures,
    target_row,
    target_style,
)
from driftlab.experiments.sweep import plan, sweep_document, sweep_from_config

PARAMETERS = 10
SELECTED = 2
ONE_MODEL_BITS = 32 * PARAMETERS * SELECTED  # 640
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _config(algorithm: str = "fedavg", seed: int = 0, rounds: int = 5, **keys) -> dict:
    """A valid resolved config with ``section.key`` values replaced (``keys`` use ``__`` for the dot)."""
    config = load_config(None).to_dict()
    config["algorithm"] = {"name": algorithm, "aggregation": "weighted"}
    config["seed"], config["rounds"] = seed, rounds
    for dotted, value in keys.items():
        section, key = dotted.split("__")
        config[section][key] = value
    return config


def _records(accuracies, upload_per_round=ONE_MODEL_BITS, steps=10, **series) -> list[dict]:
    records = []
    for index, accuracy in enumerate(accuracies):
        record = {
            "round": index + 1,
            "num_selected": SELECTED,
            "num_reporting": SELECTED,
            "reporting_clients": [0, 1],
            "num_inactive": 0,
            "num_incomplete": 0,
            "local_steps": steps[index] if isinstance(steps, list) else steps,
            "upload_bits": upload_per_round,
            "download_bits": ONE_MODEL_BITS,
            "client_lr": 0.1,
            "server_lr": 1.0,
            "model_norm": 1.0 + index,
            "round_seconds": 0.1,
        }
        if accuracy is not None:
            record.update(test_accuracy=accuracy, test_loss=1.0, train_loss=1.0)
        for key, values in series.items():
            if values[index] is not None:
                record[key] = values[index]
        records.append(record)
    return records


def _write_run(
    path: Path, config: dict, records: list[dict], status: str = "complete", info: bool = True, **extra
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if info:
        content = {
            "format": 1,
            "status": status,
            "rounds": config["rounds"],
            "rounds_done": records[-1]["round"] if records else 0,
            "num_parameters": PARAMETERS,
            "wall_seconds": 3.0,
            "machine": {"processor": "Test CPU", "cpu_count": 2, "torch_threads": 2, "device": "cpu"},
            **extra,
        }
        (path / "run.json").write_text(json.dumps(content))
    return path


def _three_methods(root: Path) -> Path:
    """FedAvg reaches 80% at round 4 (4 models up), SCAFFOLD at round 1 (2 models up), FedProx never (5 rounds)."""
    _write_run(root / "fedavg", _config("fedavg"), _records([0.5, 0.6, 0.7, 0.8, 0.85]))
    _write_run(
        root / "scaffold",
        _config("scaffold"),
        _records(
            [0.82, 0.84, 0.86, 0.88, 0.9], upload_per_round=2 * ONE_MODEL_BITS, drift_norm=[0.1, 0.2, 0.3, 0.4, 0.5]
        ),
    )
    prox = _config("fedprox")
    prox["algorithm"]["mu"] = 1.0
    _write_run(root / "fedprox", prox, _records([0.5, 0.6, 0.65, 0.7, 0.7]))
    return root


def _row(report, method: str, target: float):
    return next(r for r in report.targets if r.method == method and r.target == target)


def _markdown_row(markdown: str, first_cell: str) -> list[str]:
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {first_cell} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


# ---------------------------------------------------------------- communication to a target


def test_rounds_model_equivalents_and_savings_by_hand(tmp_path):
    report = make_report([_three_methods(tmp_path / "runs")], tmp_path / "report", targets=[0.8], plots=False)
    assert [s.label for s in report.settings] == ["synthetic"]
    assert list(report.settings[0].methods) == ["FedAvg", "FedProx", "SCAFFOLD"]  # the papers' order

    fedavg, scaffold, fedprox = (_row(report, m, 0.8) for m in ("FedAvg", "SCAFFOLD", "FedProx"))
    assert (fedavg.rounds, fedavg.model_equivalents, fedavg.upload_bits, fedavg.download_bits) == (
        4,
        4.0,
        4 * 640,
        4 * 640,
    )
    assert not fedavg.lower_bound
    # SCAFFOLD uploads model + control variate: 2 model-equivalents in its single round.
    assert (scaffold.rounds, scaffold.model_equivalents, scaffold.upload_bits) == (1, 2.0, 1280)
    # Never reached: the whole run (5 rounds, 5 models up) as a lower bound.
    assert (fedprox.rounds, fedprox.model_equivalents, fedprox.lower_bound, fedprox.seeds_reached) == (5, 5.0, True, 0)

    assert savings(scaffold, fedavg).ratio == 2.0 and savings(scaffold, fedavg).bound == "="
    assert savings(scaffold, fedprox).ratio == 2.5 and savings(scaffold, fedprox).bound == ">"
    assert savings(fedprox, fedavg).ratio == 0.8 and savings(fedprox, fedavg).bound == "<"

    # Columns: method, rounds, model-eq, upload, download, vs FedAvg, vs FedProx, vs SCAFFOLD, note.
    assert _markdown_row(report.markdown, "SCAFFOLD") == [
        "SCAFFOLD",
        "1",
        "2.0",
        "1.28 kbit",
        "640 bit",
        "2.0×",
        ">2.5×",
        "·",
        "",
    ]
    assert _markdown_row(report.markdown, "FedProx")[:6] == ["FedProx", "5+", "5.0+", "3.2 kbit+", "3.2 kbit+", "<0.8×"]
    assert _markdown_row(report.markdown, "FedProx")[-1] == "not reached"
    assert "### Communication to reach 80% test accuracy" in report.markdown


def test_csv_tables_agree_with_the_markdown(tmp_path):
    out = tmp_path / "report"
    report = make_report([_three_methods(tmp_path / "runs")], out, targets=[0.8], plots=False)
    assert {p.name for p in report.files} >= {
        "report.md",
        "targets.csv",
        "accuracy.csv",
        "steps.csv",
        "savings.csv",
        "runs.csv",
    }
    targets = {row["method"]: row for row in _csv(out / "targets.csv")}
    assert targets["FedAvg"]["rounds"] == "4" and float(targets["FedAvg"]["model_equivalents"]) == 4.0
    assert targets["FedAvg"]["upload_bits"] == "2560" and targets["FedAvg"]["lower_bound"] == "0"
    assert targets["FedProx"]["lower_bound"] == "1" and targets["FedProx"]["seeds_reached"] == "0"
    for method, row in targets.items():
        cells = _markdown_row(report.markdown, method)
        plus = "+" if row["lower_bound"] == "1" else ""
        assert cells[1] == row["rounds"] + plus
        assert cells[2] == f"{float(row['model_equivalents']):.1f}{plus}"
    ratios = {(r["method"], r["baseline"]): r for r in _csv(out / "savings.csv")}
    assert float(ratios[("SCAFFOLD", "FedAvg")]["ratio"]) == 2.0 and ratios[("SCAFFOLD", "FedProx")]["bound"] == ">"
    accuracy = {row["method"]: row for row in _csv(out / "accuracy.csv")}
    assert float(accuracy["FedAvg"]["final_accuracy_mean"]) == 0.85 and accuracy["FedAvg"]["final_accuracy_std"] == ""
    assert "| FedAvg | 1 | 85.00% | 85.00% |" in report.markdown.split("### Accuracy")[1]
    steps = {row["method"]: row for row in _csv(out / "steps.csv")}
    assert steps["FedAvg"]["total_steps"] == "50" and steps["FedAvg"]["steps_to_0.8"] == "40"
    runs = _csv(out / "runs.csv")
    assert (
        len(runs) == 3 and {r["status"] for r in runs} == {"complete"} and runs[0]["machine"] == "Test CPU, 2 threads"
    )


def test_seeds_mean_std_and_partial_reach(tmp_path):
    root = tmp_path / "runs"
    _write_run(
        root / "s0", _config(seed=0, rounds=3), _records([0.80, 0.85, 0.90], client_test_accuracy_mean=[0.5, 0.7, 0.6])
    )
    _write_run(
        root / "s1", _config(seed=1, rounds=3), _records([0.85, 0.92, 0.92], client_test_accuracy_mean=[0.6, 0.8, 0.7])
    )
    report = make_report([root], tmp_path / "report", targets=[0.85, 0.92], plots=False)
    assert len(report.settings[0].methods["FedAvg"]) == 2  # seeds of one method, not two methods

    accuracy = report.accuracy[0]
    assert accuracy.final_accuracy.mean == pytest.approx(0.91) and accuracy.final_accuracy.std == pytest.approx(
        0.02**0.5 / 10
    )
    assert accuracy.best_client_accuracy.mean == pytest.approx(0.75)  # BMTA: best over rounds, then mean over seeds
    # (0.90, 0.92): mean 91.00%, sample std sqrt(((-1)² + 1²)/1) = 1.41 points.
    assert _markdown_row(report.markdown.split("### Accuracy")[1], "FedAvg")[:5] == [
        "FedAvg",
        "2",
        "91.00 ± 1.41%",
        "91.00 ± 1.41%",
        "75.00 ± 7.07%",
    ]

    both = _row(report, "FedAvg", 0.85)  # seed 0 at round 2, seed 1 at round 1
    assert (both.rounds, both.model_equivalents, both.lower_bound) == (1.5, 1.5, False)
    partial = _row(report, "FedAvg", 0.92)  # seed 1 at round 2; seed 0 ran 3 rounds without reaching it
    assert (partial.rounds, partial.seeds_reached, partial.lower_bound) == (2.5, 1, True)
    table = report.markdown.split("reach 92%")[1]
    assert (
        _markdown_row(table, "FedAvg")[1:3] == ["2.5+", "2.5+"]
        and "1/2 seeds reached" in _markdown_row(table, "FedAvg")[-1]
    )


def test_local_steps_fraction_of_the_constant_work_method(tmp_path):
    root = tmp_path / "runs"
    constant = _config(client__steps=10)
    decaying = _config(client__steps={"kind": "exponential", "initial": 10.0, "decay": 0.8})
    for config in (constant, decaying):
        config["client"].pop("epochs", None)
    _write_run(root / "constant", constant, _records([0.5, 0.6, 0.7, 0.8, 0.9], steps=20))  # 100 steps; 80 to reach 80%
    _write_run(
        root / "decaying", decaying, _records([0.5, 0.6, 0.8, 0.8, 0.9], steps=[20, 16, 12, 10, 8])
    )  # 66; 48 to 80%
    report = make_report([root], tmp_path / "report", targets=[0.8], plots=False)
    labels = list(report.settings[0].methods)
    assert labels == ["FedAvg (client.steps=10)", "FedAvg (client.steps=exponential(initial=10, decay=0.8))"]
    rows = {row.method: row for row in report.steps}
    assert {row.reference for row in report.steps} == {labels[0]}  # constant K is the default reference
    assert rows[labels[1]].total_steps == 66 and rows[labels[1]].total_fraction == pytest.approx(0.66)
    assert rows[labels[1]].target_fraction[0.8] == pytest.approx(48 / 80)
    assert _markdown_row(report.markdown.split("### Local SGD steps")[1], labels[1])[1:5] == [
        "66",
        "66.0%",
        "48",
        "60.0%",
    ]

    flipped = make_report([root], tmp_path / "flipped", targets=[0.8], steps_reference=labels[1], plots=False)
    assert {row.method: row.total_fraction for row in flipped.steps}[labels[0]] == pytest.approx(100 / 66)


def test_diverged_run(tmp_path):
    root = _three_methods(tmp_path / "runs")
    _write_run(
        root / "feddyn",
        _config("feddyn"),
        _records([0.5, 0.55]),
        status="diverged",
        message="round 3: the server model has non-finite entries",
    )
    report = make_report([root], tmp_path / "report", targets=[0.8], plots=False)
    feddyn = _row(report, "FedDyn", 0.8)
    assert feddyn.diverged_at == 3 and feddyn.seeds_diverged == 1
    cells = _markdown_row(report.markdown, "FedDyn")
    assert cells[1] == "diverged at round 3" and cells[5:8] == ["—", "—", "—"]
    assert savings(_row(report, "SCAFFOLD", 0.8), feddyn).ratio is None  # no ratio against a divergence
    assert "1 diverged" in _markdown_row(report.markdown.split("### Runs")[1], "FedDyn")[3]


# ---------------------------------------------------------------- inputs


def _sweep(root: Path) -> Path:
    """Two settings x (FedDyn, FedAvg) x seeds (0, 1); the Dirichlet FedAvg seed 1 has not started."""
    settings = [("IID", "iid", "iid"), ("Dirichlet 0.3", "dirichlet-0.3", "dirichlet")]
    methods = [("FedDyn", "feddyn"), ("FedAvg", "fedavg")]  # deliberately not the papers' order
    runs = []
    for setting, setting_dir, partition in settings:
        for method, algorithm in methods:
            for seed in (0, 1):
                run_dir = f"runs/{setting_dir}/{algorithm}/seed-{seed}"
                runs.append({"dir": run_dir, "setting": setting, "method": method, "seed": seed, "overrides": []})
                if (setting, method, seed) == ("Dirichlet 0.3", "FedAvg", 1):
                    continue
                accuracy = 0.9 if algorithm == "feddyn" else 0.6
                _write_run(
                    root / run_dir, _config(algorithm, seed=seed, data__partition=partition), _records([accuracy] * 5)
                )
    document = {
        "format": 1,
        "name": "tiny-table2",
        "description": "a tiny FedDyn Table 2",
        "base": "mnist-feddyn",
        "scale": "default",
        "overrides": [],
        "seeds": [0, 1],
        "targets": [0.85],
        "steps_reference": "FedAvg",
        "axes": [
            {"name": "partition", "role": "setting", "values": [{"label": s, "set": []} for s, _, _ in settings]},
            {"name": "method", "role": "method", "values": [{"label": m, "set": []} for m, _ in methods]},
        ],
        "runs": runs,
    }
    (root / "sweep.json").write_text(json.dumps(document))
    return root


def test_sweep_grouping_order_targets_and_pending_runs(tmp_path):
    root = _sweep(tmp_path / "sweep")
    report = make_report([root], tmp_path / "report", plots=False)
    assert [s.label for s in report.settings] == ["IID", "Dirichlet 0.3"]
    assert [list(s.methods) for s in report.settings] == [["FedDyn", "FedAvg"], ["FedDyn", "FedAvg"]]
    assert [[len(runs) for runs in s.methods.values()] for s in report.settings] == [[2, 2], [2, 1]]
    assert {row.target for row in report.targets} == {0.85}  # from sweep.json
    assert {row.reference for row in report.steps} == {"FedAvg"}  # sweep.json's steps_reference
    dirichlet = report.markdown.split("## Dirichlet 0.3")[1]
    assert _markdown_row(dirichlet.split("### Runs")[1], "FedAvg")[1:4] == ["0", "5/5", "1 complete, 1 not started"]
    assert "Sweep **tiny-table2**" in report.markdown


def test_recursive_discovery_without_double_counting(tmp_path):
    root = tmp_path / "demo"
    _write_run(root / "a" / "fedavg", _config("fedavg"), _records([0.5] * 5))
    _write_run(root / "b" / "deeper" / "scaffold", _config("scaffold"), _records([0.6] * 5))
    sweep = _sweep(root / "c" / "sweep")
    report = make_report(
        [root, root / "a" / "fedavg", sweep / "runs" / "iid"], tmp_path / "report", targets=[0.5], plots=False
    )
    assert len(report.runs) == 2 + 7
    labels = {run.path.relative_to(root).as_posix(): (run.setting, run.method) for run in report.runs}
    assert labels["a/fedavg"] == ("synthetic", "FedAvg")
    assert labels["c/sweep/runs/iid/feddyn/seed-0"] == ("IID", "FedDyn")  # reached twice; the sweep's labels win


def test_torn_last_metrics_line_is_dropped(tmp_path):
    run = _write_run(tmp_path / "run", _config(rounds=3), _records([0.5, 0.7]), status="interrupted")
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"round": 3, "num_selected": 2, "local_st')
    records, torn = read_metrics(run / "metrics.jsonl")
    assert [r["round"] for r in records] == [1, 2] and torn == 3
    report = make_report([run], tmp_path / "report", targets=[0.6], plots=False)
    assert report.runs[0].rounds_done == 2
    assert "line 3 was torn" in report.markdown
    assert _markdown_row(report.markdown.split("### Runs")[1], "FedAvg")[2:4] == ["2/3", "1 interrupted"]


def test_runs_without_run_json_leave_model_equivalents_empty(tmp_path):
    run = _write_run(tmp_path / "old", _config(), _records([0.5, 0.9, 0.9, 0.9, 0.9]), info=False)
    report = make_report([run], tmp_path / "report", targets=[0.8], plots=False)
    row = _row(report, "FedAvg", 0.8)
    assert row.model_equivalents is None and row.upload_bits == 1280
    assert _markdown_row(report.markdown, "FedAvg")[1:4] == ["2", "", "1.28 kbit"]
    assert "no run.json" in report.markdown
    assert report.runs[0].status == "complete"  # every planned round is in its metrics


def test_targets_default_to_the_runs_target_accuracy(tmp_path):
    root = tmp_path / "runs"
    _write_run(root / "a", _config("fedavg", evaluation__target_accuracy=0.7), _records([0.5, 0.8, 0.8, 0.8, 0.8]))
    _write_run(root / "b", _config("scaffold", evaluation__target_accuracy=0.6), _records([0.5, 0.8, 0.8, 0.8, 0.8]))
    report = make_report([root], tmp_path / "report", plots=False)
    assert sorted({row.target for row in report.targets}) == [0.6, 0.7]


def _missing(root: Path) -> Path:
    return root / "missing"


def _empty(root: Path) -> Path:
    (root / "empty").mkdir()
    return root / "empty"


def _broken_config(root: Path) -> Path:
    run = _write_run(root / "r", _config(), _records([0.5]))
    (run / "config.json").write_text('{"seed": 0,\n  oops}')
    return run


def _broken_run_info(root: Path) -> Path:
    run = _write_run(root / "r", _config(), _records([0.5]))
    (run / "run.json").write_text("{")
    return run


def _sweep_without_runs(root: Path) -> Path:
    (root / "s").mkdir()
    (root / "s" / "sweep.json").write_text('{"format": 1}')
    return root / "s"


@pytest.mark.parametrize(
    "make_input, expected",
    [
        (_missing, "missing: no such directory; pass a run directory"),
        (_empty, "is not a run directory (config.json + metrics.jsonl), not a sweep directory (sweep.json)"),
        (_broken_config, "r/config.json is not valid JSON (line 2, column 3"),
        (_broken_run_info, "r/run.json is not valid JSON (line 1, column 2"),
        (_sweep_without_runs, "s/sweep.json has no list of runs"),
    ],
    ids=lambda value: value.__name__.strip("_") if callable(value) else "",
)
def test_bad_inputs_raise_config_errors_that_say_what_to_do(tmp_path, make_input, expected):
    with pytest.raises(ConfigError) as error:
        make_report([make_input(tmp_path)], tmp_path / "report", plots=False)
    assert expected in str(error.value)


def _report_of_a_damaged_metrics_line(tmp_path) -> str:
    """The message of a report over a run whose metrics.jsonl has a broken second line."""
    run = _write_run(tmp_path / "run", _config(), _records([0.5, 0.6, 0.7]))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "{not json", lines[2]]) + "\n")
    with pytest.raises(ConfigError) as error:
        make_report([run], tmp_path / "report", plots=False)
    return str(error.value)


def test_damaged_metrics_and_bad_arguments(tmp_path):
    assert "metrics.jsonl line 2 is not valid JSON" in _report_of_a_damaged_metrics_line(tmp_path)

    good = _write_run(tmp_path / "good", _config(), _records([0.5]))
    with pytest.raises(ConfigError, match=r"fractions in \(0, 1\].*0.97"):
        make_report([good], tmp_path / "report", targets=[97])
    with pytest.raises(ConfigError, match="not a method of these runs; the methods are: FedAvg"):
        make_report([good], tmp_path / "report", steps_reference="Constant K")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(
        json.dumps({"format": 1, "name": "x", "runs": [{"dir": "runs/a", "setting": "", "method": "A", "seed": 0}]})
    )
    with pytest.raises(ConfigError, match="1 planned runs have not started"):
        make_report([sweep], tmp_path / "report")


def test_plots_are_written_and_linked(tmp_path):
    root = _three_methods(tmp_path / "runs")
    _write_run(
        root / "fedavg-seed1",
        _config("fedavg", seed=1),
        _records(
            [0.55, 0.65, 0.75, 0.8, 0.8],
            dissimilarity_b2=[None, 2.0, None, 3.0, None],
            gradient_variance=[None, 5.0, None, 4.0, None],
        ),
    )
    report = make_report([root], tmp_path / "report", targets=[0.8])
    pngs = sorted(p.name for p in report.files if p.suffix == ".png")
    assert pngs == [
        "synthetic-accuracy-vs-bits.png",
        "synthetic-accuracy.png",
        "synthetic-dissimilarity.png",
        "synthetic-loss.png",
        "synthetic-norms.png",
    ]
    for name in pngs:
        data = (tmp_path / "report" / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 10_000
        assert f"]({name})" in report.markdown


def test_non_classifier_reports_loss_and_distance(tmp_path):
    records = _records([None] * 3, train_loss=[-0.1, -0.2, -0.25], distance_to_minimizer=[0.5, 0.1, 0.05])
    run = _write_run(tmp_path / "quadratic", _config(rounds=3, data__name="quadratic1d"), records)
    report = make_report([run], tmp_path / "report")
    assert report.targets == [] and "### Loss and distance" in report.markdown
    assert _markdown_row(report.markdown, "FedAvg")[:4] == ["FedAvg", "1", "-0.25", "0.05"]
    assert sorted(p.name for p in report.files if p.suffix == ".png") == [
        "quadratic1d-distance.png",
        "quadratic1d-loss.png",
        "quadratic1d-norms.png",
    ]


def test_target_row_and_savings_are_pure_functions_of_the_runs(tmp_path):
    report = make_report([_three_methods(tmp_path / "runs")], tmp_path / "report", targets=[0.8], plots=False)
    runs = report.settings[0].methods
    again = target_row("synthetic", "FedAvg", runs["FedAvg"], 0.8)
    assert again == _row(report, "FedAvg", 0.8)
    both_unreached = savings(
        target_row("synthetic", "FedProx", runs["FedProx"], 0.95),
        target_row("synthetic", "FedAvg", runs["FedAvg"], 0.95),
    )
    assert both_unreached.ratio is None  # two lower bounds bound nothing


# ---------------------------------------------------------------- end to end


def test_real_runs_end_to_end(tmp_path):
    tiny = ["rounds=3", "data.num_clients=6", "client.epochs=1", "sampling.participation=0.5"]
    driftlab.run("synthetic-fedprox", out_dir=tmp_path / "runs" / "fedprox", overrides=tiny)
    driftlab.run(
        "synthetic-fedprox", out_dir=tmp_path / "runs" / "scaffold", overrides=[*tiny, "algorithm.name=scaffold"]
    )
    report = make_report([tmp_path / "runs"], tmp_path / "report", targets=[0.01])
    assert list(report.settings[0].methods) == ["FedProx", "SCAFFOLD"]
    fedprox, scaffold = (_row(report, m, 0.01) for m in ("FedProx", "SCAFFOLD"))
    # Any accuracy beats 1% in the first evaluated round: one round, 1 vs 2 model-equivalents.
    assert (fedprox.rounds, fedprox.model_equivalents) == (1, 1.0)
    assert (scaffold.rounds, scaffold.model_equivalents) == (1, 2.0)
    assert savings(fedprox, scaffold).ratio == 2.0
    assert all(run.status == "complete" and run.rounds_done == 3 for run in report.runs)
    assert (tmp_path / "report" / "synthetic-norms.png").read_bytes()[:8] == PNG_SIGNATURE
    # run.json records the label and the initial model's losses the divergence test computed: round 0 of the curves
    run = report.settings[0].methods["FedProx"][0]
    assert run.info["algorithm_label"] == "FedProx" and set(run.initial) == {"train_loss", "test_loss", "test_accuracy"}
    from driftlab.experiments.report.plots import _series

    assert (
        _series([run], "train_loss").x == [0, 1, 2, 3]
        and _series([run], "train_loss").mean[0] == run.initial["train_loss"]
    )


def test_the_same_run_twice_is_refused(tmp_path):
    # two copies of one run (or two sweeps with the same labels): averaging them as two seeds would be wrong
    _write_run(tmp_path / "one", _config(rounds=2), _records([0.5, 0.6]))
    _write_run(tmp_path / "copy", _config(rounds=2), _records([0.5, 0.6]))
    with pytest.raises(ConfigError, match="are both seed 0 of 'FedAvg'.*report them separately"):
        make_report([tmp_path], tmp_path / "report")
    assert make_report([tmp_path / "one"], tmp_path / "report").runs[0].rounds_done == 2


def test_accuracy_rows_say_when_a_run_stopped_early(tmp_path):
    _write_run(tmp_path / "ok", _config("fedavg"), _records([0.5, 0.6, 0.7, 0.8, 0.9]))
    _write_run(tmp_path / "bad", _config("scaffold"), _records([0.5, 0.3]), status="diverged")
    markdown = make_report([tmp_path], tmp_path / "report", plots=False).markdown
    accuracy = markdown[markdown.index("### Accuracy") :]
    assert "| SCAFFOLD (diverged at round 3) | 1 | 30.00% | 50.00% |" in accuracy
    assert "| FedAvg | 1 | 90.00% |" in accuracy


# ---------------------------------------------------------------- figures: bands, targets, captions


def _two_seeds(root: Path) -> Path:
    """FedAvg over two seeds (accuracies apart by 0.1 at every round) and SCAFFOLD with one seed; no drift norm."""
    _write_run(root / "s0", _config(seed=0, rounds=4), _records([0.50, 0.60, 0.70, 0.80]))
    _write_run(root / "s1", _config(seed=1, rounds=4), _records([0.40, 0.50, 0.60, 0.60]))
    _write_run(root / "scaffold", _config("scaffold", rounds=4), _records([0.55, 0.65, 0.75, 0.85]))
    return root


def _figure(report, suffix: str):
    return next(f for f in setting_figures(report.settings[0], [0.6, 0.7]) if f.suffix == suffix)


def test_band_is_mean_plus_minus_sample_std_as_the_tables_and_says_so(tmp_path):
    report = make_report([_two_seeds(tmp_path / "runs")], tmp_path / "report", targets=[0.6, 0.7])
    accuracy = _figure(report, "accuracy")
    axis = accuracy.figure.axes[0]
    (band,) = axis.collections  # SCAFFOLD has one seed: no band
    ys = band.get_paths()[0].vertices[:, 1]
    seeds = [[50, 60, 70, 80], [40, 50, 60, 60]]
    means = [statistics.fmean(pair) for pair in zip(*seeds, strict=True)]
    stds = [statistics.stdev(pair) for pair in zip(*seeds, strict=True)]  # ddof=1, as the ± of the accuracy table
    assert ys.min() == pytest.approx(min(m - s for m, s in zip(means, stds, strict=True)))  # 45 − 7.07, not the min 40
    assert ys.max() == pytest.approx(max(m + s for m, s in zip(means, stds, strict=True)))  # 70 + 14.1, not the max 80
    legend = [text.get_text() for text in axis.get_legend().get_texts()]
    assert "FedAvg (2 seeds)" in legend and BAND_LEGEND in legend
    assert accuracy.banded and "lines: mean over seeds, shaded: ± 1 sample std" in accuracy.caption
    # The table's ± for the same seeds, and the note in report.md.
    final = report.accuracy[0] if report.accuracy[0].method == "FedAvg" else report.accuracy[1]
    assert final.final_accuracy.std == pytest.approx(stds[-1] / 100)
    assert BAND_NOTE in report.markdown and "sample standard deviation" in BAND_NOTE and "min" not in BAND_NOTE


def test_each_target_line_has_its_own_style_and_legend_entry(tmp_path):
    report = make_report([_two_seeds(tmp_path / "runs")], tmp_path / "report", targets=[0.6, 0.7])
    axis = _figure(report, "accuracy").figure.axes[0]
    targets = [line for line in axis.get_lines() if line.get_label().startswith("target")]
    assert [line.get_label() for line in targets] == ["target 60%", "target 70%"]
    assert len({(line.get_linestyle(), line.get_color()) for line in targets}) == 2
    legend = [text.get_text() for text in axis.get_legend().get_texts()]
    assert "target 60%" in legend and "target 70%" in legend
    assert "target lines: 60% dotted, 70% dashed" in report.markdown
    styles = [target_style(i) for i in range(12)]
    assert (
        len({(dash if isinstance(dash, str) else repr(dash), colour, width) for _, dash, colour, width in styles}) == 12
    )


def test_captions_name_only_what_is_drawn(tmp_path):
    root = tmp_path / "runs"
    _write_run(root / "fedavg", _config("fedavg", rounds=3), _records([0.5, 0.6, 0.7]))  # model_norm only
    report = make_report([root], tmp_path / "report", targets=[0.6])
    norms = next(f for f in setting_figures(report.settings[0], []) if f.suffix == "norms")
    assert norms.caption == "‖θ‖ vs rounds" and len(norms.figure.axes) == 1
    assert "drift norm" not in report.markdown
    assert "![synthetic: ‖θ‖ vs rounds](synthetic-norms.png)" in report.markdown
    assert BAND_NOTE not in report.markdown  # one seed: no band, no word of one

    _write_run(root / "scaffold", _config("scaffold", rounds=3), _records([0.5, 0.6, 0.7], drift_norm=[0.1, 0.2, 0.3]))
    both = make_report([root], tmp_path / "both", targets=[0.6])
    assert "![synthetic: drift norm and ‖θ‖ vs rounds](synthetic-norms.png)" in both.markdown
    norms = next(f for f in setting_figures(both.settings[0], []) if f.suffix == "norms")
    assert [axis.get_ylabel() for axis in norms.figure.axes] == ["drift norm", "‖θ‖"]
    assert (tmp_path / "both" / "synthetic-norms.png").read_bytes()[:8] == PNG_SIGNATURE


# ---------------------------------------------------------------- sweep labels and descriptions


def _grid_sweep(root: Path, extra_overrides: Sequence[str] = (), description: str | None = None) -> dict:
    """A --grid sweep planned by sweep.py itself, its runs written by hand (3 rounds each) into the planned directories."""
    spec = sweep_from_config(
        "synthetic-fedprox", ["data.partition=iid,dirichlet", "algorithm.mu=[0, 1]"], [0, 1], name="grid"
    )
    if description is not None:
        spec = dataclasses.replace(spec, description=description)
    runs = plan(spec, None, extra_overrides)
    document = sweep_document(spec, runs, None, extra_overrides)
    root.mkdir(parents=True)
    (root / "sweep.json").write_text(json.dumps(document))
    for index, run in enumerate(runs):
        config = run.config.to_dict()
        _write_run(root / run.dir, config, _records([0.5 + 0.01 * index, 0.6, 0.7][: config["rounds"]]))
    return document


def test_sweep_labels_name_rows_legends_and_figure_files(tmp_path):
    document = _grid_sweep(tmp_path / "grid", ["rounds=3"])
    report = make_report([tmp_path / "grid"], tmp_path / "report", targets=[0.6])
    planned = document["runs"]
    assert [s.label for s in report.settings] == list(dict.fromkeys(r["setting"] for r in planned))
    assert [list(s.methods) for s in report.settings] == [list(dict.fromkeys(r["method"] for r in planned))] * 2
    for setting in report.settings:
        directory = next(r["dir"].split("/")[1] for r in planned if r["setting"] == setting.label)
        assert (tmp_path / "report" / f"{directory}-accuracy.png").read_bytes()[:8] == PNG_SIGNATURE
        assert f"]({directory}-accuracy.png)" in report.markdown
        legend = [t.get_text() for t in _figure_of(setting, "accuracy").figure.axes[0].get_legend().get_texts()]
        assert [f"{method} (2 seeds)" for method in setting.methods] == legend[: len(setting.methods)]
    for method in report.settings[0].methods:
        assert f"| {method} |" in report.markdown
    # the labels sweep.py gives --grid values: the key's last part, not the raw dotted key
    assert "data.partition=" not in report.markdown and "algorithm.mu=" not in report.markdown.split("### Accuracy")[1]

    # runs picked out of the sweep keep its labels
    one_setting = tmp_path / "grid" / planned[0]["dir"].split("/seed-")[0].rsplit("/", 1)[0]
    picked = make_report([one_setting], tmp_path / "picked", targets=[0.6], plots=False)
    assert [s.label for s in picked.settings] == [planned[0]["setting"]]
    assert list(picked.settings[0].methods) == list(report.settings[0].methods)


def _figure_of(setting, suffix: str):
    return next(f for f in setting_figures(setting, []) if f.suffix == suffix)


def test_figure_files_of_settings_whose_slugs_collide_stay_apart(tmp_path):
    root = tmp_path / "sweep"
    runs = []
    for label, directory in (("x=1", "x-1"), ("x=-1", "x--1")):  # slug() maps both labels to x-1
        run_dir = f"runs/{directory}/fedavg/seed-0"
        runs.append({"dir": run_dir, "setting": label, "method": "FedAvg", "seed": 0, "overrides": []})
        _write_run(root / run_dir, _config(rounds=2), _records([0.5, 0.6]))
    (root / "sweep.json").write_text(
        json.dumps({"format": 1, "name": "signs", "description": "", "base": "b", "runs": runs})
    )
    report = make_report([root], tmp_path / "report", targets=[0.6], plots=False)
    assert figure_stems(report.settings) == {"x=1": "x-1", "x=-1": "x--1"}  # the sweep's directories
    # without the sweep's directories (stand-alone settings), colliding slugs are numbered
    assert figure_stems([Setting("x=1", {}), Setting("x 1", {}), Setting("X=1", {})]) == {
        "x=1": "x-1",
        "x 1": "x-1-2",
        "X=1": "x-1-3",
    }


def test_description_follows_the_scale_actually_run(tmp_path):
    description = "Two partitions, μ = 0 vs 1: 200 rounds (about 10 minutes on 2 cores)."
    document = _grid_sweep(tmp_path / "short", ["rounds=3"], description=description)
    markdown = make_report([tmp_path / "short"], tmp_path / "report", targets=[0.6], plots=False).markdown
    line = next(line for line in markdown.splitlines() if line.startswith("Sweep **grid**"))
    assert description in line and line.endswith("As run: 3 rounds; seeds 0, 1.")
    if document.get("run_note"):  # sweep.py notes what the command line changed
        assert document["run_note"] in line and "rounds=3" in document["run_note"]

    # a --grid sweep has a description of its axes; an old sweep.json without one gets it from its axes
    _grid_sweep(tmp_path / "grid", ["rounds=3"])
    markdown = make_report([tmp_path / "grid"], tmp_path / "report", targets=[0.6], plots=False).markdown
    line = next(line for line in markdown.splitlines() if line.startswith("Sweep **grid**"))
    assert "(no description)" not in line and "data.partition ∈ {" in line
    old = json.loads((tmp_path / "grid" / "sweep.json").read_text())
    for key in ("spec_description", "run_note", "command_overrides", "rounds"):
        old.pop(key, None)
    old["description"] = ""
    (tmp_path / "grid" / "sweep.json").write_text(json.dumps(old))
    markdown = make_report([tmp_path / "grid"], tmp_path / "report", targets=[0.6], plots=False).markdown
    line = next(line for line in markdown.splitlines() if line.startswith("Sweep **grid**"))
    assert (
        "grid data.partition ∈ {" in line
        and "algorithm.mu ∈ {" in line
        and line.endswith("As run: 3 rounds; seeds 0, 1.")
    )


# ---------------------------------------------------------------- runs of different lengths


def test_runs_differing_only_in_rounds_are_compared_up_to_the_shorter(tmp_path):
    short = _write_run(tmp_path / "short", _config(rounds=2), _records([0.5, 0.6]))
    long = _write_run(tmp_path / "long", _config(rounds=3), _records([0.5, 0.6, 0.9]))
    report = make_report([tmp_path], tmp_path / "report", targets=[0.8])
    assert list(report.settings[0].methods) == ["FedAvg (rounds=2)", "FedAvg (rounds=3)"]
    cut = report.settings[0].methods["FedAvg (rounds=3)"][0]
    assert (cut.rounds_done, cut.truncated_from, report.settings[0].cut_round) == (2, 3, 2)
    # the long run's round 3 (90%) is outside the comparison: final 60%, and 80% not reached in 2 rounds
    assert {row.method: row.final_accuracy.mean for row in report.accuracy} == {
        "FedAvg (rounds=2)": 0.6,
        "FedAvg (rounds=3)": 0.6,
    }
    assert _row(report, "FedAvg (rounds=3)", 0.8).lower_bound and _row(report, "FedAvg (rounds=3)", 0.8).rounds == 2
    assert "compares them up to round 2, the last round of the shortest" in report.markdown
    assert f"Cut to round 2: `{long}` (FedAvg (rounds=3), seed 0, ran 3 rounds)." in report.markdown
    assert str(short) not in report.markdown.split("Cut to round 2:")[1].split("\n")[0]
    assert _markdown_row(report.markdown.split("### Runs")[1], "FedAvg (rounds=3)")[2:4] == ["2/2", "1 cut to round 2"]
    assert "(complete at round" not in report.markdown  # a cut run is not reported as stopped early
    runs = {Path(row["path"]).name: row for row in _csv(tmp_path / "report" / "runs.csv")}
    assert (runs["long"]["rounds_done"], runs["long"]["cut_to_round"], runs["short"]["cut_to_round"]) == ("3", "2", "")


def test_seeds_and_methods_of_different_lengths_are_cut_to_the_shortest(tmp_path):
    _write_run(tmp_path / "s0", _config(seed=0, rounds=5), _records([0.5, 0.6, 0.7, 0.8, 0.9]))
    _write_run(tmp_path / "s1", _config(seed=1, rounds=3), _records([0.5, 0.6, 0.65]))
    _write_run(tmp_path / "scaffold", _config("scaffold", rounds=4), _records([0.5, 0.6, 0.7, 0.3]), status="diverged")
    report = make_report([tmp_path], tmp_path / "report", targets=[0.8], plots=False)
    fedavg = report.settings[0].methods["FedAvg"]
    assert [run.seed for run in fedavg] == [0, 1]  # still two seeds of one method
    assert {row.method: row.final_accuracy.mean for row in report.accuracy} == {
        "FedAvg": pytest.approx(0.675),
        "SCAFFOLD": 0.7,
    }
    scaffold = report.settings[0].methods["SCAFFOLD"][0]
    assert (
        scaffold.truncated_from == 4 and scaffold.diverged_at is None
    )  # its divergence lies after the compared rounds
    assert "ran 5 rounds" in report.markdown and "ran 4 rounds" in report.markdown


def test_sweep_runs_keep_the_lengths_their_sweep_planned(tmp_path):
    # a sweep may run each method for its own number of rounds (feddyn-table2-headline does)
    runs = []
    for method, rounds in (("FedDyn", 2), ("FedAvg", 4)):
        run_dir = f"runs/{method.lower()}/seed-0"
        runs.append({"dir": run_dir, "setting": "", "method": method, "seed": 0, "overrides": []})
        _write_run(
            tmp_path / "sweep" / run_dir,
            _config(method.lower(), rounds=rounds),
            _records([0.5, 0.6, 0.7, 0.8][:rounds]),
        )
    (tmp_path / "sweep" / "sweep.json").write_text(
        json.dumps({"format": 1, "name": "headline", "base": "b", "runs": runs})
    )
    report = make_report([tmp_path / "sweep"], tmp_path / "report", targets=[0.8], plots=False)
    assert sorted(run.rounds_done for run in report.runs) == [2, 4] and report.settings[0].cut_round is None
    assert "Cut to round" not in report.markdown
    assert "As run: 2 rounds (FedDyn), 4 rounds (FedAvg)" in report.markdown


# ---------------------------------------------------------------- no torch


def test_importing_the_report_imports_no_torch():
    # Reading run directories needs no torch: a report can be made where the runs' machine is not.
    code = "import sys; import driftlab.experiments.report; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- labels are data, never code


def test_a_report_never_imports_the_plugins_its_runs_name(tmp_path):
    # Reading a shared results folder must not run the code it holds: a plugin that would leave a marker.
    marker = tmp_path / "imported"
    plugin = tmp_path / "evil_plugin.py"
    plugin.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    config = _config("fedavg")
    config["algorithm"] = {"name": "evil_alg"}
    config["plugins"] = [str(plugin)]
    _write_run(tmp_path / "plugin-run", config, _records([0.5, 0.7]), algorithm_label="Evil Avg")
    _write_run(tmp_path / "fedavg-run", _config("fedavg"), _records([0.5, 0.6]))
    report = make_report(
        [tmp_path / "plugin-run", tmp_path / "fedavg-run"], tmp_path / "report", targets=[0.65], plots=False
    )
    assert not marker.exists()
    # the plugin's algorithm is labelled as run.json records it, after the built-ins
    assert list(report.settings[0].methods) == ["FedAvg", "Evil Avg"]
    assert _row(report, "Evil Avg", 0.65).rounds == 2
    # without run.json (or the label in it) the name config.json records
    (tmp_path / "plugin-run" / "run.json").unlink()
    assert list(make_report([tmp_path / "plugin-run"], tmp_path / "report0", plots=False).settings[0].methods) == [
        "evil_alg"
    ]
    # and through the command line too
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from driftlab.cli import main; sys.exit(main(sys.argv[1:]))",
            "report",
            str(tmp_path / "plugin-run"),
            "--out",
            str(tmp_path / "cli-report"),
            "--no-plots",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "evil_alg" in (tmp_path / "cli-report" / "report.md").read_text() and not marker.exists()


def test_settings_outside_a_runs_identity_never_enter_labels(tmp_path):
    # A run resumed with a tracker on is the same run: its label must not grow `log=["wandb"]`, even beside
    # a copy of it without the tracker (two runs of one seed are told apart only by what changes results).
    tracked = _config(rounds=3)
    tracked["log"] = ["wandb"]
    tracked["memory_budget"] = "1GB"
    tracked["state"] = {**tracked.get("state", {}), "store": "disk"}
    _write_run(tmp_path / "tracked", tracked, _records([0.5, 0.6, 0.7]))
    _write_run(tmp_path / "other-seed", _config(seed=1, rounds=3), _records([0.5, 0.6, 0.8]))
    report = make_report([tmp_path], tmp_path / "report", targets=[0.8], plots=False)
    assert list(report.settings[0].methods) == ["FedAvg"]
    assert (
        "wandb" not in report.markdown
        and "memory_budget" not in report.markdown
        and "state.store" not in report.markdown
    )
    # two copies of one seed that differ only in such keys are one config twice, which is refused
    _write_run(tmp_path / "untracked", _config(rounds=3), _records([0.5, 0.6, 0.7]))
    with pytest.raises(ConfigError, match="both seed 0 of 'FedAvg'"):
        make_report([tmp_path], tmp_path / "report2", targets=[0.8], plots=False)


def test_a_damaged_metrics_line_gets_a_fix_a_resume_would_accept(tmp_path):
    message = _report_of_a_damaged_metrics_line(tmp_path)
    assert "resume the run to rewrite" not in message
    assert (
        "a resume refuses it too" in message
        and "restore metrics.jsonl from a backup, or run again with a new --out directory" in message
    )


# ---------------------------------------------------------------- small scale: ticks, targets, unreached tables


def test_log_axes_only_over_a_wide_span_and_targets_only_within_reach():
    from driftlab.experiments.report.plots import drawn_targets, round_axis_limits, use_log_scale

    assert use_log_scale([0.1, 1.0, 5.0]) and not use_log_scale([2.2975, 2.31]) and not use_log_scale([-1.0, 100.0])
    assert not use_log_scale([]) and use_log_scale([1.0, float("nan"), 10.0])
    # curves at 10% (best 0.12): 80% and 85% are left to a note, 20% is drawn (within 10 points: 0.12 + 0.10 >= 0.2)
    assert drawn_targets([0.2, 0.8, 0.85], 0.12) == ([0.2], [0.8, 0.85])
    assert drawn_targets([0.8], None) == ([], [0.8])
    assert round_axis_limits(2) == pytest.approx((-0.08, 2.08)) and round_axis_limits(0) == pytest.approx((-0.04, 1.04))


def test_a_two_round_run_gets_integer_round_ticks_plain_labels_and_a_note_for_far_targets(tmp_path):
    from driftlab.experiments.report.read import collect

    _write_run(tmp_path / "fedavg", _config(rounds=2), _records([0.10, 0.12], train_loss=[2.2975, 2.2968]))
    _write_run(tmp_path / "fedprox", _config("fedprox", rounds=2), _records([0.09, 0.11], train_loss=[2.2980, 2.2970]))
    settings, _ = collect([tmp_path])
    figures = {figure.suffix: figure for figure in setting_figures(settings[0], [0.8, 0.85])}
    accuracy = figures["accuracy"]
    axis = accuracy.figure.axes[0]
    assert axis.get_xlim() == pytest.approx((-0.08, 2.08))
    ticks = [tick for tick in axis.get_xticks() if -0.08 <= tick <= 2.08]
    assert ticks == [0, 1, 2]
    assert not [
        line for line in axis.get_lines() if line.get_label().startswith("target")
    ]  # no 80% line over curves at 12%
    assert accuracy.caption.endswith(
        "; target 80%, 85% not drawn: far above the best accuracy any run recorded (12.0%)"
    )
    loss_axis = figures["loss"].figure.axes[0]
    assert loss_axis.get_yscale() == "linear"  # 2.2968..2.2980 spans no factor of 10
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(loss_axis.figure).draw()
    labels = [label.get_text() for label in loss_axis.get_yticklabels()]
    assert labels and all("×" not in text and "e" not in text for text in labels)
    assert loss_axis.yaxis.get_major_formatter().get_offset() == ""
    report = make_report([tmp_path], tmp_path / "report", targets=[0.8, 0.85], plots=False)
    # one compact table for the targets no method reached, not one identical table per target
    assert report.markdown.count("### Communication") == 1
    assert "### Communication: no method reached 80%, 85% test accuracy" in report.markdown
    assert _markdown_row(report.markdown, "FedAvg")[1] == "2+"
    assert {(row.method, row.target) for row in report.targets} == {
        (m, t) for m in ("FedAvg", "FedProx") for t in (0.8, 0.85)
    }


def test_a_target_some_method_reached_keeps_its_own_table(tmp_path):
    _three_methods(tmp_path)
    report = make_report([tmp_path], tmp_path / "report", targets=[0.8, 0.95], plots=False)
    assert "### Communication to reach 80% test accuracy" in report.markdown
    assert "### Communication: no method reached 95% test accuracy" in report.markdown


def test_unstable_and_diverged_runs_are_marked(tmp_path):
    message = "train loss above 1x the initial model's (2.996) for 3 rounds in a row: lower client.lr"
    records = _records([0.5, 0.3, 0.2, 0.4], train_loss=[3.5, 9.0, 12.0, 11.0])
    records[2]["instability"] = message
    _write_run(tmp_path / "fedavg", _config(rounds=4), records, instability={"round": 3, "message": message})
    # without run.json the flag in the record is enough
    scaffold = _records([0.5, 0.5, 0.6, 0.6])
    scaffold[1]["instability"] = "loss stayed up"
    _write_run(tmp_path / "scaffold", _config("scaffold", rounds=4), scaffold, info=False)
    _write_run(tmp_path / "fedprox", _config("fedprox", rounds=4), _records([0.5, 0.6]), status="diverged")
    report = make_report([tmp_path], tmp_path / "report", targets=[0.8], plots=False)
    assert (
        f"⚠ Unstable (marked † below): FedAvg, seed 0 (from round 3: {message}); SCAFFOLD, seed 0 (from round 2: loss stayed up)."
        in report.markdown
    )
    assert "⚠ Diverged: FedProx, seed 0 (at round 3)." in report.markdown
    accuracy = report.markdown.split("### Accuracy")[1]
    assert _markdown_row(accuracy, "FedAvg †")[2] == "40.00%"
    assert _markdown_row(accuracy, "FedProx (diverged at round 3)")
    stable = _write_run(tmp_path / "stable" / "run", _config(rounds=2), _records([0.5, 0.6]))
    assert "Unstable" not in make_report([stable], tmp_path / "report2", plots=False).markdown


def test_curves_start_at_round_0_where_run_json_records_the_initial_model():
    from driftlab.experiments.report.plots import _series
    from driftlab.experiments.report.read import RunData

    def run(seed: int, initial: dict | None) -> RunData:
        info = {"status": "complete"} if initial is None else {"status": "complete", "initial": initial}
        return RunData(
            Path(f"s{seed}"), _config(seed=seed, rounds=2), _records([0.3, 0.4], train_loss=[2.0, 1.5]), info, seed=seed
        )

    both = [run(0, {"train_loss": 3.0, "test_accuracy": 0.1}), run(1, {"train_loss": 2.0, "test_accuracy": 0.1})]
    series = _series(both, "train_loss")
    assert (series.x, series.mean) == ([0, 1, 2], [2.5, 2.0, 1.5])
    assert series.std[0] == pytest.approx(0.7071067811865476)
    assert _series(both, "test_accuracy").mean[0] == 0.1
    assert _series(both, "train_loss", "bits").x[0] > 0  # no round 0 on a log axis of bits
    assert _series([run(0, None)], "train_loss").x == [1, 2]  # runs without it start at round 1


# ---------------------------------------------------------------- the user's files in --out


def test_a_users_report_md_is_left_untouched_and_the_report_refused_with_the_fix(tmp_path, capsys):
    from driftlab import cli

    runs, out = _three_methods(tmp_path / "runs"), tmp_path / "mine"
    out.mkdir()
    (out / "report.md").write_bytes(b"# my own notes\n")
    (out / "keep.png").write_bytes(b"mine")
    assert cli.main(["report", str(runs), "--out", str(out), "--targets", "0.8"]) == 2
    assert capsys.readouterr().err == (
        f"driftlab: error: {out} already holds report.md, not written by driftlab (or changed since); nothing was written: "
        "choose another --out directory, or pass --force to replace it\n"
    )
    assert sorted(p.name for p in out.iterdir()) == ["keep.png", "report.md"]
    assert (out / "report.md").read_bytes() == b"# my own notes\n"
    # --force replaces report.md, and leaves the user's other files alone
    assert cli.main(["report", str(runs), "--out", str(out), "--targets", "0.8", "--force"]) == 0
    assert (out / "report.md").read_text().startswith("# driftlab report\n") and (
        out / "keep.png"
    ).read_bytes() == b"mine"


def test_a_figure_name_the_user_holds_is_refused_after_drawing_before_writing(tmp_path):
    runs, out = _three_methods(tmp_path / "runs"), tmp_path / "mine"
    out.mkdir()
    (out / "synthetic-accuracy.png").write_bytes(b"mine")  # a figure's name, known only once the figures are drawn
    with pytest.raises(ConfigError, match="holds synthetic-accuracy.png, not written by driftlab"):
        make_report([runs], out, targets=[0.8])
    assert sorted(p.name for p in out.iterdir()) == ["synthetic-accuracy.png"]


def test_a_rerun_into_its_own_folder_replaces_its_files_and_removes_only_its_stale_ones(tmp_path):
    from driftlab.owned_folder import MANIFEST_FILE

    runs, out = _three_methods(tmp_path / "runs"), tmp_path / "report"
    first = make_report([runs], out, targets=[0.8])
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs and {p.name for p in first.files} == {p.name for p in out.iterdir()} - {MANIFEST_FILE}
    (out / "notes.md").write_text("the user's")
    second = make_report([runs], out, targets=[0.8], plots=False)  # no figures now: the first report's are stale
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST_FILE, "notes.md", *(p.name for p in second.files)])
    assert not list(out.glob("*.png")) and (out / "notes.md").read_text() == "the user's"
    assert all(path.parent == out and path.exists() for path in second.files)


def test_a_report_folder_from_before_manifests_is_still_rewritten(tmp_path):
    runs, out = _three_methods(tmp_path / "runs"), tmp_path / "report"
    out.mkdir()
    (out / "report.md").write_text("# driftlab report\n\nan older version's\n")
    (out / "targets.csv").write_text("setting,target\n")
    make_report([runs], out, targets=[0.8], plots=False)
    assert "an older version's" not in (out / "report.md").read_text() and "FedAvg" in (out / "targets.csv").read_text()
