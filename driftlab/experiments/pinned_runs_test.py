"""Short runs of every algorithm, with and without compression, on both backends, pinned to stored digests.

A refactor must prove it changed nothing: each case below is a 3-round run whose
final server model and per-round metrics (wall times aside) hash to the digests in
``pinned_runs.json``.  The runs are float64 on one thread, so the digests hold for a
fixed machine and torch build (bit-for-bit repeatability is promised for a fixed
thread count and device layout, not across CPUs): MKL picks its kernels by CPU vendor
and instruction set, and the same code gives other last bits on an AMD and an Intel
AVX-512 machine.  So the digests are stored per machine (``machine_key``: CPU vendor,
torch's CPU capability and torch version), and a machine without digests fails with
how to record them.

A change that is *meant* to change results updates the digests of the machine it runs
on, and the commit says why:

    DRIFTLAB_UPDATE_PINS=1 python -m pytest -q driftlab/experiments/pinned_runs_test.py

A new machine records its digests from a commit whose numbers are trusted (the last
one that passed elsewhere), never from the change under test:

    git worktree add /tmp/pins <trusted commit> && cp driftlab/experiments/pinned_runs_test.py /tmp/pins/driftlab/experiments/
    cd /tmp/pins && DRIFTLAB_UPDATE_PINS=1 python -m pytest -q driftlab/experiments/pinned_runs_test.py
    # then copy /tmp/pins/driftlab/experiments/pinned_runs.json back and commit it, naming the commit
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import pytest
import torch

import driftlab
from driftlab.experiments.run_directory import cpu_info

PINS = Path(__file__).with_name("pinned_runs.json")
BASE = [
    "rounds=3", "seed=0", "precision=float64", "data.name=synthetic", "data.num_clients=8", "sampling.participation=0.5",
    "model.name=mlp", "model.hidden=[8]", "client.epochs=1", "client.batch_size=10", "client.lr=0.05",
]
CASES: dict[str, list[str]] = {
    "fedavg": ["algorithm.name=fedavg"],
    "fedadam": ["algorithm.name=fedavg", "server.optimizer=adam", "server.lr=0.03"],
    "fedavgm": ["algorithm.name=fedavg", "server.optimizer=momentum", "server.lr=0.5"],
    "fedprox": ["algorithm.name=fedprox", "algorithm.mu=0.1"],
    "scaffold": ["algorithm.name=scaffold"],
    "feddyn": ["algorithm.name=feddyn", "algorithm.alpha=0.01", "evaluation.model=all_clients_mean"],
    "adabest": ["algorithm.name=adabest", "algorithm.mu=0.02", "algorithm.beta=0.9"],
    "efl": ["algorithm.name=efl"],
    "fedavg-compressed": ["algorithm.name=fedavg", "compression.ratio=0.1"],
    "scaffold-compressed-stragglers": ["algorithm.name=scaffold", "compression.ratio=0.2", "availability.incomplete_probability=0.5"],
}
BACKENDS = ("sequential", "vectorized")


def run_digests(case: str, backend: str) -> dict[str, str]:
    """The sha256 of the final model's bytes and of the metrics (every key but round_seconds, exact float repr)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = driftlab.run(None, overrides=[*BASE, *CASES[case], f"backend={backend}"])
    finally:
        torch.set_num_threads(threads)
    model = result.final_params.detach().to("cpu", torch.float64).contiguous().numpy().tobytes()
    records = [{key: value for key, value in record.items() if key != "round_seconds"} for record in result.records]
    metrics = json.dumps(records, sort_keys=True, allow_nan=False).encode()
    return {"final_model": hashlib.sha256(model).hexdigest(), "metrics": hashlib.sha256(metrics).hexdigest()}


def machine_key() -> str:
    """What decides the last bits of a float64 CPU run besides driftlab: vendor, instruction set, torch build."""
    vendor = cpu_info("vendor_id") or platform.machine() or "unknown"
    return f"{vendor}, {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}"


@pytest.fixture(scope="module")
def pins() -> dict[str, dict[str, str]]:
    stored = json.loads(PINS.read_text()) if PINS.exists() else {}
    machine = stored.setdefault(machine_key(), {})
    yield machine
    if os.environ.get("DRIFTLAB_UPDATE_PINS"):
        stored[machine_key()] = dict(sorted(machine.items()))
        PINS.write_text(json.dumps(dict(sorted(stored.items())), indent=1) + "\n")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_short_run_matches_its_pinned_digests(case, backend, pins):
    key = f"{case}/{backend}"
    digests = run_digests(case, backend)
    if os.environ.get("DRIFTLAB_UPDATE_PINS"):
        pins[key] = digests
        return
    assert pins, (
        f"no pinned digests for this machine ({machine_key()}); record them from a trusted commit as this module's docstring says"
    )
    assert key in pins, f"no pinned digests for {key}; add them with DRIFTLAB_UPDATE_PINS=1"
    assert digests == pins[key], f"{key} no longer gives the pinned final model and metrics on {machine_key()}"


def test_every_case_is_pinned_and_nothing_else():
    expected = {f"{case}/{backend}" for case in CASES for backend in BACKENDS}
    stored = json.loads(PINS.read_text())
    assert stored and all(set(digests) == expected for digests in stored.values())


def test_the_digest_sees_a_one_ulp_change_of_the_model(monkeypatch):
    """The pin is bit-exact: nudging one weight by one ulp changes the model digest."""
    original = driftlab.run

    def nudged(*args, **kwargs):
        result = original(*args, **kwargs)
        result.final_params = result.final_params.clone()
        result.final_params[0] = torch.nextafter(result.final_params[0], torch.tensor(float("inf"), dtype=result.final_params.dtype))
        return result

    plain = run_digests("fedavg", "sequential")
    monkeypatch.setattr(driftlab, "run", nudged)
    changed = run_digests("fedavg", "sequential")
    assert changed["final_model"] != plain["final_model"] and changed["metrics"] == plain["metrics"]
