import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from driftlab.errors import ConfigError
from driftlab.executors import processes, worker
from driftlab.executors.conftest import RUN_ENTRY, TINY, four_run_spec
from driftlab.experiments.run.run_directory import read_run_info
from driftlab.experiments.sweep import plan


@pytest.mark.slow
def test_the_gpus_an_executor_placed_a_run_on_go_into_its_run_json(tmp_path):
    # A CPU run told it was placed on GPU 1 (the worker records what it is told): run.json says so, beside "machine".
    config = plan(four_run_spec(), extra_overrides=[*TINY, "rounds=1"])[0].config.to_dict()
    placement = {"gpus": [1], "cuda_visible_devices": "1"}
    process = processes.start_worker(tmp_path / "run", config, False, 1, placement=placement, entry=RUN_ENTRY)
    assert process.wait(timeout=300) == processes.EXIT_COMPLETE
    info = read_run_info(tmp_path / "run")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]  # [] on a machine without CUDA
    assert info["placement"] == {"gpus": [1], "cuda_visible_devices": "1", "gpu_names": names}
    assert "executor" not in info and info["machine"]["device"] == "cpu"


def test_the_worker_names_the_gpus_it_sees_and_passes_the_placement_to_the_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"Fake GPU {index}")
    assert worker.gpu_names() == ["Fake GPU 0", "Fake GPU 1"]

    def no_driver(index):
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.cuda, "get_device_name", no_driver)
    assert worker.gpu_names() == []

    handed: list = []
    monkeypatch.setattr(worker, "die_with_parent", lambda parent: None)
    monkeypatch.setattr(worker, "_worker", lambda *arguments: handed.append(arguments))
    monkeypatch.setattr(worker, "gpu_names", lambda: ["Fake GPU 0"])
    arguments = {
        "entry": "plugin.runs:run_one",
        "run_dir": "r",
        "config": {},
        "resume": False,
        "threads": 1,
        "parent": 1,
    }
    worker.worker_main(json.dumps({**arguments, "placement": {"gpus": [3], "cuda_visible_devices": "3"}}))
    worker.worker_main(json.dumps(arguments))
    assert [run_info for *_, run_info in handed] == [
        {"placement": {"gpus": [3], "cuda_visible_devices": "3", "gpu_names": ["Fake GPU 0"]}},
        {},  # a run no executor placed on a GPU records no placement
    ]
    assert [entry for entry, *_ in handed] == ["plugin.runs:run_one"] * 2  # the worker runs what its caller named


def test_the_entry_a_sweep_gives_its_runs_is_the_runner_s_entry_for_workers():
    from driftlab.experiments.run.runner import run_recorded
    from driftlab.experiments.sweep import execution

    assert worker.named(execution.RUN_ENTRY) is run_recorded


def test_no_executor_module_names_the_layer_above():
    # The worker runs what its task's entry names; the executors neither import nor name the experiments.
    modules = [
        p
        for p in Path(worker.__file__).parent.glob("*.py")
        if not p.name.endswith("_test.py") and p.name != "conftest.py"
    ]
    assert worker.__file__ in [str(p) for p in modules] and len(modules) >= 8
    assert [p.name for p in modules if "driftlab.experiments" in p.read_text()] == []


def test_a_worker_started_without_an_entry_fails_and_says_what_the_executor_must_pass(tmp_path):
    arguments = {"run_dir": str(tmp_path / "run"), "config": {}, "resume": False, "threads": 1, "parent": os.getpid()}
    process = subprocess.run(processes.worker_command(json.dumps(arguments)), timeout=120)
    assert process.returncode == processes.EXIT_FAILED
    failure = (tmp_path / "run" / processes.FAILURE_FILE).read_text()
    assert failure.startswith("ConfigError: this worker was started without an entry (what it runs)")
    assert "processes.start_worker(..., entry=task.entry)" in failure


def test_an_entry_that_names_nothing_callable_is_refused_with_its_module_and_name():
    with pytest.raises(
        ConfigError,
        match="'json:no_such_function' names nothing callable: module json has no function no_such_function",
    ):
        worker.named("json:no_such_function")
    with pytest.raises(ValueError, match="a run's entry must be a 'module:function' reference"):
        worker.named("json.loads")
    assert worker.named("json:loads") is json.loads
