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
    plot_privacy,
    privacy_figure,
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


# ---------------------------------------------------------------- client-level differential privacy (issue 27)


def _private_config(
    algorithm: str = "fedavg", seed: int = 0, rounds: int = 5, z: float = 1.0, delta: float | None = 1e-5
) -> dict:
    """A run of ``_config`` with client-level DP: clip 1, noise multiplier ``z``, δ (None: unset), poisson sampling."""
    config = _config(algorithm, seed=seed, rounds=rounds)
    config["algorithm"]["aggregation"] = "uniform"
    config["sampling"]["mode"] = "poisson"
    config["privacy"] = {"clip": 1.0, "noise_multiplier": z, **({} if delta is None else {"delta": delta})}
    return config


def _private_records(accuracies, epsilons, noise_std: float = 1.0) -> list[dict]:
    """Rounds as a private run writes them: the fold's privacy metrics each round, ε only where δ is set."""
    n = len(accuracies)
    series = {"privacy_clip": [1.0] * n, "privacy_noise_std": [noise_std] * n, "privacy_clipped_fraction": [0.5] * n}
    if epsilons is not None:
        series["privacy_epsilon"] = epsilons
    return _records(accuracies, **series)


def _plain_config(rounds: int = 5) -> dict:
    """The non-private twin of ``_private_config``: the same setting and method keys, no [privacy]."""
    config = _private_config(rounds=rounds)
    del config["privacy"]
    return config


PRIVATE_FEDAVG = "DP-FedAvg"  # a private run is named apart from the same method without [privacy]


def test_tables_and_csv_put_the_epsilon_of_the_whole_run_beside_the_accuracy(tmp_path):
    root = tmp_path / "runs"
    _write_run(root / "plain", _plain_config(), _records([0.5, 0.6, 0.7, 0.8, 0.9]))
    # ε after each round; the run's ε is its last round's, 1.4 (the best accuracy, round 4, was released too)
    _write_run(root / "dp", _private_config(), _private_records([0.4, 0.5, 0.7, 0.75, 0.72], [0.5, 0.8, 1.0, 1.2, 1.4]))
    report = make_report([root], tmp_path / "report", targets=[0.7], plots=False)
    assert list(report.settings[0].methods) == ["FedAvg", PRIVATE_FEDAVG]
    row = next(r for r in report.accuracy if r.method == PRIVATE_FEDAVG)
    assert (row.epsilon.values, row.epsilon.deltas, row.epsilon.mean) == ((1.4,), (1e-5,), 1.4)

    accuracy = report.markdown.split("### Accuracy")[1]
    assert "| method | seeds | ε | final test accuracy | best test accuracy | final train loss |" in accuracy
    assert _markdown_row(accuracy, PRIVATE_FEDAVG)[:5] == [PRIVATE_FEDAVG, "1", "1.4", "72.00%", "75.00%"]
    assert _markdown_row(accuracy, "FedAvg")[:5] == ["FedAvg", "1", "∞", "90.00%", "90.00%"]  # no noise: ε = ∞
    assert "(ε, δ)-differential privacy at δ = 1e-05 of everything the server released" in report.markdown
    target = report.markdown.split("### Communication to reach 70% test accuracy")[1]
    assert "| method | ε | rounds | model-equivalents |" in target
    assert _markdown_row(target, PRIVATE_FEDAVG)[1:3] == ["1.4", "3"]  # the run's ε, beside the rounds to 70%
    assert _markdown_row(target, "FedAvg")[1:3] == ["∞", "3"]

    columns = ("epsilon", "epsilon_min", "epsilon_max", "delta")
    accuracy_csv = {r["method"]: r for r in _csv(tmp_path / "report" / "accuracy.csv")}
    assert [accuracy_csv[PRIVATE_FEDAVG][k] for k in columns] == ["1.4", "1.4", "1.4", "1e-05"]
    assert [accuracy_csv["FedAvg"][k] for k in columns] == ["inf", "inf", "inf", ""]
    targets_csv = {r["method"]: r for r in _csv(tmp_path / "report" / "targets.csv")}
    assert (targets_csv[PRIVATE_FEDAVG]["epsilon"], targets_csv["FedAvg"]["epsilon"]) == ("1.4", "inf")
    assert list(targets_csv["FedAvg"])[-4:] == list(columns)


def test_epsilon_is_infinite_without_noise_missing_without_delta_and_a_spread_when_seeds_differ(tmp_path):
    root = tmp_path / "runs"
    # FedAvg, two seeds: seed 1 stopped after 3 rounds (diverged), so it spent less ε.
    epsilons = [0.5, 0.8, 1.0, 1.2, 1.4]
    _write_run(root / "s0", _private_config(seed=0), _private_records([0.5, 0.6, 0.7, 0.8, 0.9], epsilons))
    _write_run(root / "s1", _private_config(seed=1), _private_records([0.5, 0.6, 0.7], epsilons[:3]), status="diverged")
    # SCAFFOLD clipped without noise (noise_multiplier 0): ε = ∞ though it has a δ; FedProx has no δ: not accounted.
    _write_run(root / "scaffold", _private_config("scaffold", z=0.0), _private_records([0.6] * 5, None, noise_std=0.0))
    _write_run(root / "fedprox", _private_config("fedprox", delta=None), _private_records([0.6] * 5, None))
    report = make_report([root], tmp_path / "report", plots=False)
    epsilon = {row.method: row.epsilon for row in report.accuracy}
    assert list(epsilon) == ["DP-FedAvg", "DP-FedProx", "DP-SCAFFOLD"]
    assert epsilon["DP-FedAvg"].values == (1.4, 1.0) and epsilon["DP-FedAvg"].seeds_differ
    assert epsilon["DP-FedAvg"].mean == pytest.approx(1.2)
    assert epsilon["DP-SCAFFOLD"].values == (float("inf"),) and epsilon["DP-FedProx"].values == (None,)
    table = report.markdown.split("### Accuracy")[1].split("###")[0]
    firsts = ("DP-FedAvg (diverged at round 4)", "DP-SCAFFOLD", "DP-FedProx")
    cells = {first: _markdown_row(table, first)[2] for first in firsts}
    assert cells == {"DP-FedAvg (diverged at round 4)": "1.2 (seeds 1–1.4)", "DP-SCAFFOLD": "∞", "DP-FedProx": "—"}
    rows = {r["method"]: r for r in _csv(tmp_path / "report" / "accuracy.csv")}
    assert [rows["DP-FedAvg"][k] for k in ("epsilon", "epsilon_min", "epsilon_max")] == ["1.2", "1", "1.4"]
    assert [rows["DP-SCAFFOLD"][k] for k in ("epsilon", "epsilon_min", "epsilon_max")] == ["inf", "inf", "inf"]
    assert [rows["DP-FedProx"][k] for k in ("epsilon", "epsilon_min", "epsilon_max", "delta")] == ["", "", "", ""]


def test_an_infinite_epsilon_written_as_text_is_read_as_infinity(tmp_path):
    from driftlab.experiments.report import run_epsilon

    records = _private_records([0.5, 0.6], ["Infinity", "inf"], noise_std=0.0)
    run = _write_run(tmp_path / "dp", _private_config(z=0.0), records)
    report = make_report([run], tmp_path / "report", plots=False)
    assert run_epsilon(report.runs[0]) == float("inf")


def _noise_sweep(root: Path) -> dict:
    """Two data settings x (FedAvg, SCAFFOLD) x a noise axis of 3 multipliers and no noise; seeds 0, 1 share ε.

    Run (data d, method m, noise level j) has final accuracy 0.7 − 0.1 j − 0.05 m + 0.1 d (seed 1: + 0.02)
    and ε = _NOISE_EPSILONS[j] after its last (4th) round; the "no noise" runs reach 0.75 − 0.05 m + 0.1 d with ε = ∞.
    """
    data = [("IID", "iid"), ("Dirichlet", "dirichlet")]
    methods = [("FedAvg", "fedavg"), ("SCAFFOLD", "scaffold")]
    noise = [("z=0.5", 0.5), ("z=1", 1.0), ("z=2", 2.0), ("no noise", 0.0)]
    runs = []
    for d, (setting, partition) in enumerate(data):
        for j, (noise_label, z) in enumerate(noise):
            for m, (method, algorithm) in enumerate(methods):
                for seed in (0, 1):
                    run_dir = f"runs/{partition}-z{z}/{algorithm}/seed-{seed}"
                    setting_label = f"{setting}, {noise_label}"
                    entry = {"dir": run_dir, "setting": setting_label, "method": method, "seed": seed, "overrides": []}
                    runs.append(entry)
                    final = (0.7 - 0.1 * j if z else 0.75) - 0.05 * m + 0.1 * d + 0.02 * seed
                    epsilons = [e * _NOISE_EPSILONS[j] / 4 for e in (1, 2, 3, 4)] if z else None
                    config = _private_config(algorithm, seed=seed, rounds=4, z=z)
                    config["data"]["partition"] = partition
                    _write_run(root / run_dir, config, _private_records([0.1, 0.2, 0.3, final], epsilons, noise_std=z))
    document = {
        "format": 1,
        "name": "dp-noise",
        "base": "synthetic-fedprox",
        "seeds": [0, 1],
        "axes": [
            {
                "name": "data",
                "role": "setting",
                "values": [{"label": s, "set": [f"data.partition={p}"]} for s, p in data],
            },
            {
                "name": "noise",
                "role": "setting",
                "values": [{"label": n, "set": [f"privacy.noise_multiplier={z}"]} for n, z in noise],
            },
            {
                "name": "method",
                "role": "method",
                "values": [{"label": m, "set": [f"algorithm.name={a}"]} for m, a in methods],
            },
        ],
        "runs": runs,
    }
    (root / "sweep.json").write_text(json.dumps(document))
    return document


_NOISE_EPSILONS = (8.0, 2.0, 0.5)


def _curves(axis) -> dict[str, list[float]]:
    """Each drawn line's points, flattened to x0, y0, x1, y1, ...: the data the figure plots."""
    return {line.get_label(): [float(v) for xy in line.get_xydata() for v in xy] for line in axis.get_lines()}


def test_privacy_utility_points_are_the_runs_of_a_noise_axis(tmp_path):
    _noise_sweep(tmp_path / "sweep")
    report = make_report([tmp_path / "sweep"], tmp_path / "report", plots=False)  # the figure is drawn below
    utility = report.privacy
    assert not utility.by_rounds and utility.deltas == (1e-5,)
    # A panel per data setting (the noise axis is no setting of the figure), a line per method.
    assert [panel.setting for panel in utility.panels] == ["IID", "Dirichlet"]
    assert [[line.method for line in panel.lines] for panel in utility.panels] == [["FedAvg", "SCAFFOLD"]] * 2
    for d, panel in enumerate(utility.panels):
        for m, line in enumerate(panel.lines):
            # Points by ε: z=2 (ε 0.5), z=1 (ε 2), z=0.5 (ε 8); accuracy means over seeds 0 and 1 (+0.01).
            assert [point.label for point in line.drawn] == ["z=2", "z=1", "z=0.5"]
            assert [point.epsilon.mean for point in line.drawn] == [0.5, 2.0, 8.0]
            expected = [0.71 - 0.1 * j - 0.05 * m + 0.1 * d for j in (2, 1, 0)]
            assert [point.accuracy.mean for point in line.drawn] == pytest.approx(expected)
            assert [point.noise_multiplier for point in line.drawn] == [2.0, 1.0, 0.5]
            (reference,) = line.references
            assert reference.label == "no noise" and reference.accuracy.mean == pytest.approx(0.76 - 0.05 * m + 0.1 * d)

    # The figure draws exactly those points (data, not pixels), and the no-noise runs as level lines.
    figure = privacy_figure(utility)
    assert figure.suffix == "privacy-utility" and len(figure.figure.axes) == 2
    axis = figure.figure.axes[1]  # Dirichlet
    curves = _curves(axis)
    assert curves["FedAvg"] == pytest.approx([0.5, 61.0, 2.0, 71.0, 8.0, 81.0])  # (ε, accuracy %) of each point
    assert curves["SCAFFOLD"] == pytest.approx([0.5, 56.0, 2.0, 66.0, 8.0, 76.0])
    assert curves["FedAvg, no noise (ε = ∞)"][1::2] == pytest.approx([86.0, 86.0])  # a level line at 86%
    assert axis.get_xscale() == "log"  # ε spans 0.5 to 8
    assert "one point per privacy" in figure.caption and "dashed: the method without noise" in figure.caption

    _, png = plot_privacy(utility, tmp_path)
    assert png.name == "privacy-utility.png" and png.read_bytes()[:8] == PNG_SIGNATURE
    assert "## Privacy and utility" in report.markdown and "`privacy.csv`" in report.markdown
    points = _csv(tmp_path / "report" / "privacy.csv")
    assert len(points) == 2 * 2 * 4
    first = next(r for r in points if (r["setting"], r["method"], r["point"]) == ("IID", "FedAvg", "z=1"))
    assert (first["seeds"], first["noise_multiplier"], first["epsilon"], first["delta"]) == ("2", "1", "2", "1e-05")
    assert float(first["final_accuracy_mean"]) == pytest.approx(0.61)
    # the tables of each (data, noise) setting carry its ε; a no-noise setting shows ∞
    iid_z1 = report.markdown.split("## IID, z=1\n")[1].split("\n## ")[0]
    assert _markdown_row(iid_z1.split("### Accuracy")[1], "FedAvg")[2] == "2"
    assert _markdown_row(report.markdown.split("## IID, no noise")[1].split("### Accuracy")[1], "FedAvg")[2] == "∞"


def test_one_noise_level_plots_each_runs_epsilon_after_every_round(tmp_path):
    root = tmp_path / "runs"
    epsilons = [0.5, 0.9, 1.2, 1.5]
    _write_run(root / "s0", _private_config(seed=0, rounds=4), _private_records([0.2, 0.4, 0.5, 0.6], epsilons))
    _write_run(root / "s1", _private_config(seed=1, rounds=4), _private_records([0.4, None, 0.7, 0.8], epsilons))
    scaffold_records = _private_records([0.3, 0.5, 0.6, 0.7], epsilons)
    _write_run(root / "scaffold", _private_config("scaffold", rounds=4), scaffold_records)
    report = make_report([root], tmp_path / "report")
    utility = report.privacy
    assert utility.by_rounds
    (panel,) = utility.panels
    fedavg, scaffold = ((line.method, line.drawn[0]) for line in panel.lines)
    assert [fedavg[0], scaffold[0]] == ["FedAvg", "SCAFFOLD"]
    # Rounds at which both seeds evaluated: 1, 3, 4 (seed 1 skipped round 2); accuracy the mean of the seeds.
    assert [v for pair in fedavg[1].trajectory for v in pair] == pytest.approx([0.5, 0.3, 1.2, 0.6, 1.5, 0.7])
    scaffold_points = [v for pair in scaffold[1].trajectory for v in pair]
    assert scaffold_points == pytest.approx([0.5, 0.3, 0.9, 0.5, 1.2, 0.6, 1.5, 0.7])
    figure = privacy_figure(utility)
    assert _curves(figure.figure.axes[0])["FedAvg"] == pytest.approx([0.5, 30.0, 1.2, 60.0, 1.5, 70.0])
    assert "after each evaluated round" in figure.caption and figure.figure.axes[0].get_xscale() == "linear"
    assert "Each method ran at one noise level" in report.markdown and "](privacy-utility.png)" in report.markdown
    assert (tmp_path / "report" / "privacy-utility.png").read_bytes()[:8] == PNG_SIGNATURE


def test_standalone_runs_at_several_noise_levels_share_a_line(tmp_path):
    root = tmp_path / "runs"
    for z, epsilon, final in ((0.5, 6.0, 0.8), (2.0, 0.7, 0.6)):
        records = _private_records([0.1, final], [epsilon / 2, epsilon])
        _write_run(root / f"z{z}", _private_config(z=z, rounds=2), records)
    _write_run(root / "plain", _plain_config(rounds=2), _records([0.1, 0.9]))
    report = make_report([root], tmp_path / "report", plots=False)
    # The tables tell the three runs apart by their privacy keys; the figure joins them on one line.
    assert list(report.settings[0].methods) == [
        "FedAvg",
        "DP-FedAvg (privacy.noise_multiplier=0.5)",
        "DP-FedAvg (privacy.noise_multiplier=2)",
    ]
    (panel,) = report.privacy.panels
    (line,) = panel.lines
    assert line.method == "FedAvg" and not report.privacy.by_rounds
    assert [(p.label, p.epsilon.mean, p.accuracy.mean) for p in line.drawn] == [
        ("privacy.noise_multiplier=2", 0.7, 0.6),
        ("privacy.noise_multiplier=0.5", 6.0, 0.8),
    ]
    assert [(p.label, p.accuracy.mean) for p in line.references] == [("no privacy", 0.9)]
    assert not any(p.suffix == ".png" for p in report.files) and (tmp_path / "report" / "privacy.csv") in report.files


def test_private_runs_without_delta_are_reported_but_not_drawn(tmp_path):
    run = _write_run(tmp_path / "dp", _private_config(delta=None, rounds=2), _private_records([0.5, 0.6], None))
    report = make_report([run], tmp_path / "report")
    assert report.privacy.unaccounted == 1 and privacy_figure(report.privacy) is None
    assert "nothing to draw" in report.markdown
    assert not any(p.suffix == ".png" and "privacy" in p.name for p in report.files)


# Digests of the report of _three_methods + _sweep written before privacy existed (the tmp folder replaced by <tmp>,
# figures by their names): a report of runs without [privacy] must not change by a byte.
NON_PRIVATE_REPORT_DIGESTS = {
    False: "8306fa069c47d4ddfd3c22d9812bcec88065ea38dc040ca915e804c3a84bba6e",
    True: "ff0df1980fc6ff1a22574cff58dfec1a03c46ebe9f02f8a453af8ef38d592fbf",
}


@pytest.mark.parametrize("plots", [False, True])
def test_a_report_without_private_runs_is_byte_identical_to_before_privacy(tmp_path, plots, monkeypatch):
    import hashlib

    import driftlab.experiments.report as report_module

    # The "Over seeds" section and seeds.csv came later (issue 29; report_seeds_test.py): everything else is as it was.
    monkeypatch.setattr(report_module, "seeds_section", lambda *args: [])
    monkeypatch.setattr(report_module, "write_seeds_csv", lambda *args: [])
    monkeypatch.setattr(report_module, "write_rounds_long_csv", lambda *args: [])  # later too (issue 43)
    _three_methods(tmp_path / "runs")
    _sweep(tmp_path / "sweep")
    report = make_report([tmp_path / "runs", tmp_path / "sweep"], tmp_path / "report", targets=[0.8], plots=plots)
    digest = hashlib.sha256()
    for path in sorted(report.files):
        data = b"png" if path.suffix == ".png" else path.read_bytes().replace(str(tmp_path).encode(), b"<tmp>")
        digest.update(path.name.encode() + b"\0" + data + b"\0")
    assert report.privacy is None and "ε" not in report.markdown
    assert digest.hexdigest() == NON_PRIVATE_REPORT_DIGESTS[plots]


def test_a_grid_over_noise_multipliers_creates_the_privacy_section_and_gives_a_point_each(tmp_path):
    from driftlab.experiments.config import read_config_source

    assert "privacy" not in read_config_source("synthetic-fedavg")  # the axis creates the section from nothing
    spec = sweep_from_config("synthetic-fedavg", ["privacy.noise_multiplier=[0.5, 2]"], [0, 1], name="dp")
    assert spec.axes[0].role == "setting"  # methods are compared at equal noise: a table per noise level
    shared = ["rounds=2", "sampling.mode=poisson", "algorithm.aggregation=uniform"]
    shared += ["privacy.clip=1", "privacy.delta=1e-5"]
    runs = plan(spec, None, shared)
    assert [(run.dir, run.setting, run.method) for run in runs[::2]] == [
        ("runs/noise-multiplier-0.5/fedavg/seed-0", "noise_multiplier=0.5", "FedAvg"),
        ("runs/noise-multiplier-2/fedavg/seed-0", "noise_multiplier=2", "FedAvg"),
    ]
    sections = [run.config.to_dict()["privacy"] for run in runs]
    expected = [(0.5, 1, 1e-5)] * 2 + [(2, 1, 1e-5)] * 2
    assert [(s["noise_multiplier"], s["clip"], s["delta"]) for s in sections] == expected
    # Each noise level is its own configuration (fingerprint); seeds differ only by the seed.
    fingerprints = {(run.setting, run.seed): run.config.fingerprint() for run in runs}
    assert len(set(fingerprints.values())) == 4
    assert fingerprints[("noise_multiplier=0.5", 0)] != fingerprints[("noise_multiplier=2", 0)]
    # Off by default: a config without the section has none (its fingerprint is the one it had before privacy).
    assert "privacy" not in load_config("synthetic-fedavg").to_dict()

    root = tmp_path / "sweep"
    root.mkdir()
    (root / "sweep.json").write_text(json.dumps(sweep_document(spec, runs, None, shared)))
    for run in runs:
        z = run.config.to_dict()["privacy"]["noise_multiplier"]
        epsilon, final = (3.0, 0.7) if z == 0.5 else (0.4, 0.5)
        records = _private_records([0.2, final], [epsilon / 2, epsilon], noise_std=z)
        _write_run(root / run.dir, run.config.to_dict(), records)
    report = make_report([root], tmp_path / "report", plots=False)
    (panel,) = report.privacy.panels
    (line,) = panel.lines
    assert (panel.setting, line.method, report.privacy.by_rounds) == ("dp", "FedAvg", False)
    assert [(p.label, p.epsilon.mean, p.accuracy.mean, len(p.runs)) for p in line.drawn] == [
        ("noise_multiplier=2", 0.4, 0.5, 2),
        ("noise_multiplier=0.5", 3.0, 0.7, 2),
    ]


def test_noise_computed_for_a_target_epsilon_is_read_from_run_json_and_noiseless_runs_are_told_apart(tmp_path):
    root = tmp_path / "runs"
    target = _private_config(z=0.0, rounds=2)
    target["privacy"]["target_epsilon"] = 2.0  # config.json keeps noise_multiplier 0: the run resolved it
    resolved = {"privacy": {"noise_multiplier": 1.37, "delta": 1e-5, "epsilon": 2.0}}
    _write_run(root / "target", target, _private_records([0.3, 0.6], [1.2, 2.0], noise_std=1.37), **resolved)
    _write_run(root / "clipped", _private_config(z=0.0, rounds=2), _private_records([0.3, 0.8], None, noise_std=0.0))
    _write_run(root / "plain", _plain_config(rounds=2), _records([0.3, 0.9]))
    report = make_report([root], tmp_path / "report", plots=False)
    (line,) = report.privacy.panels[0].lines
    (point,) = line.drawn
    assert (point.noise_multiplier, point.epsilon.mean, point.accuracy.mean) == (1.37, 2.0, 0.6)
    # clipped without noise (it lacks the target's privacy.target_epsilon key) and no [privacy] at all: both ε = ∞
    assert [(p.label, p.accuracy.mean) for p in line.references] == [("[privacy]", 0.8), ("no privacy", 0.9)]
    lines = privacy_figure(report.privacy).figure.axes[0].get_lines()
    levels = {line.get_label(): line.get_ydata()[0] for line in lines if "ε = ∞" in line.get_label()}
    assert levels == {"FedAvg, [privacy] (ε = ∞)": 80.0, "FedAvg, no privacy (ε = ∞)": 90.0}  # one line, two levels


# ---------------------------------------------------------------- simulated time and asynchronous FedBuff (issue 28)


def _timed_config(
    algorithm: str = "fedavg", seed: int = 0, rounds: int = 5, asynchronous: bool = False, **system
) -> dict:
    """``_config`` with a [system] section (the defaults, ``system`` replaced) and, with ``asynchronous``, FedBuff's."""
    from driftlab.experiments.config import AsynchronousConfig, SystemConfig

    config = _config(algorithm, seed=seed, rounds=rounds)
    config["system"] = {**SystemConfig().model_dump(), **system}
    if asynchronous:
        config["algorithm"]["aggregation"] = "uniform"
        config["asynchronous"] = {**AsynchronousConfig().model_dump(), "concurrency": 4, "buffer": SELECTED}
    return config


def _timed_records(
    accuracies, round_seconds: float | Sequence[float], asynchronous: bool = False, **series
) -> list[dict]:
    """``_records`` on a clock: round t runs from the end of round t − 1 for ``round_seconds`` (one number: every round)."""
    records = _records(accuracies, **series)
    clock = 0.0
    for index, record in enumerate(records):
        seconds = round_seconds if isinstance(round_seconds, (int, float)) else round_seconds[index]
        record.update(time_start=clock, time_end=clock + seconds, num_missed_deadline=0, num_not_awaited=0)
        if asynchronous:
            record.update(mean_staleness=1.5, max_staleness=3, num_dispatched=SELECTED)
        clock += seconds
    return records


def _fedavg_and_fedbuff(root: Path) -> Path:
    """Synchronous FedAvg, 10 s a round, reaches 80% at round 4 (40 s), runs 50 s; FedBuff, 3 s an update (buffer of
    2 uploads, so 640 bits: one model-equivalent an update), reaches 80% at update 5 (15 s) and runs 8 updates (24 s)."""
    _write_run(root / "fedavg", _timed_config(rounds=5), _timed_records([0.5, 0.6, 0.7, 0.8, 0.85], 10.0))
    _write_run(
        root / "fedbuff",
        _timed_config(rounds=8, asynchronous=True),
        _timed_records([0.4, 0.5, 0.6, 0.7, 0.8, 0.82, 0.84, 0.86], 3.0, asynchronous=True),
    )
    return root


def test_time_to_target_and_simulated_time_in_the_tables_equal_the_records(tmp_path):
    from driftlab.metrics.summary import summarize

    out = tmp_path / "report"
    report = make_report([_fedavg_and_fedbuff(tmp_path / "runs")], out, targets=[0.8], plots=False)
    setting = report.settings[0]
    assert list(setting.methods) == ["FedAvg", "FedBuff"]  # FedAvg run asynchronously is FedBuff, named apart
    # an update is not a round: FedBuff's 8 updates are not cut to FedAvg's 5 rounds
    assert setting.cut_round is None and setting.cut_update is None
    assert [run.rounds_done for run in setting.runs] == [5, 8]
    fedavg, fedbuff = (_row(report, method, 0.8) for method in ("FedAvg", "FedBuff"))
    assert (fedavg.rounds, fedavg.time, fedavg.model_equivalents) == (4, 40.0, 4.0)
    assert (fedbuff.rounds, fedbuff.time, fedbuff.model_equivalents) == (5, 15.0, 5.0)
    for run in setting.runs:  # the run's own summary, from the same records, says the same
        summary = summarize(run.records, 0.8, PARAMETERS)
        hit = next(r for r in run.records if r["test_accuracy"] >= 0.8)
        assert summary["time_to_target"] == hit["time_end"] == _row(report, run.method, 0.8).time
        assert summary["simulated_time"] == run.records[-1]["time_end"] == run.simulated_time

    communication = report.markdown.split("### Communication to reach 80% test accuracy")[1]
    assert (
        "| method | rounds | time to target | model-equivalents | upload | download | vs FedAvg | vs FedBuff | note |"
        in communication
    )
    assert _markdown_row(communication, "FedAvg")[:4] == ["FedAvg", "4", "40.0 s", "4.0"]
    assert _markdown_row(communication, "FedBuff")[:4] == ["FedBuff", "5", "15.0 s", "5.0"]
    accuracy = report.markdown.split("### Accuracy")[1]
    assert (
        "| method | seeds | final test accuracy | best test accuracy | final train loss | simulated time |" in accuracy
    )
    assert _markdown_row(accuracy, "FedAvg")[-1] == "50.0 s" and _markdown_row(accuracy, "FedBuff")[-1] == "24.0 s"
    assert (
        "Asynchronous methods (FedBuff) aggregate buffered client updates (FedBuff, Nguyen et al. 2022): their rounds are server updates"
        in report.markdown
    )
    assert report.accuracy[1].simulated_time.mean == 24.0

    targets = {row["method"]: row for row in _csv(out / "targets.csv")}
    assert (targets["FedAvg"]["time_to_target"], targets["FedBuff"]["time_to_target"]) == ("40", "15")
    assert list(targets["FedAvg"])[-1] == "time_to_target"
    accuracy_csv = {row["method"]: row for row in _csv(out / "accuracy.csv")}
    assert [accuracy_csv["FedBuff"][k] for k in ("simulated_time_mean", "simulated_time_std")] == ["24", ""]
    runs = {row["method"]: row for row in _csv(out / "runs.csv")}
    assert (runs["FedAvg"]["simulated_time"], runs["FedAvg"]["asynchronous"]) == ("50", "0")
    assert (runs["FedBuff"]["simulated_time"], runs["FedBuff"]["asynchronous"], runs["FedBuff"]["rounds_done"]) == (
        "24",
        "1",
        "8",
    )


def test_time_over_seeds_lower_bounds_and_minutes(tmp_path):
    root = tmp_path / "runs"
    # seed 0 reaches 70% at round 2 (120 + 150 = 270 s); seed 1 never does, so its whole run (3 × 200 s) is spent
    _write_run(root / "s0", _timed_config(seed=0, rounds=3), _timed_records([0.6, 0.7, 0.75], [120.0, 150.0, 90.0]))
    _write_run(root / "s1", _timed_config(seed=1, rounds=3), _timed_records([0.5, 0.6, 0.65], 200.0))
    report = make_report([root], tmp_path / "report", targets=[0.7], plots=False)
    row = _row(report, "FedAvg", 0.7)
    assert (row.time, row.lower_bound) == ((270 + 600) / 2, True)
    communication = report.markdown.split("### Communication to reach 70% test accuracy")[1]
    assert _markdown_row(communication, "FedAvg")[1:3] == ["2.5+", "7.2 min+"]  # 435 s
    accuracy = report.accuracy[0].simulated_time
    assert (accuracy.mean, accuracy.std) == (480.0, pytest.approx(statistics.stdev([360.0, 600.0])))
    # in the mean's unit: 8.0 ± 2.8 min
    assert _markdown_row(report.markdown.split("### Accuracy")[1], "FedAvg")[-1] == "8.0 ± 2.8 min"
    # never reached by anyone: the compact table keeps the time column
    never = make_report([root], tmp_path / "never", targets=[0.95], plots=False)
    table = never.markdown.split("no method reached 95%")[1]
    assert "| method | rounds | time to target | model-equivalents |" in table
    assert _markdown_row(table, "FedAvg")[1:3] == ["3+", "8.0 min+"]


def test_an_untimed_run_beside_timed_ones_has_no_time(tmp_path):
    # stand-alone: a timed and an untimed run are two settings, named "timed" and "untimed" rather than by every [system] key
    _write_run(tmp_path / "alone" / "timed", _timed_config(rounds=3), _timed_records([0.5, 0.6, 0.7], 1.0))
    _write_run(tmp_path / "alone" / "untimed", _config(rounds=3), _records([0.5, 0.6, 0.7]))
    _write_run(
        tmp_path / "alone" / "slow", _timed_config(rounds=3, speed_median=10.0), _timed_records([0.5, 0.6, 0.7], 5.0)
    )
    labels = [s.label for s in make_report([tmp_path / "alone"], tmp_path / "r0", plots=False).settings]
    assert sorted(labels) == [
        "synthetic, timed, system.speed_median=10",
        "synthetic, timed, system.speed_median=100",
        "synthetic, untimed",
    ]
    # in a sweep's setting the untimed method's cells are "—" and it is left out of the time figure
    runs = []
    for method, config, records in (
        ("timed", _timed_config(rounds=3), _timed_records([0.5, 0.6, 0.7], 1.0)),
        ("untimed", _config(rounds=3), _records([0.5, 0.6, 0.7])),
    ):
        runs.append({"dir": f"runs/{method}/seed-0", "setting": "", "method": method, "seed": 0, "overrides": []})
        _write_run(tmp_path / "sweep" / f"runs/{method}/seed-0", config, records)
    (tmp_path / "sweep" / "sweep.json").write_text(
        json.dumps({"format": 1, "name": "mixed", "base": "b", "runs": runs})
    )
    report = make_report([tmp_path / "sweep"], tmp_path / "report", targets=[0.6])
    communication = report.markdown.split("### Communication to reach 60% test accuracy")[1]
    assert _markdown_row(communication, "untimed")[1:3] == ["2", "—"] and _markdown_row(communication, "timed")[
        1:3
    ] == ["2", "2.0 s"]
    assert _markdown_row(report.markdown.split("### Accuracy")[1], "untimed")[-1] == "—"
    time = next(f for f in setting_figures(report.settings[0], [0.6]) if f.suffix == "time")
    assert time.caption.endswith("; target line: 60% dotted; untimed runs not drawn: untimed")
    assert [line.get_label() for line in time.figure.axes[0].get_lines()] == ["timed", "target 60%"]
    assert "![mixed: " in report.markdown and "](mixed-time.png)" in report.markdown


def test_the_time_figure_starts_at_0_in_a_unit_chosen_by_the_span_and_labels_asynchronous_runs(tmp_path):
    root = _fedavg_and_fedbuff(tmp_path / "runs")
    for name in ("fedavg", "fedbuff"):
        info = json.loads((root / name / "run.json").read_text())
        info["initial"] = {"train_loss": 2.5, "test_accuracy": 0.1}
        (root / name / "run.json").write_text(json.dumps(info))
    report = make_report([root], tmp_path / "report", targets=[0.8])
    pngs = sorted(p.name for p in report.files if p.suffix == ".png")
    assert (
        "synthetic-time.png" in pngs and (tmp_path / "report" / "synthetic-time.png").read_bytes()[:8] == PNG_SIGNATURE
    )
    figure = next(f for f in setting_figures(report.settings[0], [0.8]) if f.suffix == "time")
    accuracy, loss = figure.figure.axes
    assert (accuracy.get_xlabel(), loss.get_xlabel()) == ("simulated time (s)", "simulated time (s)")  # 50 s: seconds
    curves = {line.get_label(): line for line in accuracy.get_lines()}
    assert set(curves) == {"FedAvg", "FedBuff", "target 80%"}  # "FedBuff" says asynchronous already
    assert list(curves["FedAvg"].get_xdata()) == [0, 10, 20, 30, 40, 50]  # from time 0: run.json's initial model
    assert list(curves["FedAvg"].get_ydata()) == pytest.approx([10, 50, 60, 70, 80, 85])
    assert list(curves["FedBuff"].get_xdata()) == [0, 3, 6, 9, 12, 15, 18, 21, 24]
    assert figure.caption.startswith("test accuracy and train loss vs simulated time (s;")
    # the per-round figures say what an asynchronous run's rounds are
    rounds = _figure_of(report.settings[0], "accuracy")
    assert rounds.figure.axes[0].get_xlabel() == "communication round (asynchronous runs: server update)"
    assert rounds.caption.startswith("test accuracy vs rounds (asynchronous runs: server updates)")
    # an asynchronous run under another label gets its legend entry; hours when the span is long
    from driftlab.experiments.report.plots import curve_label, time_axis

    assert curve_label("FedAvg (buffer 2)", report.settings[0].methods["FedBuff"]) == "FedAvg (buffer 2), asynchronous"
    long = _write_run(tmp_path / "long" / "run", _timed_config(rounds=3), _timed_records([0.5, 0.6, 0.7], 3600.0))
    long_report = make_report([long], tmp_path / "long-report", plots=False)
    assert time_axis(long_report.settings[0]) == ("h", 1 / 3600)
    axis = _figure_of(long_report.settings[0], "time").figure.axes[0]
    assert axis.get_xlabel() == "simulated time (h)" and list(axis.get_lines()[0].get_xdata()) == [1, 2, 3]


def test_untimed_reports_have_no_time_columns_figure_or_note(tmp_path):
    report = make_report([_three_methods(tmp_path / "runs")], tmp_path / "report", targets=[0.8])
    assert "time to target" not in report.markdown and "simulated time" not in report.markdown
    assert not any(p.name.endswith("-time.png") for p in report.files)
    assert all(row.time is None for row in report.targets) and all(
        row.simulated_time is None for row in report.accuracy
    )
    assert "time_to_target" not in _csv(tmp_path / "report" / "targets.csv")[0]
    assert "simulated_time" not in _csv(tmp_path / "report" / "runs.csv")[0]
    # (byte for byte: test_a_report_without_private_runs_is_byte_identical_to_before_privacy pins these reports' digests)


def test_asynchronous_runs_of_different_lengths_are_cut_among_themselves(tmp_path):
    _write_run(tmp_path / "fedavg", _timed_config(rounds=2), _timed_records([0.5, 0.6], 10.0))
    for seed, updates in ((0, 6), (1, 4)):
        records = _timed_records([0.1 * (i + 1) for i in range(updates)], 2.0, asynchronous=True)
        _write_run(tmp_path / f"fedbuff-{seed}", _timed_config(seed=seed, rounds=updates, asynchronous=True), records)
    report = make_report([tmp_path], tmp_path / "report", plots=False)
    setting = report.settings[0]
    assert (setting.cut_round, setting.cut_update) == (None, 4)
    assert [run.rounds_done for run in setting.methods["FedBuff"]] == [4, 4] and setting.methods["FedAvg"][
        0
    ].rounds_done == 2
    assert "up to server update 4, the last of the shortest (synchronous runs are not cut to it" in report.markdown
    assert "ran 6 updates" in report.markdown and "Cut to round" not in report.markdown


def test_real_timed_and_asynchronous_runs_share_a_setting_and_their_times(tmp_path):
    # FedBuff samples no cohorts, so the synchronous run's participation does not make it another setting
    tiny = ["data.num_clients=6", "client.steps=2", "algorithm.aggregation=uniform", "system.speed_median=100"]
    driftlab.run(None, out_dir=tmp_path / "runs" / "sync", overrides=["rounds=3", "sampling.participation=0.5", *tiny])
    driftlab.run(
        None,
        out_dir=tmp_path / "runs" / "async",
        overrides=["rounds=4", "asynchronous.concurrency=4", "asynchronous.buffer=2", *tiny],
    )
    report = make_report([tmp_path / "runs"], tmp_path / "report", targets=[0.01])
    assert [s.label for s in report.settings] == ["synthetic"] and list(report.settings[0].methods) == [
        "FedAvg",
        "FedBuff",
    ]
    for run in report.runs:
        assert run.timed and run.asynchronous == (run.method == "FedBuff")
        assert _row(report, run.method, 0.01).time == run.records[0]["time_end"] > 0  # any accuracy beats 1% at once
        assert (
            next(r for r in report.accuracy if r.method == run.method).simulated_time.mean
            == run.records[-1]["time_end"]
        )
    assert (tmp_path / "report" / "synthetic-time.png").read_bytes()[:8] == PNG_SIGNATURE


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
