"""What a benchmark ran on, and what it cost: the machine and device descriptions every report starts with, the
process's resident memory, and the fp32 matmul throughput the rounds' FLOP rates are compared with."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
import time
from typing import Any

import torch


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def current_rss_mb() -> float:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return peak_rss_mb()


def peak_rss_mb() -> float:
    """This process's RSS high-water mark.

    Linux's ``VmHWM`` belongs to the address space, which ``exec`` replaces;
    ``ru_maxrss`` would not do for a subprocess, as Linux carries it over from
    the parent across ``fork``/``exec``.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def matmul_gflops(size: int = 4096, repeats: int = 5, device: str = "cpu") -> float:
    """The best of ``repeats`` fp32 ``torch.mm`` of two ``size x size`` matrices on ``device``, in GFLOP/s (2·n³ FLOPs each).

    On CUDA this is true fp32 unless the process allowed TF32 (``torch.backends.cuda.matmul.allow_tf32``, off by default).
    """
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    torch.mm(a, b)  # warm-up: thread pool, page faults, CUDA context and kernels
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


def cpu_model_name() -> str:
    model_name = platform.processor()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                model_name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return model_name


def machine_description() -> dict[str, Any]:
    return {
        "cpu": cpu_model_name(),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def device_description(device: str) -> dict[str, Any]:
    """What the rows ran on: the CPU's model and threads, or the GPU's name, memory and CUDA version."""
    if device.startswith("cuda"):
        properties = torch.cuda.get_device_properties(torch.device(device))
        return {
            "type": "cuda",
            "name": properties.name,
            "memory_gib": round(properties.total_memory / 2**30, 1),
            "compute_capability": f"{properties.major}.{properties.minor}",
            "cuda": torch.version.cuda,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            # PyTorch's default (True) lets cuDNN use TF32 in convolutions: the reference loop runs with it, as the
            # authors' code would; driftlab's float32 rows turn it off (precision.local_arithmetic)
            "tf32_cudnn_reference": torch.backends.cudnn.allow_tf32,
            "description": f"{properties.name} ({properties.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda})",
        }
    name, threads = cpu_model_name(), torch.get_num_threads()
    return {
        "type": "cpu",
        "name": name,
        "threads": threads,
        "logical_cpus": os.cpu_count(),
        "description": f"{name}, {threads} torch threads of {os.cpu_count()} logical CPUs",
    }


def report_head(device: str, data_kind: str) -> dict[str, Any]:
    """The first fields of every benchmark's report: the machine, the device and the data."""
    return {"machine": machine_description(), "device": device_description(device), "data": data_kind}
