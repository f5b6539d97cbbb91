"""The Ray executor's resource requests, against a stand-in for Ray (no cluster, no GPU: these run everywhere)."""

import sys
import types

import pytest

from driftlab.errors import ConfigError
from driftlab.executors import ExecutorOptions, check_options, ray_executor
from driftlab.executors.conftest import RUN_ENTRY
from driftlab.executors.gpus import GPU_SHARE_VARIABLE
from driftlab.executors.ray_executor import RayOptions, gpus_for, task_environment
from driftlab.executors.tasks import RunTask, TaskResult


def test_a_task_asks_for_as_many_gpus_as_its_run_uses_and_auto_for_none():
    devices = ("cpu", "auto", "cuda", "cuda:1", "cuda:0,cuda:1", "cuda:0,cuda:2,cuda:3")
    assert [gpus_for({"device": d}) for d in devices] == [0, 0, 1, 1, 2, 3]
    # N single-GPU runs share a GPU: each asks for 1/N of it and plans for 1/N of its memory
    assert [gpus_for({"device": d}, runs_per_gpu=4) for d in devices] == [0, 0, 0.25, 0.25, 2, 3]
    assert task_environment({"device": "cuda"}, 4) == {GPU_SHARE_VARIABLE: "4"}
    assert task_environment({"device": "cuda"}, 1) == {} == task_environment({"device": "cuda:0,cuda:1"}, 4)
    assert task_environment({"device": "auto"}, 4) == {} == task_environment({"device": "cpu"}, 4)


def test_runs_per_gpu_below_one_is_refused():
    with pytest.raises(ConfigError, match=r"^--ray-runs-per-gpu must be at least 1, got 0$"):
        check_options(ExecutorOptions("ray", runs_per_gpu=0))


class FakeRef:
    def __init__(self, number: int, task: RunTask):
        self.number, self.task = number, task

    def task_id(self):
        return types.SimpleNamespace(hex=lambda: f"task{self.number}")


def fake_ray(requests: list[dict]) -> types.ModuleType:
    """A stand-in for ``ray``: records each task's ``options`` and what it was handed, and runs nothing."""
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: True  # the caller's own Ray: the executor joins it, never starts one
    ray.exceptions = types.SimpleNamespace(RayError=RuntimeError)

    def remote(**decorator):
        def wrap(function):
            def options(**resources):
                def submit(task, environment):
                    requests.append({**resources, "device": task.config["device"], "environment": environment})
                    return FakeRef(len(requests), task)

                return types.SimpleNamespace(remote=submit)

            return types.SimpleNamespace(options=options)

        return wrap

    ray.remote = remote
    ray.wait = lambda refs, num_returns, timeout: (refs[:num_returns], refs[num_returns:])
    ray.get = lambda ref: TaskResult(ref.task, 0, 0.1)
    return ray


def test_each_task_asks_ray_for_its_run_s_gpus_and_gets_its_device_numbered_from_0(tmp_path, monkeypatch):
    requests: list[dict] = []
    monkeypatch.setitem(sys.modules, "ray", fake_ray(requests))
    devices = ["cpu", "cuda", "cuda:3", "cuda:2,cuda:5", "auto"]
    tasks = [RunTask(f"r{i}", tmp_path / f"r{i}", {"device": d}, 2, entry=RUN_ENTRY) for i, d in enumerate(devices)]
    results = ray_executor.execute(tasks, RayOptions(runs_per_gpu=2))
    assert [r.exit_code for r in results] == [0] * 5 and [r.task.key for r in results] == ["r0", "r1", "r2", "r3", "r4"]
    assert requests == [
        {"num_cpus": 2, "num_gpus": 0, "device": "cpu", "environment": {}},
        {"num_cpus": 2, "num_gpus": 0.5, "device": "cuda", "environment": {GPU_SHARE_VARIABLE: "2"}},
        {"num_cpus": 2, "num_gpus": 0.5, "device": "cuda:0", "environment": {GPU_SHARE_VARIABLE: "2"}},
        {"num_cpus": 2, "num_gpus": 2, "device": "cuda:0,cuda:1", "environment": {}},  # whole GPUs, its own
        {"num_cpus": 2, "num_gpus": 0, "device": "auto", "environment": {}},
    ]
