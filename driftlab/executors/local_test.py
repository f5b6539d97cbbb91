import json
import subprocess
from pathlib import Path

import pytest

from driftlab.errors import ConfigError
from driftlab.executors import ExecutorOptions, RunTask, check_options, execute, local, processes
from driftlab.executors.conftest import RUN_ENTRY, assert_same_results, check_kill_and_resume, run_dirs, sweep
from driftlab.executors.gpus import GPU_SHARE_VARIABLE
from driftlab.executors.local import LocalOptions, placed_tasks
from driftlab.executors.registry import Layout
from driftlab.experiments.run.run_directory import read_run_info


@pytest.mark.slow
def test_local_sweep_is_repeatable_records_no_executor_and_a_rerun_skips_finished_runs(tmp_path, local_reference):
    logged: list[str] = []
    outcomes = sweep(tmp_path, ExecutorOptions("local", jobs=2), logged=logged)
    assert [o.status for o in outcomes] == ["complete"] * 4
    assert "to run in 2 process(es) x 1 thread(s)" in logged[0]
    assert_same_results(tmp_path, local_reference)
    assert all("executor" not in read_run_info(d) for d in run_dirs(tmp_path))
    assert not (tmp_path / "jobs.json").exists()  # nothing was submitted anywhere
    logged.clear()
    assert [o.status for o in sweep(tmp_path, ExecutorOptions("local", jobs=2), logged=logged)] == ["complete"] * 4
    assert "4 runs, 4 already finished, 0 to run" in logged[0] and not any("start" in line for line in logged)


@pytest.mark.slow
def test_a_killed_local_worker_is_resumed_from_its_checkpoint_by_the_next_sweep(tmp_path, long_reference):
    check_kill_and_resume(tmp_path, ExecutorOptions("local", jobs=1), long_reference)


def test_an_unknown_executor_and_impossible_options_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"--executor: unknown executor 'lsf'; valid: local, slurm, ray"):
        execute([], ExecutorOptions("lsf"))
    with pytest.raises(ConfigError, match="--slurm-time must be at least 1, got 0"):
        check_options(ExecutorOptions("slurm", time=0, local=True))
    with pytest.raises(ConfigError, match="--slurm-gpus must be 0 or more"):
        check_options(ExecutorOptions("slurm", gpus=-1, local=True))
    with pytest.raises(ConfigError, match="--jobs must be at least 1, got 0"):
        check_options(ExecutorOptions("local", jobs=0))
    with pytest.raises(ConfigError, match="'slurm_gpus' is not an option of executor 'local'; its options: jobs, gpus"):
        check_options(ExecutorOptions("local", slurm_gpus=-1))


def test_a_run_held_by_a_live_process_is_not_started(tmp_path):
    import fcntl

    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    with open(run_dir / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("4242\n")
        lock.flush()
        results = execute([RunTask("runs/a", run_dir, {}, 1, entry=RUN_ENTRY)], ExecutorOptions("local", jobs=1))
    assert [(r.started, r.holder) for r in results] == [(False, 4242)]
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]


class FinishedProcess:
    returncode = 0

    def poll(self) -> int:
        return 0


def fake_gpus(count: int):
    """A machine with ``count`` GPUs, named as CUDA_VISIBLE_DEVICES would name them."""
    return lambda: tuple(str(index) for index in range(count))


def started_workers(monkeypatch, tmp_path, devices, options, gpus_seen=2, recorded=None):
    """Run ``local.execute`` on tasks of ``devices`` with workers that end at once; what each worker was started with."""
    started = []

    def popen(command, cwd=None, env=None):
        arguments = json.loads(command[-1])
        assert arguments["entry"] == RUN_ENTRY  # what the caller said the worker runs reaches it
        env = env or {}
        started.append(
            {
                "run": Path(arguments["run_dir"]).name,
                "device": arguments["config"]["device"],
                "visible": env.get("CUDA_VISIBLE_DEVICES"),
                "share": env.get(GPU_SHARE_VARIABLE),
                "placement": arguments.get("placement"),
            }
        )
        return FinishedProcess()

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(local.gpus, "visible_gpus", fake_gpus(gpus_seen))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(GPU_SHARE_VARIABLE, raising=False)
    tasks = [
        RunTask(f"r{i}", tmp_path / f"r{i}", {"device": device}, 1, entry=RUN_ENTRY) for i, device in enumerate(devices)
    ]
    for t in tasks:
        t.run_dir.mkdir()
    for name, info in (recorded or {}).items():
        (tmp_path / name / "run.json").write_text(json.dumps(info))
    results = local.execute(tasks, options)
    assert [r.exit_code for r in results] == [0] * len(devices)
    return started


def test_five_cuda_runs_go_round_robin_over_two_gpus_each_seeing_only_its_own(tmp_path, monkeypatch):
    started = started_workers(monkeypatch, tmp_path, ["cuda"] * 5, LocalOptions(jobs=5))
    assert [(s["run"], s["device"], s["visible"], s["share"]) for s in started] == [
        ("r0", "cuda", "0", "3"),  # GPU 0 holds 3 of the 5 runs: each plans for a third of it
        ("r1", "cuda", "1", "2"),  # GPU 1 holds 2
        ("r2", "cuda", "0", "3"),
        ("r3", "cuda", "1", "2"),
        ("r4", "cuda", "0", "3"),
    ]
    assert started[1]["placement"] == {"gpus": [1], "cuda_visible_devices": "1"}  # what run.json records
    assert processes.worker_command("{}")[2].endswith(
        "from driftlab.executors.worker import worker_main; worker_main(sys.argv[1])"
    )


def test_two_runs_on_gpu_0_each_get_half_of_it_and_a_run_alone_on_gpu_1_all_of_it(tmp_path, monkeypatch):
    started = started_workers(monkeypatch, tmp_path, ["cuda", "cuda:1", "cuda", "cpu"], LocalOptions(jobs=4))
    assert [(s["device"], s["visible"], s["share"], s["placement"]) for s in started] == [
        ("cuda", "0", "2", {"gpus": [0], "cuda_visible_devices": "0"}),
        ("cuda:0", "1", None, {"gpus": [1], "cuda_visible_devices": "1"}),  # pinned to GPU 1, which it sees as cuda:0
        ("cuda", "0", "2", {"gpus": [0], "cuda_visible_devices": "0"}),
        ("cpu", None, None, None),  # a CPU run is left alone
    ]


def test_gpus_restricts_the_placement_and_none_leaves_auto_runs_on_the_cpu(tmp_path, monkeypatch):
    started = started_workers(
        monkeypatch, tmp_path, ["cuda:1,cuda:3", "auto", "cuda"], LocalOptions(jobs=1, gpus="3,1,2"), gpus_seen=4
    )
    assert [(s["device"], s["visible"], s["share"]) for s in started] == [
        ("cuda:0,cuda:1", "3,1", None),  # a run on two GPUs takes two, numbered from 0 in its worker; one job: no share
        ("auto", "2", None),
        ("cuda", "3", None),
    ]
    (tmp_path / "cpu").mkdir()
    started = started_workers(monkeypatch, tmp_path / "cpu", ["auto", "cpu"], LocalOptions(gpus="none"))
    assert [(s["device"], s["visible"]) for s in started] == [("auto", ""), ("cpu", None)]


def test_runs_of_unequal_lengths_never_put_more_than_their_share_on_one_gpu(tmp_path, monkeypatch):
    # 6 runs on 2 GPUs, 4 processes: at most 2 runs on a GPU at once, each told it shares its GPU with one other,
    # even when GPU 0's runs end first and the next run in the sweep's order is also GPU 0's.
    lengths = {"r0": 1, "r1": 9, "r2": 1, "r3": 9, "r4": 2, "r5": 2}  # polls until each run ends
    running: dict[str, str] = {}
    most: dict[str, int] = {}

    class Process:
        def __init__(self, name, gpu):
            self.name, self.gpu, self.polls, self.returncode = name, gpu, lengths[name], None
            running[name] = gpu
            most[gpu] = max(most.get(gpu, 0), list(running.values()).count(gpu))

        def poll(self):
            self.polls -= 1
            if self.polls <= 0 and self.returncode is None:
                self.returncode = 0
                running.pop(self.name)
            return self.returncode

    order = []

    def popen(command, cwd=None, env=None):
        name = Path(json.loads(command[-1])["run_dir"]).name
        order.append((name, env["CUDA_VISIBLE_DEVICES"], env[GPU_SHARE_VARIABLE]))
        return Process(name, env["CUDA_VISIBLE_DEVICES"])

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(local.gpus, "visible_gpus", fake_gpus(2))
    monkeypatch.setattr(local.time, "sleep", lambda seconds: None)
    monkeypatch.delenv(GPU_SHARE_VARIABLE, raising=False)
    tasks = [RunTask(name, tmp_path / name, {"device": "cuda"}, 1, entry=RUN_ENTRY) for name in lengths]
    for t in tasks:
        t.run_dir.mkdir()
    assert [r.exit_code for r in local.execute(tasks, LocalOptions(jobs=4))] == [0] * 6
    assert most == {"0": 2, "1": 2}
    # in the sweep's order, alternating GPUs 0 and 1, each run told it has half of its GPU
    assert order == [(f"r{i}", str(i % 2), "2") for i in range(6)]


def test_a_resumed_run_goes_back_to_the_gpu_its_run_json_records(tmp_path, monkeypatch):
    recorded = {"r0": {"status": "interrupted", "placement": {"gpus": [1], "cuda_visible_devices": "1"}}}
    started = started_workers(monkeypatch, tmp_path, ["cuda"] * 3, LocalOptions(jobs=1), recorded=recorded)
    assert [s["visible"] for s in started] == ["1", "0", "0"]


def test_a_sweep_whose_runs_its_gpus_cannot_hold_starts_none_and_says_what_to_change(tmp_path, monkeypatch):
    for devices, options, seen, message in (
        (
            ["cpu", "cuda"],
            LocalOptions(),
            0,
            r"^b asks for a GPU \(device=cuda\), but this machine shows no GPU torch can use; set device=cpu",
        ),
        (
            ["cuda"],
            LocalOptions(gpus="none"),
            2,
            r"^a asks for a GPU \(device=cuda\), but --gpus none gives the sweep no GPU",
        ),
        (
            ["cuda:0,cuda:1"],
            LocalOptions(gpus="1"),
            2,
            r"^a asks for 2 GPUs \(device=cuda:0,cuda:1\), but the sweep has 1 \(--gpus 1\)",
        ),
        (["cuda:1"], LocalOptions(gpus="0"), 2, r"^a names GPU 1 \(device=cuda:1\), which --gpus 0 leaves out"),
        (
            ["cuda"],
            LocalOptions(gpus="2"),
            2,
            r"^--gpus 2: this machine shows 2 GPU\(s\), numbered 0-1, so GPU 2 does not exist$",
        ),
    ):
        monkeypatch.setattr(local.gpus, "visible_gpus", fake_gpus(seen))
        monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a worker was started"))
        tasks = [
            RunTask(key, tmp_path / key, {"device": device}, 1, label=key, entry=RUN_ENTRY)
            for key, device in zip("ab", devices, strict=False)
        ]
        with pytest.raises(ConfigError, match=message):
            local.execute(tasks, options)


def test_gpus_is_checked_before_the_sweep_plans_and_a_cpu_sweep_never_asks_for_gpus(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"^--gpus 0,x: expected GPU indices such as 0,2"):
        check_options(ExecutorOptions("local", gpus="0,x"))
    with pytest.raises(
        ConfigError, match=r"^--gpus 5: this machine shows 2 GPU\(s\), numbered 0-1, so GPU 5 does not exist$"
    ):
        local.check(LocalOptions(gpus="5"), fake_gpus(2))
    local.check(LocalOptions(gpus="0,1"), fake_gpus(2))
    tasks = [RunTask("a", tmp_path / "a", {"device": "cpu"}, 1, entry=RUN_ENTRY)]
    never = lambda: pytest.fail("a CPU sweep asked for the GPUs")  # noqa: E731
    assert placed_tasks(tasks, LocalOptions(), jobs=1, visible=never)[0].environment == {}


def test_the_cores_are_split_between_the_runs_going_at_once(monkeypatch):
    monkeypatch.setattr(local, "available_cores", lambda: 8)
    assert local.layout(LocalOptions(), pending=2) == Layout(4, "in 2 process(es)")
    assert local.layout(LocalOptions(jobs=3), pending=10) == Layout(2, "in 3 process(es)")
    assert local.layout(LocalOptions(), pending=0) == Layout(8, "in 1 process(es)")
