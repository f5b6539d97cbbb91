"""How much memory this process may really allocate: the tightest of the machine's and the process's limits.

Physical memory is only one ceiling.  A process can be held lower by its
address-space or data-segment limit (``ulimit -v`` / ``ulimit -d``:
``RLIMIT_AS``, ``RLIMIT_DATA``), by its cgroup (a container or a systemd
slice: cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``, of its own
cgroup and every ancestor) and by a SLURM job's allocation
(``SLURM_MEM_PER_NODE``, or ``SLURM_MEM_PER_CPU`` x ``SLURM_CPUS_ON_NODE``, in
MiB).  Size checks that compared with physical memory alone let a config pass
that then died with ``MemoryError`` under such a limit (issue 31).

Each limit counts a different thing, so what is left under it subtracts what
the process already holds *as that limit counts it*: its virtual size
(``VmSize``) under ``RLIMIT_AS``, its data segment (``VmData``) under
``RLIMIT_DATA``, its resident memory (``VmRSS``) under the others (other
processes of a cgroup or job use some of it too, so the estimate of what is
left stays an upper bound and a check against it refuses only what cannot
fit).  ``memory_limit()`` returns the limit that leaves the least, named, so a
refusal can say which limit applied.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

try:
    import resource
except ImportError:  # Windows: no rlimits, and no /proc either
    resource = None  # type: ignore[assignment]

# Where the platform does not say (no sysconf: Windows): 16 GiB, a common laptop or workstation today.  A guess too
# high lets a size check pass that the machine then refuses; one too low refuses runs that would fit.  Both only
# where nothing else is known, and every other limit (rlimits, cgroup, SLURM) still applies beneath it.
FALLBACK_PHYSICAL_BYTES = 16 * 2**30
SLURM_UNIT = 2**20  # SLURM's --mem and --mem-per-cpu count MiB ("M")
# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number; anything this large is no limit.
UNLIMITED = 2**62


@dataclass(frozen=True)
class MemoryLimit:
    """One ceiling on this process's memory, and how much of it the process already holds."""

    limit: int  # bytes the process may hold under this ceiling
    held: int  # bytes it holds now, as this ceiling counts them
    name: str  # what the ceiling is, in words: "this machine's physical memory", "the address-space limit RLIMIT_AS (ulimit -v)", ...

    @property
    def available(self) -> int:
        """Bytes the process may still allocate under this ceiling."""
        return max(0, self.limit - self.held)

    def describe(self) -> str:
        """``the 7.32 GiB of memory left under the address-space limit RLIMIT_AS (ulimit -v) of 8 GiB (the process holds 701 MiB)``."""
        return (
            f"the {format_bytes(self.available)} of memory left under {self.name} of {format_bytes(self.limit)} "
            f"(the process holds {format_bytes(self.held)})"
        )


def format_bytes(count: float) -> str:
    """``7.45 GiB``, ``512 MiB``, ``12 bytes``: three significant digits in binary units."""
    count = float(min(count, 10**300))  # an estimate can be larger than a float holds
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{int(count)} bytes"


def memory_limit(
    environ: Mapping[str, str] | None = None,
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    proc: Path = Path("/proc/self"),
) -> MemoryLimit:
    """The ceiling that leaves this process the least memory (physical memory where nothing else applies)."""
    return min(memory_limits(environ, cgroup_root, proc), key=lambda limit: (limit.available, limit.limit))


def machine_memory_bytes() -> int:
    """Bytes this process may hold in all: the tightest limit's ``limit`` (``memory_limit``), the one reading of the
    machine's memory that budgets start from (``simulation.memory_budget``); ``FALLBACK_PHYSICAL_BYTES`` where
    the platform does not say."""
    return memory_limit().limit


def memory_limits(
    environ: Mapping[str, str] | None = None,
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    proc: Path = Path("/proc/self"),
) -> list[MemoryLimit]:
    """Every ceiling that applies to this process, physical memory first."""
    environ = os.environ if environ is None else environ
    usage = process_usage(proc)
    rss = usage.get("VmRSS", 0)
    limits = [MemoryLimit(physical_memory(), rss, "this machine's physical memory")]
    for which, field, name in (
        ("RLIMIT_AS", "VmSize", "the address-space limit RLIMIT_AS (ulimit -v)"),
        ("RLIMIT_DATA", "VmData", "the data-segment limit RLIMIT_DATA (ulimit -d)"),
    ):
        soft = resource_limit(which)
        if soft is not None:
            limits.append(MemoryLimit(soft, usage.get(field, 0), name))
    cgroup = cgroup_limit(cgroup_root, proc / "cgroup")
    if cgroup is not None:
        limits.append(MemoryLimit(cgroup[0], rss, f"the cgroup memory limit {cgroup[1]}"))
    slurm = slurm_limit(environ)
    if slurm is not None:
        limits.append(MemoryLimit(slurm[0], rss, f"the SLURM job's memory ({slurm[1]})"))
    return limits


def physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return FALLBACK_PHYSICAL_BYTES


def resource_limit(which: str) -> int | None:
    """The soft ``resource.RLIMIT_*`` limit in bytes; None when unlimited or unknown on this platform."""
    code = getattr(resource, which, None) if resource is not None else None
    if code is None:
        return None
    try:
        soft, _hard = resource.getrlimit(code)
    except (ValueError, OSError):
        return None
    return None if soft == resource.RLIM_INFINITY or soft < 0 or soft >= UNLIMITED else int(soft)


def process_usage(proc: Path = Path("/proc/self")) -> dict[str, int]:
    """``VmSize``, ``VmData`` and ``VmRSS`` of ``proc/status`` in bytes (what the kernel counts against each limit);
    elsewhere the peak resident size, the best the platform says."""
    try:
        text = (proc / "status").read_text()
    except OSError:
        if resource is None:
            return {}
        peak = resource.getrusage(
            resource.RUSAGE_SELF
        ).ru_maxrss  # KiB on Linux, bytes on macOS: the larger reading is safe
        return {"VmRSS": int(peak) * 1024}
    usage = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if key in ("VmSize", "VmData", "VmRSS") and len(parts) == 2 and parts[0].isdigit() and parts[1] == "kB":
            usage[key] = int(parts[0]) * 1024
    return usage


def cgroup_limit(root: Path, cgroup_file: Path) -> tuple[int, str] | None:
    """The tightest memory limit of this process's cgroup and its ancestors, with the file that set it; None if none.

    ``cgroup_file`` is ``/proc/self/cgroup``: ``0::/path`` for cgroup v2 (limits in
    ``root/path/memory.max``), ``N:memory:/path`` (or ``N:...,memory,...:/path``)
    for v1 (``root/memory/path/memory.limit_in_bytes``).  In a container the path
    can name a cgroup outside its view; then the mounted root itself is the
    container's cgroup and its file is read.
    """
    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[int, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hierarchy, controllers, path = parts
        if controllers == "":
            found += _limits_along(root, path, "memory.max")
        elif "memory" in controllers.split(","):
            found += _limits_along(root / "memory", path, "memory.limit_in_bytes")
    return min(found) if found else None


def _limits_along(root: Path, path: str, file_name: str) -> list[tuple[int, str]]:
    """The limits in ``file_name`` of the cgroup at ``path`` under ``root`` and of each ancestor up to ``root``."""
    directory = root / path.strip("/")
    if not directory.is_dir():
        directory = root
    limits = []
    while True:
        value = _read_limit(directory / file_name)
        if value is not None:
            limits.append((value, str(directory / file_name)))
        if directory == root or root not in directory.parents:
            return limits
        directory = directory.parent


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max": no limit (v2)
        return None
    value = int(text)
    return value if 0 < value < UNLIMITED else None


def slurm_limit(environ: Mapping[str, str]) -> tuple[int, str] | None:
    """A SLURM job's memory on this node in bytes, with the variables that gave it; None outside SLURM or without a limit.

    ``SLURM_MEM_PER_NODE`` (``--mem``) or ``SLURM_MEM_PER_CPU`` (``--mem-per-cpu``)
    times ``SLURM_CPUS_ON_NODE``, both in MiB; ``--mem=0`` (all of the node's memory)
    sets no limit of its own.
    """
    per_node = _positive_int(environ.get("SLURM_MEM_PER_NODE"))
    if per_node is not None:
        return per_node * SLURM_UNIT, f"SLURM_MEM_PER_NODE={per_node}"
    per_cpu = _positive_int(environ.get("SLURM_MEM_PER_CPU"))
    if per_cpu is None:
        return None
    cpus = _positive_int(environ.get("SLURM_CPUS_ON_NODE")) or 1
    return per_cpu * cpus * SLURM_UNIT, f"SLURM_MEM_PER_CPU={per_cpu} x SLURM_CPUS_ON_NODE={cpus}"


def _positive_int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip().upper().removesuffix("M")  # SLURM may print the unit
    return int(text) if text.isdigit() and int(text) > 0 else None


__all__ = [
    "MemoryLimit",
    "machine_memory_bytes",
    "memory_limit",
    "memory_limits",
    "format_bytes",
    "cgroup_limit",
    "slurm_limit",
    "process_usage",
    "physical_memory",
]
