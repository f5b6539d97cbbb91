"""One memory budget per run: parsed once from ``memory_budget``, shared out to everything that sizes work by memory.

A run holds memory in four places that each need a size:

* the client-state stores (``state.store=auto`` goes to disk when the states
  would exceed the budget; a disk store's row cache takes a sixteenth of it);
* a round's waves (``engine.wave_size``): the clients whose states, objectives
  and messages are alive at once fit ``1 / ROUND_SHARE`` of it;
* the vectorized backend's chunks on a CPU, which work inside that round share;
* the vectorized backend's chunks on a GPU, which take this process's part of
  the GPU's memory.

``MemoryBudget`` is that one object: ``experiments.run.assembly.build_simulation``
makes it (``MemoryBudget.for_run``) from the config's ``memory_budget`` (bytes or
``"4GB"``; None: half of what this process may hold), ``Simulation`` keeps it,
and the stores, the waves and the backend ask it.  ``parse_bytes`` is the one
reader of the setting; the config's validator calls it too.

**Sharing a GPU.**  Several processes on one GPU (a sweep's local executor
running ``jobs`` runs at once) must split its memory: if each took 80% of the
free memory it found at start, two runs started together would each plan for
80%.  So a process's part is ``GPU_FRACTION x total / share``, where ``share``
is the number of processes sharing the device (``DRIFTLAB_GPU_SHARE``, set by
whoever starts them together; 1 when unset), capped by ``GPU_FRACTION x`` the
memory free when the run starts (what other programs already hold is not
ours), less what the run keeps resident there (its data): ``gpu_chunk_bytes``,
a pure function of those numbers.  The shares of ``share`` processes sum to
at most ``GPU_FRACTION`` of the device.  The GPU is measured once, when the
budget is made, so chunk sizes do not change from round to round (on the vmap
path, which clients share a chunk can change the last bits of a result).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from driftlab.errors import ConfigError
from driftlab.memory_limit import machine_memory_bytes

GPU_SHARE_VARIABLE = "DRIFTLAB_GPU_SHARE"
# Of a GPU's memory, the part its processes plan chunks for; the rest is the CUDA context, the caching
# allocator's fragmentation and the estimate's slack (the activation counts are lower bounds).
GPU_FRACTION = 0.8
# A round's waves (and the CPU chunks inside them) fit this share of the budget; the rest is the stores'
# caches and the client states themselves when they are kept in memory.
ROUND_SHARE = 8
# Without a configured budget, waves and CPU chunks fit this much whatever the machine, so a run cuts its rounds
# and chunks the same way on every machine (on the vectorized backend, which clients share a chunk can change the
# last bits).
DEFAULT_ROUND_BYTES = 1 << 30
CACHE_SHARE = 16  # a disk store's row cache: rows of randomly sampled clients are rarely read twice soon
CACHE_CAP = 512 << 20  # ... and the page cache does the rest

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | str) -> int:
    """``4000000``, ``"4GB"`` (10⁹ bytes), ``"1.5GiB"`` (2³⁰ bytes) ... as a byte count; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte count such as 4000000000 or '4GB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"must be a positive number of bytes, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(value))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a byte count such as 4000000000, '4GB', '512MB' or '1.5GiB', got {value!r}")
    count = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if count <= 0:
        raise ValueError(f"must be a positive number of bytes, got {value!r}")
    return count


def gpu_share(environ: Mapping[str, str] | None = None) -> int:
    """How many processes share each GPU: ``DRIFTLAB_GPU_SHARE`` (a whole number >= 1), 1 when unset."""
    environ = os.environ if environ is None else environ
    text = environ.get(GPU_SHARE_VARIABLE)
    if text is None or not text.strip():
        return 1
    if not text.strip().isdigit() or int(text) < 1:
        raise ConfigError(
            f"{GPU_SHARE_VARIABLE}={text!r}: expected how many runs share each GPU, a whole number such as 2 "
            f"(each plans for 1/N of {GPU_FRACTION:.0%} of the GPU's memory); unset it for a run that has the GPU alone"
        )
    return int(text)


def gpu_chunk_bytes(total: int, free: int, share: int = 1, resident: int = 0, fraction: float = GPU_FRACTION) -> int:
    """This process's bytes for chunks in flight on one GPU of ``total`` bytes, ``free`` of them free at the start.

    ``fraction x total / share`` (the ``share`` processes on the GPU together plan
    for at most ``fraction`` of it), capped by ``fraction x free`` (what others held
    before we started is not ours), less ``resident`` (what this process keeps on
    the GPU besides its chunks: the data); at least 0 (then a chunk is one client).
    """
    if share < 1:
        raise ValueError(f"share must be at least 1 process per GPU, got {share}")
    return max(0, int(min(fraction * total / share, fraction * free)) - resident)


def placed_bytes(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> int:
    """Bytes ``tensors`` take once placed for a run of ``dtype``: floating ones cast to it, integer ones as they are
    (``Simulation`` places the data so); what a run keeps resident on its GPU besides the chunks."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() * (size if t.is_floating_point() else t.element_size()) for t in tensors)


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory as measured when the budget was made."""

    device: str  # "cuda:N"
    total: int
    free: int


def gpu_key(device: torch.device) -> str:
    """``cuda:N`` for a CUDA device (``cuda`` alone is the current device)."""
    if device.index is not None:
        return f"cuda:{device.index}"
    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return f"cuda:{index}"


def measure_gpu(device: torch.device) -> GpuMemory:
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(gpu_key(device), int(total), int(free))


@dataclass(frozen=True)
class MemoryBudget:
    """The run's memory, and the part of it each consumer may use (module docstring).

    ``configured``: the config's ``memory_budget`` in bytes; None takes half of
    ``machine_bytes`` (what this process may hold: ``memory_limit.machine_memory_bytes()``,
    asked when needed if not given).  ``gpus``: the GPUs measured at the start,
    ``gpu_share`` processes to each, ``gpu_resident`` bytes of each kept by the
    run besides its chunks.
    """

    configured: int | None = None
    machine_bytes: int | None = None
    gpus: tuple[GpuMemory, ...] = ()
    gpu_share: int = 1
    gpu_resident: int = 0

    def __post_init__(self) -> None:
        if self.configured is not None and self.configured <= 0:
            raise ValueError(f"memory budget must be a positive number of bytes, got {self.configured}")
        if self.gpu_share < 1:
            raise ValueError(f"gpu_share must be at least 1 process per GPU, got {self.gpu_share}")

    @staticmethod
    def for_run(
        memory_budget: int | str | None,
        devices: tuple[torch.device, ...] = (),
        resident_bytes: int = 0,
        environ: Mapping[str, str] | None = None,
    ) -> "MemoryBudget":
        """The budget of a run: ``memory_budget`` parsed (ConfigError naming the key if it is not a byte count),
        the GPUs among ``devices`` measured now, the GPU share read from ``DRIFTLAB_GPU_SHARE``."""
        try:
            configured = parse_bytes(memory_budget) if memory_budget is not None else None
        except ValueError as error:
            raise ConfigError(f"memory_budget: {error}") from None
        gpus = tuple(measure_gpu(d) for d in dict.fromkeys(devices) if d.type == "cuda")
        return MemoryBudget(configured, None, gpus, gpu_share(environ), resident_bytes if gpus else 0)

    @property
    def host_bytes(self) -> int:
        """Bytes of RAM for client states (the ``state.store=auto`` threshold): the configured budget, else half of
        what this process may hold (room for the data, the model and the round besides the states)."""
        if self.configured is not None:
            return self.configured
        return (self.machine_bytes if self.machine_bytes is not None else machine_memory_bytes()) // 2

    @property
    def round_bytes(self) -> int:
        """A wave of a round (its states, objectives and messages), and the CPU chunks in flight within it."""
        return self.configured // ROUND_SHARE if self.configured is not None else DEFAULT_ROUND_BYTES

    def cache_bytes(self, stores: int = 1) -> int:
        """Each of ``stores`` disk stores' row cache."""
        return min(self.host_bytes // CACHE_SHARE, CACHE_CAP) // max(1, stores)

    def chunk_bytes(self, device: torch.device) -> int:
        """Bytes the vectorized backend's chunks in flight on ``device`` may use: ``round_bytes`` on a CPU, this
        process's part of a GPU (``gpu_chunk_bytes``, measured now if the budget did not measure it)."""
        if device.type != "cuda":
            return self.round_bytes
        key = gpu_key(device)
        gpu = next((g for g in self.gpus if g.device == key), None) or measure_gpu(device)
        return gpu_chunk_bytes(gpu.total, gpu.free, self.gpu_share, self.gpu_resident)


__all__ = [
    "GPU_FRACTION",
    "GPU_SHARE_VARIABLE",
    "GpuMemory",
    "MemoryBudget",
    "gpu_chunk_bytes",
    "gpu_share",
    "parse_bytes",
    "placed_bytes",
]
