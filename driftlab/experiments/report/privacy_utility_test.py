"""The report's privacy section (``privacy_utility``) and its ε column: hand-built private runs whose ε and accuracy
can be worked out on paper, a noise-multiplier sweep, and the byte-identical report of runs without [privacy].

Fixtures as in ``report_test`` (P = 10 parameters, 2 selected clients a round: one upload round is 1 model-equivalent).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from driftlab.experiments.config import load_config
from driftlab.experiments.report import make_report, plot_privacy, privacy_figure
from driftlab.experiments.report.report_test import (
    PNG_SIGNATURE,
    _config,
    _csv,
    _markdown_row,
    _records,
    _sweep,
    _three_methods,
    _write_run,
)
from driftlab.experiments.sweep import plan, sweep_document, sweep_from_config

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
