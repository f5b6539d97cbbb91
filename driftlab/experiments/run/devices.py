"""Where a run computes: ``config.device``'s devices and ``config.backend``'s training backend.

The devices are one (``cpu``, ``cuda``, ``auto``) or several GPUs (``cuda:0,cuda:1``, the first holding the model); the
backend is the sequential or the vectorized one, ``auto`` choosing by the model and device (docs/performance.md).
"""

from __future__ import annotations

import torch

from driftlab.experiments.config import ConfigError, ExperimentConfig
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import SequentialBackend
from driftlab.simulation.backends.vectorized import VectorizedBackend, auto_backend
from driftlab.simulation.state.memory_budget import MemoryBudget

BACKENDS = {"sequential": SequentialBackend, "vectorized": VectorizedBackend}


def resolve_devices(name: str) -> tuple[torch.device, ...]:
    """The devices of ``config.device``: one, or several GPUs (``cuda:0,cuda:1``), the first holding the model."""
    if name == "auto":
        return (torch.device("cuda" if torch.cuda.is_available() else "cpu"),)
    names = [part.strip() for part in name.split(",")]
    if any(part.startswith("cuda") for part in names):
        if not torch.cuda.is_available():
            raise ConfigError(f"device={name!r} but CUDA is not available on this machine; use device=cpu (or auto)")
        missing = [part for part in names if part.startswith("cuda:") and int(part[5:]) >= torch.cuda.device_count()]
        if missing:
            raise ConfigError(
                f"device={name!r}: this machine has {torch.cuda.device_count()} GPU(s), so {', '.join(missing)} does not exist"
            )
    return tuple(torch.device(part) for part in names)


def resolve_device(name: str) -> torch.device:
    return resolve_devices(name)[0]


def resolve_backend(name: str, model: FlatModel | None = None, device: torch.device | None = None) -> str:
    """``auto`` is the rule of ``vectorized.auto_backend`` for the model and device (docs/performance.md);
    without a model, the vectorized backend."""
    if name != "auto":
        return name
    if model is None or device is None:
        return "vectorized"
    return auto_backend(model, device)


def make_backend(
    config: ExperimentConfig, model: FlatModel, devices: tuple[torch.device, ...], budget: MemoryBudget | None = None
):
    """The config's training backend; the vectorized one sizes its chunks from ``budget`` (the run's ``MemoryBudget``)."""
    # several GPUs: auto is the one backend that spreads a round over them
    name = (
        "vectorized"
        if config.backend == "auto" and len(devices) > 1
        else resolve_backend(config.backend, model, devices[0])
    )
    if len(devices) > 1 and name != "vectorized":
        raise ConfigError(
            f"device={config.device!r} lists several GPUs, which only backend=vectorized uses; set backend=vectorized (or auto)"
        )
    if name == "vectorized":
        several = devices if len(devices) > 1 else None
        return BACKENDS[name](
            precision=config.precision,
            devices=several,
            memory_budget=budget or MemoryBudget(),
            convolution=config.convolution or "grouped",
        )
    return BACKENDS[name](precision=config.precision)
