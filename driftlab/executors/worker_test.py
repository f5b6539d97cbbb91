import json

import pytest
import torch

from driftlab.executors import processes, worker
from driftlab.executors.conftest import TINY, four_run_spec
from driftlab.experiments.run_directory import read_run_info
from driftlab.experiments.sweep import plan


@pytest.mark.slow
def test_the_gpus_an_executor_placed_a_run_on_go_into_its_run_json(tmp_path):
    # A CPU run told it was placed on GPU 1 (the worker records what it is told): run.json says so, beside "machine".
    config = plan(four_run_spec(), extra_overrides=[*TINY, "rounds=1"])[0].config.to_dict()
    placement = {"gpus": [1], "cuda_visible_devices": "1"}
    process = processes.start_worker(tmp_path / "run", config, False, 1, placement=placement)
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
    arguments = {"run_dir": "r", "config": {}, "resume": False, "threads": 1, "parent": 1}
    worker.worker_main(json.dumps({**arguments, "placement": {"gpus": [3], "cuda_visible_devices": "3"}}))
    worker.worker_main(json.dumps(arguments))
    assert [run_info for *_, run_info in handed] == [
        {"placement": {"gpus": [3], "cuda_visible_devices": "3", "gpu_names": ["Fake GPU 0"]}},
        {},  # a run no executor placed on a GPU records no placement
    ]


def test_the_run_a_worker_names_is_the_experiments_runner_on_the_recorded_config():
    from driftlab.experiments.config import config_from_record
    from driftlab.experiments.runner import run

    assert worker.named(worker.RUN) is run
    assert worker.named(worker.CONFIG_FROM_RECORD) is config_from_record
