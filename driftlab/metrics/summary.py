"""Reading a run's per-round records the way the papers report them.

Timed runs (a ``[system]`` section: ``driftlab.simulation.time``) record each round's simulated
``time_start`` and ``time_end`` in seconds; their summaries also give the simulated time to reach a
target (FedBuff, Nguyen et al. 2022, compares methods by it) and the whole run's. Untimed runs'
summaries have neither key.
"""

from __future__ import annotations

from typing import Any, Sequence

from driftlab.metrics.communication import BITS_PER_ENTRY


def evaluated(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of evaluation rounds of a classifier (those with a test accuracy)."""
    return [r for r in records if "test_accuracy" in r]


def last_value(records: Sequence[dict[str, Any]], key: str) -> Any:
    """The last recorded value of ``key`` (None if never recorded)."""
    for record in reversed(records):
        if key in record:
            return record[key]
    return None


def first_round_reaching(records: Sequence[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first evaluated record with ``test_accuracy >= target`` (None if never)."""
    for record in evaluated(records):
        if record["test_accuracy"] >= target:
            return record
    return None


def cumulative_bits_through(records: Sequence[dict[str, Any]], round_index: int) -> tuple[int, int]:
    """Upload and download bits summed over rounds ``1..round_index``."""
    upload = sum(r["upload_bits"] for r in records if r["round"] <= round_index)
    download = sum(r["download_bits"] for r in records if r["round"] <= round_index)
    return upload, download


def model_equivalents_through(records: Sequence[dict[str, Any]], round_index: int, num_parameters: int) -> float:
    """Uploads over rounds ``1..round_index`` in uncompressed models per selected client (FedDyn Tables 1, 2):
    ``Σ_t upload_bits_t / (32 · P · |S_t|)``, so one FedAvg round is 1 and one SCAFFOLD round 2."""
    return sum(
        r["upload_bits"] / (BITS_PER_ENTRY * num_parameters * max(r["num_selected"], 1))
        for r in records
        if r["round"] <= round_index
    )


def simulated_time(records: Sequence[dict[str, Any]]) -> float | None:
    """The simulated seconds at the end of the last timed round (``time_end``); None for an untimed run."""
    end = last_value(records, "time_end")
    return None if end is None else float(end)


def summarize(records: Sequence[dict[str, Any]], target: float | None, num_parameters: int) -> dict[str, Any]:
    """Final and best accuracy; rounds, uploaded model-equivalents and bits to reach ``target``.

    Model-equivalents count each round's upload in uncompressed models per
    selected client, so one FedAvg round counts 1 and one SCAFFOLD round 2
    (FedDyn Tables 1 and 2); compressed uploads count their exact bits.

    A timed run's summary adds ``simulated_time`` (the last round's ``time_end``) and
    ``time_to_target``, the ``time_end`` of the round that reached ``target``
    (None when not reached): ``t_target = time_end(hit)``. An untimed run's has neither key.
    """
    scored = evaluated(records)
    summary: dict[str, Any] = {
        "rounds": records[-1]["round"] if records else 0,
        "final_accuracy": scored[-1]["test_accuracy"] if scored else None,
        "best_accuracy": max((r["test_accuracy"] for r in scored), default=None),
        "final_train_loss": last_value(records, "train_loss"),
        "local_steps": sum(r["local_steps"] for r in records),
        "target_accuracy": target,
        "rounds_to_target": None,
        "models_to_target": None,
        "bits_to_target": None,
    }
    total_time = simulated_time(records)
    if total_time is not None:
        summary["simulated_time"] = total_time
        summary["time_to_target"] = None
    distance = last_value(records, "distance_to_minimizer")
    if distance is not None:
        summary["final_distance_to_minimizer"] = distance
    if target is not None:
        hit = first_round_reaching(records, target)
        if hit is not None:
            upload, download = cumulative_bits_through(records, hit["round"])
            summary["rounds_to_target"] = hit["round"]
            summary["models_to_target"] = model_equivalents_through(records, hit["round"], num_parameters)
            summary["bits_to_target"] = upload + download
            if total_time is not None and "time_end" in hit:
                summary["time_to_target"] = float(hit["time_end"])
    return summary
