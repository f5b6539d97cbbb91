"""A resumed run's segments: what each process that ran its rounds ran them with, and a warning when a resume
changes something that can change the numbers.

A run's identity (``ExperimentConfig.fingerprint``) leaves out the settings that say where and how it
computes, so that a run can be resumed on another machine, with another budget or with logging turned on.
Some of them cannot change a single bit, and ``segments_test.py`` proves it by changing them between an
interruption and its resume and comparing the bytes with an uninterrupted run's: ``state.store`` (memory and
disk stores hold the same rows), ``checkpoint_every`` and ``keep_checkpoint``; ``log`` only hands the records
to trackers.  The others can, and a resume that changes one is warned about (``ResumeChangeWarning``), naming
the key, the old and the new value and what it changes:

* ``device`` (and the backend ``backend=auto`` resolves to on it): every kernel is the device's own.
* torch's intra-op threads, on a CPU: a multithreaded kernel splits its sums by thread count.  The
  sequential backend trains every client on one thread (``local_training.single_threaded_clients``), and
  the vectorized backend its chunks one thread each when several are in flight; but a chunk alone in
  flight (a wave or round of one client: ``local_training.map_on_threads`` with one worker) and the
  evaluation run on all of torch's threads.  Measured on the
  2-core machine this was written on: an MLP run trained one client at a time (memory_budget=1MB), resumed
  at round 3 of 6 with 2 threads instead of 1, ended 3e-8 away from the uninterrupted run; resumed with 1,
  or with 2 threads and the default budget (chunks of several clients, one thread each), bit for bit on it.
* ``memory_budget``: it sizes a round's waves and, on a CPU, the vectorized backend's chunks
  (``MemoryBudget.round_bytes``), and on a GPU the chunks get this process's part of the GPU's memory as
  measured at the start (``MemoryBudget.chunk_bytes``, which also depends on ``DRIFTLAB_GPU_SHARE``).  Which
  clients share a chunk can change the last bits on the ``vmap`` path, and a wave of one client runs on all
  threads (above: with 2 threads, that run's budget alone moved its last bits).  What is compared is what the
  budget gives, not the key: a budget changed from none to "8GiB" gives the same 1 GiB waves and no warning.

A resume still goes on: moving a run to a GPU node, or giving it more threads, is legitimate; the warning
and run.json say that its last bits may differ from an uninterrupted run's.

run.json's ``"segments"`` lists, oldest first, the segments whose rounds the run's results hold: each with
``"rounds": [first, last]`` (``last`` is ``first - 1`` until its first round is done) and the settings it ran
with, and ``"changed"``, the warnings its resume gave.  A segment whose rounds were all recomputed (it was
stopped before its next checkpoint) is dropped, as is every segment when a run starts again from round 0.
A run.json written before segments existed gives its one segment from its ``"machine"`` entry and the
``memory_budget`` of the config.json beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from driftlab.errors import ConfigError
from driftlab.experiments.run.run_directory import CONFIG_FILE, read_run_info
from driftlab.simulation.round.setup import disk_stores, wave_size
from driftlab.simulation.state.memory_budget import MemoryBudget

SEGMENTS_KEY = "segments"


class ResumeChangeWarning(UserWarning):
    """A resume runs with a setting outside the run's identity that can change its last bits (``driftlab.experiments.run.segments``)."""


def read_before(out: Path) -> dict[str, Any]:
    """What a resume compares with, read before anything is rewritten: the stopped run's run.json and the
    ``memory_budget`` of its config.json (for a run.json without segments)."""
    info = read_run_info(out) or {}
    try:
        stored = json.loads((out / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        stored = {}
    return {
        "info": info if isinstance(info, dict) else {},
        "memory_budget": stored.get("memory_budget") if isinstance(stored, dict) else None,
    }


def kept_segments(before: dict[str, Any] | None, start_round: int) -> list[dict[str, Any]]:
    """The earlier segments whose rounds a run resumed at ``start_round`` keeps, their last rounds cut to it."""
    if before is None or start_round == 0:
        return []  # a new run, or one started again from round 0: nothing earlier is in its results
    info = before["info"]
    segments = info.get(SEGMENTS_KEY)
    if not isinstance(segments, list):
        segments = [_legacy_segment(info, before.get("memory_budget"), start_round)]
    kept = []
    for segment in segments:
        if not isinstance(segment, dict) or not _is_range(segment.get("rounds")):
            continue
        first, last = segment["rounds"]
        last = min(last, start_round)  # the rounds after the checkpoint are computed again, by the new segment
        if first <= start_round:
            kept.append({**segment, "rounds": [first, last]})
    if kept:
        # The last segment that began by then wrote the checkpoint, even if a kill came before run.json said so.
        kept[-1]["rounds"][1] = start_round
    return kept


def _is_range(rounds: Any) -> bool:
    return (
        isinstance(rounds, list)
        and len(rounds) == 2
        and all(isinstance(r, int) and not isinstance(r, bool) for r in rounds)
    )


def _legacy_segment(info: dict[str, Any], memory_budget: Any, start_round: int) -> dict[str, Any]:
    """The one segment a run.json without segments describes: what its "machine" entry and config.json recorded."""
    machine = info.get("machine") if isinstance(info.get("machine"), dict) else {}
    segment: dict[str, Any] = {"rounds": [1, start_round]}
    for key, name in (("torch_threads", "torch_threads"), ("device", "device"), ("backend", "backend")):
        if machine.get(name) is not None:
            segment[key] = machine[name]
    try:
        segment["round_bytes"] = MemoryBudget.for_run(memory_budget).round_bytes  # no devices: nothing measured
        segment["memory_budget"] = memory_budget
    except (ConfigError, ValueError, TypeError):
        pass  # an unreadable budget: nothing to compare
    return segment


def current_segment(config: Any, sim: Any, state: Any, start_round: int) -> dict[str, Any]:
    """The settings this process runs rounds ``start_round + 1 ...`` with."""
    import driftlab

    backend = sim.backend
    devices = getattr(backend, "devices", None) or (sim.device,)
    segment: dict[str, Any] = {
        "rounds": [start_round + 1, start_round],
        "torch_threads": torch.get_num_threads(),
        "device": ",".join(str(d) for d in devices),
        "backend": getattr(backend, "name", type(backend).__name__),
        "memory_budget": config.memory_budget,
        "round_bytes": sim.memory_budget.round_bytes,
    }
    budget_bytes = getattr(backend, "budget_bytes", None)
    if callable(budget_bytes) and any(d.type != "cpu" for d in devices):
        # On a CPU the chunks take round_bytes; on a GPU this process's part of its memory, measured at the start.
        segment["chunk_bytes"] = {str(d): int(budget_bytes(d)) for d in devices}
    client_state_init = getattr(sim.algorithm, "client_state_init", None)
    segment["wave_size"] = wave_size(sim, client_state_init(sim.initial_params) if client_state_init else None)
    segment["state_store"] = "disk" if disk_stores(state) else "memory"
    segment["versions"] = {"driftlab": driftlab.__version__, "torch": torch.__version__}
    return segment


def changes(previous: dict[str, Any] | None, current: dict[str, Any], out: Path) -> list[str]:
    """One message per setting ``current`` changes from ``previous`` (the segment that wrote the checkpoint) in a way
    that can change the last bits; [] when nothing such changed or nothing is known of ``previous``."""
    if previous is None:
        return []
    done = previous["rounds"][1]
    where = f"resuming {out} at round {done}"
    tail = "the last bits of the result may differ from an uninterrupted run's (run.json lists each segment's settings)"

    def known(key: str) -> bool:
        return previous.get(key) is not None and current.get(key) is not None

    messages = []
    if known("device") and previous["device"] != current["device"]:
        messages.append(
            f"{where} with device={current['device']}, where rounds up to it ran on {previous['device']}: the device computes "
            f"every operation with its own kernels; {tail}"
        )
    elif known("backend") and previous["backend"] != current["backend"]:
        messages.append(
            f"{where} on the {current['backend']} backend, where rounds up to it ran on the {previous['backend']} backend "
            f"(backend=auto resolved otherwise): the clients are trained by other code; {tail}"
        )
    cpu = not str(current.get("device", "cpu")).startswith("cuda")
    if cpu and known("torch_threads") and previous["torch_threads"] != current["torch_threads"]:
        messages.append(
            f"{where} with {current['torch_threads']} torch threads, where rounds up to it ran with {previous['torch_threads']}: "
            "on a CPU the thread count changes how multithreaded kernels split their sums (the vectorized backend's chunk when it "
            f"is the only one in flight, as in a wave of one client; evaluation); {tail}"
        )
    budget_changes = [
        f"{what} {_bytes(current[key])}, not {_bytes(previous[key])}"
        for key, what in (("round_bytes", "waves and CPU chunks fit"), ("chunk_bytes", "GPU chunks fit"))
        if known(key) and previous[key] != current[key]
    ]
    if budget_changes:
        messages.append(
            f"{where} with memory_budget={_shown(current.get('memory_budget'))}, where rounds up to it ran with "
            f"memory_budget={_shown(previous.get('memory_budget'))} ({'; '.join(budget_changes)}): the budget sizes a round's "
            f"waves and the vectorized backend's chunks, which decide the clients trained together and on how many threads; {tail}"
        )
    return messages


def _shown(budget: Any) -> str:
    return "none" if budget is None else json.dumps(budget)


def _bytes(sizes: Any) -> str:
    """``1073741824 bytes``, or per GPU ``cuda:0 30000000000 bytes``."""
    if isinstance(sizes, dict):
        return ", ".join(f"{device} {count} bytes" for device, count in sizes.items())
    return f"{sizes} bytes"


__all__ = ["ResumeChangeWarning", "SEGMENTS_KEY", "changes", "current_segment", "kept_segments", "read_before"]
