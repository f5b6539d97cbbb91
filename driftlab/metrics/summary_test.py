"""The run summary: final/best accuracy, rounds, model-equivalents and bits to a target."""

from __future__ import annotations

import driftlab
from driftlab.metrics.summary import cumulative_bits_through, first_round_reaching, summarize


def _records():
    return [
        {"round": 1, "upload_bits": 100, "download_bits": 100, "local_steps": 5, "num_selected": 1},
        {
            "round": 2,
            "upload_bits": 100,
            "download_bits": 100,
            "local_steps": 5,
            "num_selected": 1,
            "test_accuracy": 0.4,
        },
        {"round": 3, "upload_bits": 100, "download_bits": 100, "local_steps": 5, "num_selected": 1},
        {
            "round": 4,
            "upload_bits": 100,
            "download_bits": 100,
            "local_steps": 5,
            "num_selected": 1,
            "test_accuracy": 0.75,
        },
        {
            "round": 5,
            "upload_bits": 100,
            "download_bits": 100,
            "local_steps": 5,
            "num_selected": 1,
            "test_accuracy": 0.7,
        },
    ]


def test_summary_by_hand():
    records = _records()
    assert first_round_reaching(records, 0.5)["round"] == 4
    assert first_round_reaching(records, 0.9) is None
    assert cumulative_bits_through(records, 3) == (300, 300)
    # models_to_target = Σ uploaded bits through the hit / (32 · P · clients selected that round) = 400 / 32
    s = summarize(records, 0.7, num_parameters=1)
    assert s["rounds"] == 5
    assert s["final_accuracy"] == 0.7 and s["best_accuracy"] == 0.75
    assert s["local_steps"] == 25
    assert s["rounds_to_target"] == 4
    assert s["bits_to_target"] == 800
    assert s["models_to_target"] == 400 / 32


def test_summary_without_target_or_records():
    s = summarize(_records(), None, 10)
    assert s["rounds_to_target"] is None and s["models_to_target"] is None and s["bits_to_target"] is None
    empty = summarize([], 0.5, 10)
    assert empty["rounds"] == 0 and empty["final_accuracy"] is None and empty["best_accuracy"] is None


def _timed(records, round_seconds=(3.0, 4.5, 2.0, 6.0, 1.5)):
    """``records`` with the clock of a timed run: each round starts when the previous one ended."""
    clock, timed = 0.0, []
    for record, seconds in zip(records, round_seconds, strict=True):
        timed.append({**record, "time_start": clock, "time_end": clock + seconds})
        clock += seconds
    return timed


def test_timed_summary_gives_the_simulated_time_to_the_target_and_in_all():
    records = _timed(_records())
    s = summarize(records, 0.7, num_parameters=1)
    # round 4 reaches 0.7; it ends at 3 + 4.5 + 2 + 6 = 15.5 s; the run at 17 s
    assert s["time_to_target"] == 15.5 and s["simulated_time"] == 17.0
    assert s["rounds_to_target"] == 4  # the other keys are the untimed run's
    assert {k: v for k, v in s.items() if k not in ("time_to_target", "simulated_time")} == summarize(
        _records(), 0.7, 1
    )
    missed = summarize(records, 0.9, 1)
    assert missed["time_to_target"] is None and missed["simulated_time"] == 17.0
    assert summarize(records, None, 1)["time_to_target"] is None


def test_untimed_summary_has_no_time_keys_and_keeps_its_key_order():
    s = summarize(_records(), 0.7, num_parameters=1)
    assert list(s) == [
        "rounds",
        "final_accuracy",
        "best_accuracy",
        "final_train_loss",
        "local_steps",
        "target_accuracy",
        "rounds_to_target",
        "models_to_target",
        "bits_to_target",
    ]


def test_fedavg_models_to_target_equals_rounds_to_target():
    overrides = ["rounds=6", "data.num_clients=8", "sampling.participation=0.5", "client.steps=5", "client.lr=0.05"]
    base = driftlab.run(None, overrides=overrides)
    accuracies = [r["test_accuracy"] for r in base.records]
    target = sorted(accuracies)[len(accuracies) // 2]  # reached, but not necessarily in round 1
    result = driftlab.run(None, overrides=[*overrides, f"evaluation.target_accuracy={target}"])
    s = result.summary
    expected_round = next(r["round"] for r in result.records if r["test_accuracy"] >= target)
    assert s["rounds_to_target"] == expected_round
    assert s["models_to_target"] == float(expected_round)
    per_round = 32 * result.num_parameters * 4
    assert s["bits_to_target"] == 2 * per_round * expected_round
    assert s["final_accuracy"] == accuracies[-1] and s["best_accuracy"] == max(accuracies)
