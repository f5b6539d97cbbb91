from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from driftlab.experiments.config import load_config
from driftlab.experiments.report import make_report
from driftlab.experiments.report.rounds_long import COLUMNS, ROUNDS_LONG_CSV


def _run(path: Path, algorithm: str, seed: int, records: list[dict]) -> Path:
    config = load_config(None).to_dict()
    config["algorithm"] = {"name": algorithm, "aggregation": "weighted"}
    config["seed"], config["rounds"] = seed, len(records)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _records(seed: int) -> list[dict]:
    # round 1 is not evaluated (no test_accuracy), a list and a flag are no metrics
    shared = {"num_selected": 2, "local_steps": 10, "upload_bits": 640, "download_bits": 640}
    return [
        {"round": 1, **shared, "reporting_clients": [0, 1], "diverged": False},
        {"round": 2, **shared, "test_accuracy": 0.5 + seed / 10, "train_loss": 1 / 3},
    ]


def test_the_long_csv_holds_every_runs_numbers_and_reads_back_exactly(tmp_path):
    runs = [
        _run(tmp_path / "runs" / f"{name}-{seed}", name, seed, _records(seed))
        for name in ("fedavg", "scaffold")
        for seed in (0, 1)
    ]
    report = make_report([tmp_path / "runs"], tmp_path / "report", plots=False)
    path = tmp_path / "report" / ROUNDS_LONG_CSV
    assert path in report.files
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0]) == COLUMNS
    assert len(rows) == 4 * (4 + 6)  # per run: four numbers in round 1, six in round 2
    by_run = {}
    for row in rows:
        by_run.setdefault(row["run"], []).append((int(row["round"]), row["metric"], float(row["value"])))
    assert set(by_run) == {str(run) for run in runs}
    assert by_run[str(runs[1])] == [
        (1, "num_selected", 2.0),
        (1, "local_steps", 10.0),
        (1, "upload_bits", 640.0),
        (1, "download_bits", 640.0),
        (2, "num_selected", 2.0),
        (2, "local_steps", 10.0),
        (2, "upload_bits", 640.0),
        (2, "download_bits", 640.0),
        (2, "test_accuracy", 0.6),
        (2, "train_loss", 1 / 3),
    ]
    fedavg_seed_1 = [row for row in rows if row["run"] == str(runs[1])][0]
    assert (fedavg_seed_1["method"], fedavg_seed_1["seed"]) == ("FedAvg", "1") and fedavg_seed_1["setting"]


def test_pandas_reads_it_as_a_tidy_table(tmp_path):
    pandas = pytest.importorskip("pandas")
    for seed in (0, 1):
        _run(tmp_path / "runs" / f"fedavg-{seed}", "fedavg", seed, _records(seed))
    make_report([tmp_path / "runs"], tmp_path / "report", plots=False)
    frame = pandas.read_csv(tmp_path / "report" / ROUNDS_LONG_CSV)
    accuracy = frame[frame.metric == "test_accuracy"]
    assert accuracy.groupby("round")["value"].mean().to_dict() == {2: pytest.approx(0.55)}
    assert frame.value.dtype == float and frame["round"].dtype == int
