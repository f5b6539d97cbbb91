"""Which GPUs a sweep's runs get: how many a run's ``device`` asks for, where the local executor places each run, and
the environment that hands a run its GPUs.

A run's worker sees exactly the GPUs its executor gives it (``CUDA_VISIBLE_DEVICES``, set here for local runs, by
Ray for its tasks and by SLURM for its jobs), so inside the run they are numbered from 0: the config's device is
handed to the worker in that numbering (``renumbered``), and what the run calls ``cuda`` is its own GPU, never
every run's first one.

What a ``device`` asks for (``GpuRequest``):

* ``cpu``: no GPU.  ``cuda``: one GPU, any.  ``auto``: one GPU where the sweep has any, else the CPU.
* a list ``cuda:0,cuda:1``: as many GPUs as it names, any (a config has no other way to ask for two GPUs,
  and a sweep of two-GPU runs on an eight-GPU box should not pile onto the first two).
* ``cuda:N``: the sweep's GPU N, where the local executor keeps it (a user who names one GPU means that one:
  the others may be someone else's).  Ray and SLURM choose the GPU themselves: it is one GPU there.

Local placement (``place``) is deterministic: a run keeps the GPUs its ``run.json`` records when it is resumed (so
a mixed box computes its rounds on one model of GPU), pinned runs stay on their GPU, and every other run goes, in the
sweep's order, to the GPUs with the fewest runs placed so far, lowest position in ``--gpus`` first: single-GPU runs
on GPUs [0, 1] go 0, 1, 0, 1, 0 (round-robin).  Free memory is not consulted: it changes from one invocation to
the next, and so would the placement and each run's share of its GPU.

Runs placed on one GPU split its memory: each is told how many runs may share its GPU at once (``DRIFTLAB_GPU_SHARE``,
read by the run's memory budget, ``driftlab.simulation.state.memory_budget``), counted per GPU: the runs on GPU 0
split GPU 0, whatever runs on GPU 1.  The local executor starts at most ``ceil(jobs / GPUs)`` runs on a GPU at
once (``gpu_slots``, ``next_to_start``), so that bound, not ``jobs``, is the share of a GPU that holds more runs:
a sweep of 40 runs in 16 processes on 4 GPUs has each run plan for a quarter of its GPU, not a tenth.

Importing this module imports no torch; ``visible_gpus`` asks torch when called.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from driftlab.errors import ConfigError

# Named here rather than imported: the memory budget's module imports torch, which an executor does not need.
GPU_SHARE_VARIABLE = "DRIFTLAB_GPU_SHARE"
VISIBLE_VARIABLE = "CUDA_VISIBLE_DEVICES"
PLACEMENT_KEY = "placement"  # run.json's entry: the GPUs the local executor gave the run (``worker`` writes it)


@dataclass(frozen=True)
class GpuRequest:
    """What a run's device asks of its executor: ``count`` GPUs; ``pinned``: the sweep's GPU it names (``cuda:N``);
    ``optional``: ``auto``, which runs on the CPU when the sweep has no GPU."""

    count: int = 0
    pinned: int | None = None
    optional: bool = False

    @property
    def device(self) -> str:
        """A device that asks for this, for messages: ``cuda:2``, ``auto``, ``cuda``, ``cuda:0,cuda:1``."""
        if self.pinned is not None:
            return f"cuda:{self.pinned}"
        if self.count <= 1:
            return ("auto" if self.optional else "cuda") if self.count else "cpu"
        return ",".join(f"cuda:{index}" for index in range(self.count))


def gpu_request(config: Mapping[str, Any]) -> GpuRequest:
    """What ``config["device"]`` asks for (see the module's docstring); the config has already been validated."""
    device = str(config.get("device", "cpu")).strip()
    if device == "cpu":
        return GpuRequest()
    if device == "cuda":
        return GpuRequest(1)
    if device == "auto":
        return GpuRequest(1, optional=True)
    names = [part.strip() for part in device.split(",")]
    if len(names) == 1:
        return GpuRequest(1, pinned=int(names[0].removeprefix("cuda:")))
    return GpuRequest(len(names))


def renumbered(config: dict[str, Any], count: int) -> dict[str, Any]:
    """``config`` with its device in the numbering of a worker that sees ``count`` GPUs, its own, from 0.

    ``cuda`` and ``auto`` stay; ``cuda:N`` becomes ``cuda:0`` and a list of k GPUs ``cuda:0,...,cuda:k-1``. The device
    is outside the run's identity (``ExperimentConfig.fingerprint``): the run resumes whatever its GPUs are numbered.
    """
    device = str(config.get("device", "cpu")).strip()
    if count == 0 or device in ("cpu", "cuda", "auto"):
        return config
    own = ",".join(f"cuda:{index}" for index in range(count))
    return config if device == own else {**config, "device": own}


def parse_gpus(value: Any) -> tuple[int, ...] | None:
    """``--gpus``: None or ``all`` for every visible GPU; ``none`` (or empty) for none; ``0,2`` (or ``[0, 2]``) for those.

    The indices are torch's for the GPUs this process sees (``CUDA_VISIBLE_DEVICES`` applies first), as in ``cuda:N``.
    """
    if value is None:
        return None
    words: Sequence[Any]
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return None
        words = [] if text in ("", "none") else [word.strip() for word in text.split(",")]
    elif isinstance(value, (list, tuple)):
        words = list(value)
    else:
        words = [value]
    indices = []
    for word in words:
        if isinstance(word, bool) or not (isinstance(word, int) or (isinstance(word, str) and word.isdigit())):
            raise ConfigError(
                f"--gpus {_shown(value)}: expected GPU indices such as 0,2 (torch's numbering of the visible GPUs), "
                "all (the default), or none for CPU-only runs"
            )
        indices.append(int(word))
    repeated = sorted({index for index in indices if indices.count(index) > 1})
    if repeated:
        raise ConfigError(
            f"--gpus {_shown(value)} names GPU {', '.join(map(str, repeated))} more than once; name each GPU once"
        )
    return tuple(indices)


def _shown(value: Any) -> str:
    """``--gpus`` as the user wrote it, or as a list given to ``LocalOptions`` would have been written."""
    if isinstance(value, str):
        return value
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else repr(value)


def visible_gpus(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The GPUs this process sees, as its children's ``CUDA_VISIBLE_DEVICES`` names them, in torch's order.

    Their number is torch's (``torch.cuda.device_count()``: 0 without CUDA); their names the entries of this process's
    own ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs; CUDA stops at the first it cannot use), else ``0, 1, ...``.
    """
    import torch

    count = torch.cuda.device_count()
    inherited = environ.get(VISIBLE_VARIABLE)
    if inherited is None:
        return tuple(str(index) for index in range(count))
    return tuple(entry.strip() for entry in inherited.split(","))[:count]


def check_gpus(value: Any, visible: Callable[[], tuple[str, ...]] = visible_gpus) -> tuple[int, ...] | None:
    """``parse_gpus``, and a ConfigError for an index this machine does not have (``visible`` asked only then)."""
    gpus = parse_gpus(value)
    if gpus:
        count = len(visible())
        missing = [index for index in gpus if index >= count]
        if missing:
            has = f"{count} GPU(s), numbered 0-{count - 1}" if count else "no GPU torch can use"
            raise ConfigError(
                f"--gpus {_shown(value)}: this machine shows {has}, so GPU {', '.join(map(str, missing))} does not exist"
            )
    return gpus


def sweep_gpus(value: Any, visible: tuple[str, ...]) -> tuple[int, ...]:
    """The GPUs a sweep may place runs on: ``--gpus`` (``value``), default every one of ``visible``."""
    gpus = check_gpus(value, lambda: visible)
    return tuple(range(len(visible))) if gpus is None else gpus


def recorded_gpus(info: Mapping[str, Any] | None, visible: tuple[str, ...]) -> tuple[int, ...] | None:
    """The GPUs a run's ``run.json`` (``info``) says the local executor gave it, as indices into ``visible``; None
    when it says none or names one this sweep does not see (it was found by its name: ``CUDA_VISIBLE_DEVICES`` may differ)."""
    placement = info.get(PLACEMENT_KEY) if isinstance(info, Mapping) else None
    names = placement.get("cuda_visible_devices") if isinstance(placement, Mapping) else None
    if not isinstance(names, str) or not names:
        return None
    found = [visible.index(name) for name in names.split(",") if name in visible]
    return tuple(found) if len(found) == len(names.split(",")) else None


def place(
    requests: Sequence[GpuRequest],
    gpus: tuple[int, ...],
    recorded: Sequence[tuple[int, ...] | None] = (),
    labels: Sequence[str] = (),
    why_none: str = "this machine shows no GPU torch can use",
) -> list[tuple[int, ...]]:
    """The GPUs (indices of the sweep's visible GPUs) of each run, in order; () for a run on the CPU.

    ``gpus``: those runs may be placed on (``--gpus``), in order; ``recorded[i]``: the GPUs run i had when it last ran
    (kept when they still fit its request); ``labels`` name the runs in errors; ``why_none`` says why ``gpus`` is empty.
    """
    recorded = list(recorded) + [None] * (len(requests) - len(recorded))
    labels = list(labels) + [f"run {index + 1}" for index in range(len(labels), len(requests))]
    placed: list[tuple[int, ...] | None] = [None] * len(requests)
    load = {gpu: 0 for gpu in gpus}
    for index, request in enumerate(requests):  # first the runs whose GPUs are known: pinned, or resumed where they ran
        if request.count == 0 or (request.optional and not gpus):
            placed[index] = ()
            continue
        if not gpus:
            raise ConfigError(
                f"{labels[index]} asks for a GPU (device={request.device}), but {why_none}; "
                "set device=cpu, or auto (a GPU where there is one)"
            )
        if request.count > len(gpus):
            raise ConfigError(
                f"{labels[index]} asks for {request.count} GPUs (device={request.device}), but the sweep has "
                f"{len(gpus)} (--gpus {','.join(map(str, gpus))}); list fewer devices, or give it more GPUs with --gpus"
            )
        if request.pinned is not None:
            if request.pinned not in load:
                raise ConfigError(
                    f"{labels[index]} names GPU {request.pinned} (device=cuda:{request.pinned}), which --gpus "
                    f"{','.join(map(str, gpus))} leaves out; set device=cuda to let the sweep place it, or add {request.pinned} to --gpus"
                )
            placed[index] = (request.pinned,)
        elif (
            recorded[index] is not None
            and len(recorded[index]) == request.count
            and all(g in load for g in recorded[index])
        ):
            placed[index] = tuple(recorded[index])
        for gpu in placed[index] or ():
            load[gpu] += 1
    position = {gpu: rank for rank, gpu in enumerate(gpus)}
    for index, request in enumerate(requests):  # then the others, in the sweep's order, on the least loaded GPUs
        if placed[index] is None:
            chosen = sorted(gpus, key=lambda gpu: (load[gpu], position[gpu]))[: request.count]
            placed[index] = tuple(sorted(chosen, key=position.__getitem__))
            for gpu in chosen:
                load[gpu] += 1
    return [p for p in placed if p is not None]


def gpu_slots(placements: Sequence[tuple[int, ...]], jobs: int) -> int:
    """How many runs may be on one GPU at once: the ``jobs`` runs going at once spread evenly over the GPUs that hold
    runs, ``ceil(jobs / GPUs)``. The local executor keeps to it (``next_to_start``), so each run can plan for that
    share of its GPU however its neighbours' lengths make the runs interleave."""
    used = {gpu for placement in placements for gpu in placement}
    return max(1, -(-jobs // len(used))) if used else jobs


def gpu_shares(placements: Sequence[tuple[int, ...]], jobs: int) -> dict[int, int]:
    """For each GPU, how many of the runs placed on it can run at once: ``min(gpu_slots, runs placed on it)``."""
    slots = gpu_slots(placements, jobs)
    counts: dict[int, int] = {}
    for placement in placements:
        for gpu in placement:
            counts[gpu] = counts.get(gpu, 0) + 1
    return {gpu: min(slots, count) for gpu, count in counts.items()}


def next_to_start(waiting: Sequence[tuple[int, ...]], busy: Mapping[int, int], slots: int) -> int | None:
    """Which waiting run (by its GPUs, in the sweep's order) starts next: the first whose GPUs each have fewer than
    ``slots`` runs (``busy``), and none of which an earlier waiting run is waiting for (so a run on two GPUs is not
    overtaken for ever by runs on one of them); a CPU run at once. None: every waiting run waits."""
    blocked: set[int] = set()
    for index, gpus in enumerate(waiting):
        if not blocked.intersection(gpus) and all(busy.get(gpu, 0) < slots for gpu in gpus):
            return index
        blocked.update(gpus)
    return None


def share_environment(share: int, inherited: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``DRIFTLAB_GPU_SHARE`` for a run that shares its GPU with ``share - 1`` others ({} when it has it alone).

    A share already set for this sweep (two sweeps on one GPU, each told 2) is multiplied: the runs of both split it.
    """
    if share <= 1:
        return {}
    outer = inherited.get(GPU_SHARE_VARIABLE, "").strip()
    return {GPU_SHARE_VARIABLE: str(share * (int(outer) if outer.isdigit() and int(outer) > 0 else 1))}


def gpu_environment(
    placement: tuple[int, ...],
    request: GpuRequest,
    visible: tuple[str, ...],
    shares: Mapping[int, int],
    inherited: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """The variables a local run's worker gets: its GPUs (``CUDA_VISIBLE_DEVICES``) and its share of the most shared.

    A CPU run is left alone, except ``auto`` on a sweep without GPUs, which is shown none so that it runs on the CPU.
    """
    if not placement:
        return {VISIBLE_VARIABLE: ""} if request.optional else {}
    share = max(shares.get(gpu, 1) for gpu in placement)
    return {VISIBLE_VARIABLE: ",".join(visible[gpu] for gpu in placement), **share_environment(share, inherited)}


__all__ = [
    "GPU_SHARE_VARIABLE",
    "PLACEMENT_KEY",
    "VISIBLE_VARIABLE",
    "GpuRequest",
    "check_gpus",
    "gpu_environment",
    "gpu_request",
    "next_to_start",
    "gpu_shares",
    "gpu_slots",
    "parse_gpus",
    "place",
    "recorded_gpus",
    "renumbered",
    "share_environment",
    "sweep_gpus",
    "visible_gpus",
]
