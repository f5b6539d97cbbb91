"""The process's memory limit: each source read by hand-written files and variables, the tightest one named in refusals."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from driftlab import memory_limit as ml
from driftlab.experiments.config import ConfigError, load_config
from driftlab.experiments.run.compatibility import check_plan_size, check_sizes
from driftlab.experiments.run.datasets import build_dataset

GIB = 2**30
STATUS = "Name:\tpython\nVmPeak:\t 900000 kB\nVmSize:\t  800000 kB\nVmData:\t  300000 kB\nVmRSS:\t  200000 kB\n"


def _proc(tmp_path: Path, cgroup: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "status").write_text(STATUS)
    (proc / "cgroup").write_text(cgroup)
    return proc


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_process_usage_reads_what_each_limit_counts(tmp_path):
    usage = ml.process_usage(_proc(tmp_path, "0::/\n"))
    assert usage == {"VmSize": 800000 * 1024, "VmData": 300000 * 1024, "VmRSS": 200000 * 1024}


def test_cgroup_v2_takes_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "user.slice" / "memory.max", f"{6 * GIB}\n")
    _write(root / "user.slice" / "job" / "memory.max", "max\n")
    proc = _proc(tmp_path, "0::/user.slice/job\n")
    assert ml.cgroup_limit(root, proc / "cgroup") == (6 * GIB, str(root / "user.slice" / "memory.max"))
    _write(root / "user.slice" / "job" / "memory.max", f"{2 * GIB}\n")
    assert ml.cgroup_limit(root, proc / "cgroup") == (2 * GIB, str(root / "user.slice" / "job" / "memory.max"))


def test_cgroup_v2_outside_the_containers_view_reads_the_mounted_root(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "memory.max", f"{3 * GIB}\n")
    proc = _proc(tmp_path, "0::/kubepods/pod1/abc\n")  # not under this mount: the mount is the container's own cgroup
    assert ml.cgroup_limit(root, proc / "cgroup") == (3 * GIB, str(root / "memory.max"))


def test_cgroup_v1_reads_the_memory_controller_and_ignores_its_no_limit_value(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "unlimited"
    _write(root / "memory" / "docker" / "c1" / "memory.limit_in_bytes", f"{4 * GIB}\n")
    _write(root / "cpu" / "docker" / "c1" / "memory.limit_in_bytes", "1\n")  # not the memory controller: never read
    proc = _proc(tmp_path, "5:cpu,cpuacct:/docker/c1\n4:memory:/docker/c1\n0::/\n")
    assert ml.cgroup_limit(root, proc / "cgroup") == (
        4 * GIB,
        str(root / "memory" / "docker" / "c1" / "memory.limit_in_bytes"),
    )
    _write(root / "memory" / "docker" / "c1" / "memory.limit_in_bytes", "9223372036854771712\n")
    assert ml.cgroup_limit(root, proc / "cgroup") is None


def test_slurm_memory_per_node_or_per_cpu_in_mib():
    assert ml.slurm_limit({}) is None
    assert ml.slurm_limit({"SLURM_MEM_PER_NODE": "8000"}) == (8000 * 2**20, "SLURM_MEM_PER_NODE=8000")
    assert ml.slurm_limit({"SLURM_MEM_PER_NODE": "0"}) is None  # --mem=0: all of the node's memory
    assert ml.slurm_limit({"SLURM_MEM_PER_CPU": "2000", "SLURM_CPUS_ON_NODE": "4"}) == (
        8000 * 2**20,
        "SLURM_MEM_PER_CPU=2000 x SLURM_CPUS_ON_NODE=4",
    )
    assert ml.slurm_limit({"SLURM_MEM_PER_CPU": "2000"}) == (
        2000 * 2**20,
        "SLURM_MEM_PER_CPU=2000 x SLURM_CPUS_ON_NODE=1",
    )


def test_the_tightest_limit_is_the_one_that_leaves_least(tmp_path, monkeypatch):
    root = tmp_path / "cgroup"
    _write(root / "memory.max", f"{3 * GIB}\n")
    proc = _proc(tmp_path, "0::/\n")
    monkeypatch.setattr(ml, "physical_memory", lambda: 64 * GIB)
    rlimits = {"RLIMIT_AS": None, "RLIMIT_DATA": None}
    monkeypatch.setattr(ml, "resource_limit", lambda which: rlimits[which])
    limit = ml.memory_limit({}, root, proc)
    assert (limit.limit, limit.held, limit.available) == (3 * GIB, 200000 * 1024, 3 * GIB - 200000 * 1024)
    assert limit.name == f"the cgroup memory limit {root / 'memory.max'}"
    # RLIMIT_AS counts the virtual size (800,000 kB here), so 3.5 GiB of it leaves less than the 3 GiB cgroup
    rlimits["RLIMIT_AS"] = 3 * GIB + GIB // 2
    limit = ml.memory_limit({}, root, proc)
    assert (limit.limit, limit.held) == (3 * GIB + GIB // 2, 800000 * 1024)
    assert limit.describe() == (
        "the 2.74 GiB of memory left under the address-space limit RLIMIT_AS (ulimit -v) of 3.5 GiB (the process holds 781 MiB)"
    )
    limit = ml.memory_limit({"SLURM_MEM_PER_NODE": "1024"}, root, proc)
    assert limit.name == "the SLURM job's memory (SLURM_MEM_PER_NODE=1024)" and limit.limit == GIB
    assert [item.name for item in ml.memory_limits({}, tmp_path / "none", proc)][:1] == [
        "this machine's physical memory"
    ]


def test_the_real_rlimit_is_read():
    soft = ml.resource_limit("RLIMIT_AS")
    current = resource.getrlimit(resource.RLIMIT_AS)[0]
    assert soft == (None if current == resource.RLIM_INFINITY else current)


def test_size_checks_name_the_limit_that_refused(monkeypatch):
    limit = ml.MemoryLimit(8 * GIB, 700 * 2**20, "the address-space limit RLIMIT_AS (ulimit -v)")
    config = load_config(
        {"rounds": 1, "data": {"num_clients": 5}},
        ["client.epochs=none", "client.steps=100000000", "client.batch_size=10"],
    )
    check_sizes(config, memory_bytes=limit)  # 800 MB: the one-example plan fits
    data = build_dataset(config.data, config.seed)
    largest = int(data.client_sizes.max())
    assert largest >= 10
    with pytest.raises(ConfigError) as info:
        check_plan_size(config, data, memory_bytes=limit)
    message = str(info.value)
    assert message.startswith(
        f"client.steps: the batch plan of the largest client ({largest:,} examples: 100,000,000 steps"
    )
    assert (
        "7.32 GiB of memory left under the address-space limit RLIMIT_AS (ulimit -v) of 8 GiB (the process holds 700 MiB)"
        in message
    )
    # with no memory given, the checks ask memory_limit()
    monkeypatch.setattr("driftlab.experiments.run.compatibility.memory_limit", lambda: limit)
    with pytest.raises(ConfigError, match=r"RLIMIT_AS \(ulimit -v\) of 8 GiB"):
        check_plan_size(config, data)


def test_the_default_memory_budget_is_half_the_tightest_limit(monkeypatch):
    from driftlab.simulation.state.memory_budget import MemoryBudget

    monkeypatch.setattr(
        ml, "memory_limits", lambda *a: [ml.MemoryLimit(64 * GIB, GIB, "ram"), ml.MemoryLimit(6 * GIB, GIB, "x")]
    )
    assert ml.machine_memory_bytes() == 6 * GIB  # the tightest limit, not physical memory
    assert MemoryBudget().host_bytes == 3 * GIB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_a_run_too_large_for_the_address_space_limit_is_refused_before_it_allocates(tmp_path):
    """Issue 31: client.steps=10**8 passed against physical memory and died with MemoryError under an 8 GiB ulimit -v."""
    script = textwrap.dedent(
        """
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, resource.RLIM_INFINITY))
        import driftlab
        from driftlab.experiments.config import ConfigError
        try:
            driftlab.run("synthetic-fedavg", None, overrides=["client.epochs=none", "client.steps=100000000", "rounds=1"])
        except ConfigError as error:
            print(error)
        # VmHWM is this process image's own peak: ru_maxrss would carry over the forking parent's peak across exec
        print("peak", next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert result.returncode == 0, result.stderr
    message, peak = result.stdout.strip().splitlines()
    assert message.startswith(
        "client.steps: the batch plan of the largest client (8,116 examples: 100,000,000 steps"
    ), message
    assert "left under the address-space limit RLIMIT_AS (ulimit -v) of 8 GiB" in message
    assert int(peak.split()[1]) < 2**20  # KiB: under 1 GiB resident while refusing
