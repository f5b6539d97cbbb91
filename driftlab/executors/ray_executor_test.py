import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from driftlab.executors import ExecutorOptions
from driftlab.executors.conftest import assert_same_results, check_kill_and_resume, run_dirs, sweep
from driftlab.experiments.run.run_directory import read_run_info

ray = pytest.importorskip("ray")

RAY = ExecutorOptions("ray")
RAY_DAEMONS = (b"raylet", b"gcs_server")


def ray_daemons() -> list[int]:
    """This user's raylet and gcs_server processes."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == os.getuid() and (entry / "comm").read_bytes().strip() in RAY_DAEMONS:
                    found.append(int(entry.name))
    return found


def stop_ray(before: set[int]) -> list[int]:
    """ray.shutdown(), then the daemons this test started, by PID, if they outlived it; returns those that had to be killed."""
    ray.shutdown()
    started = lambda: [pid for pid in ray_daemons() if pid not in before]  # noqa: E731
    deadline = time.time() + 30
    while started() and time.time() < deadline:
        time.sleep(0.2)
    survivors = started()
    for pid in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return survivors


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray of 2 CPUs started by the test (the sweep must use it, not start its own), stopped by PID afterwards."""
    before = set(ray_daemons())
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield
    finally:
        survivors = stop_ray(before)
    assert not survivors, f"Ray daemons outlived ray.shutdown(): {survivors}"


def test_a_task_asks_for_a_gpu_only_for_a_cuda_device():
    from driftlab.executors.ray_executor import gpus_for

    assert [gpus_for({"device": d}) for d in ("cpu", "auto", "cuda", "cuda:1")] == [0, 0, 1, 1]


def test_an_unreachable_named_cluster_is_a_clear_error_not_a_local_ray(monkeypatch):
    from driftlab.executors import ray_executor
    from driftlab.experiments.config import ConfigError

    if ray.is_initialized():
        pytest.skip("a Ray is already running in this process")

    def refuse(address=None, **kwargs):
        raise ConnectionError(f"no Ray at {address}")

    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(ConfigError, match="cannot reach the Ray cluster at --ray-address 10.0.0.9:6379"):
        ray_executor.connect("10.0.0.9:6379")


@pytest.mark.slow
def test_without_a_cluster_the_sweep_starts_one_local_ray_says_so_and_stops_it(tmp_path, capsys, local_reference):
    if ray.is_initialized():
        pytest.skip("a Ray is already running in this process")
    before = set(ray_daemons())
    try:
        outcomes = sweep(tmp_path, RAY)
        assert [o.status for o in outcomes] == ["complete"] * 4
        assert "starting a local Ray on this machine for this sweep" in capsys.readouterr().err
        assert not ray.is_initialized()
        assert_same_results(tmp_path, local_reference)
    finally:
        survivors = stop_ray(before)
    assert not survivors, f"the sweep left Ray running: {survivors}"


@pytest.mark.slow
def test_ray_sweep_equals_the_local_one_records_its_tasks_and_a_rerun_skips_finished_runs(
    tmp_path, ray_cluster, local_reference, capsys
):
    logged: list[str] = []
    outcomes = sweep(tmp_path, RAY, logged=logged)
    assert [o.status for o in outcomes] == ["complete"] * 4, logged
    assert "starting a local Ray" not in capsys.readouterr().err  # it joined the running one
    assert ray.is_initialized()  # and left it running: not the sweep's to stop
    assert_same_results(tmp_path, local_reference)
    for run_dir in run_dirs(tmp_path):
        info = read_run_info(run_dir)
        assert info["executor"]["executor"] == "ray" and f"(job {info['executor']['job_id']})" in "\n".join(logged)
        assert info["machine"]["torch_threads"] == 1
    logged.clear()
    assert [o.status for o in sweep(tmp_path, RAY, logged=logged)] == ["complete"] * 4
    assert "4 runs, 4 already finished, 0 to run" in logged[0]


@pytest.mark.slow
def test_a_killed_ray_worker_is_resumed_from_its_checkpoint_by_the_next_sweep(tmp_path, ray_cluster, long_reference):
    check_kill_and_resume(tmp_path, RAY, long_reference)
