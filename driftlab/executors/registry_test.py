import argparse
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from driftlab.errors import ConfigError
from driftlab.executors import EXECUTORS, ExecutorEntry, ExecutorOptions, registry
from driftlab.executors.conftest import FOUR_RUNS, four_run_spec, metrics
from driftlab.executors.local import LocalOptions
from driftlab.executors.ray_executor import RayOptions
from driftlab.executors.registry import (
    CliOption,
    command_line_options,
    options_from_arguments,
    options_from_command_line,
    resolve,
)
from driftlab.executors.slurm import SlurmOptions
from driftlab.experiments.sweep import load_sweep, plan

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class PauseOptions:
    pause: float = 0.0
    jobs: int = 1


def run_nothing(tasks, options, events):
    return []


PAUSE = ExecutorEntry(
    "pause",
    PauseOptions,
    run_nothing,
    cli_options=(
        CliOption("--pause", "pause", float, "seconds between runs"),
        CliOption("--jobs", "jobs", int, "runs at once"),
    ),
)


@pytest.fixture
def with_pause(monkeypatch):
    """The registry with the ``pause`` executor added for one test (and removed after it)."""
    monkeypatch.setitem(registry.REGISTRY.entries, "pause", PAUSE)


def test_the_built_ins_are_registered_in_order_and_are_not_plugins():
    assert EXECUTORS == ("local", "slurm", "ray")
    assert [registry.lookup(name).options_type for name in EXECUTORS] == [LocalOptions, SlurmOptions, RayOptions]
    assert not any(registry.REGISTRY.is_plugin(registry.lookup(name)) for name in EXECUTORS)


def test_options_are_the_executor_s_own_and_the_flat_spellings_still_work():
    assert resolve(ExecutorOptions()) == (registry.lookup("local"), LocalOptions())
    assert resolve(ExecutorOptions("local", jobs=2))[1] == LocalOptions(jobs=2)
    assert resolve(ExecutorOptions("slurm", time=120, local=True))[1] == SlurmOptions(time=120, local=True)
    assert resolve(ExecutorOptions("slurm", slurm_time=120, slurm_local=True))[1] == SlurmOptions(time=120, local=True)
    assert resolve(ExecutorOptions("ray", ray_address="10.0.0.1:6379"))[1] == RayOptions(address="10.0.0.1:6379")
    assert resolve(ExecutorOptions("slurm", SlurmOptions(gpus=1), time=5))[1] == SlurmOptions(gpus=1, time=5)
    with pytest.raises(
        ConfigError, match="'ray_address' is not an option of executor 'slurm'; its options: partition, time"
    ):
        resolve(ExecutorOptions("slurm", ray_address="x"))
    with pytest.raises(ConfigError, match="executor 'ray' takes RayOptions options, got SlurmOptions"):
        resolve(ExecutorOptions("ray", SlurmOptions()))
    with pytest.raises(ConfigError, match=r"unknown executor 'slrum' \(did you mean 'slurm'\?\)"):
        resolve(ExecutorOptions("slrum"))


def test_an_entry_says_what_is_wrong_with_it():
    with pytest.raises(ValueError, match="lower-case letters"):
        ExecutorEntry("Serial", PauseOptions, run_nothing)
    with pytest.raises(ValueError, match="options_type must be a frozen dataclass"):
        ExecutorEntry("serial", dict, run_nothing)

    @dataclass(frozen=True)
    class NoDefault:
        host: str

    with pytest.raises(ValueError, match="every field of options_type needs a default"):
        ExecutorEntry("serial", NoDefault, run_nothing)
    with pytest.raises(
        ValueError,
        match=r"cli option '--host' must start with -- and set a field of PauseOptions \(pause, jobs\), not 'host'",
    ):
        ExecutorEntry("serial", PauseOptions, run_nothing, cli_options=(CliOption("--host", "host"),))
    with pytest.raises(ValueError, match="executor name 'local' is a built-in executor"):
        registry.register(ExecutorEntry("local", PauseOptions, run_nothing))


def test_each_flag_is_on_the_command_line_once_and_sets_its_executor_s_field(with_pause):
    flags = [option.flag for option in command_line_options()]
    assert flags[:15] == [
        "--jobs",
        "--gpus",
        "--slurm-partition",
        "--slurm-time",
        "--slurm-cpus",
        "--slurm-gpus",
        "--slurm-mem",
        "--slurm-array-parallelism",
        "--slurm-local",
        "--slurm-account",
        "--slurm-qos",
        "--slurm-constraint",
        "--slurm-setup",
        "--ray-address",
        "--ray-runs-per-gpu",
    ]
    assert flags[15:] == ["--pause"]  # pause's --jobs is local's flag, declared once
    assert options_from_command_line("pause", {"--jobs": 3, "--pause": 0.5}) == ExecutorOptions(
        "pause", jobs=3, pause=0.5
    )
    assert options_from_command_line("slurm", {"--slurm-time": 5, "--slurm-local": True}) == ExecutorOptions(
        "slurm", time=5, local=True
    )
    with pytest.raises(
        ConfigError, match="--slurm-time is an option of --executor slurm, not of --executor local; drop --slurm-time"
    ):
        options_from_command_line("local", {"--slurm-time": 5})
    with pytest.raises(ConfigError, match="--jobs is an option of --executor local or pause, not of --executor ray"):
        options_from_command_line("ray", {"--jobs": 2})
    # an executor a sweep's plugin registers is named before the sweep imports it, but takes no flag until then
    assert options_from_command_line("serial", {}) == ExecutorOptions("serial")
    with pytest.raises(ConfigError, match="unknown executor 'serial'"):
        options_from_command_line("serial", {"--pause": 1.0})


def test_argparse_gives_only_the_flags_the_user_gave(with_pause):
    parser = argparse.ArgumentParser()
    for option in command_line_options():
        parser.add_argument(option.flag, **option.argparse_keywords())
    arguments = parser.parse_args(["--slurm-local", "--slurm-mem", "8"])
    assert vars(arguments) == {"slurm_local": True, "slurm_mem": 8}
    assert options_from_arguments("slurm", arguments) == ExecutorOptions("slurm", local=True, mem=8)
    assert options_from_arguments("local", parser.parse_args([])) == ExecutorOptions("local")
    assert options_from_arguments("local", parser.parse_args(["--gpus", "0,2"])) == ExecutorOptions("local", gpus="0,2")


def test_a_repeated_flag_gives_its_field_every_word_in_order():
    parser = argparse.ArgumentParser()
    for option in command_line_options():
        parser.add_argument(option.flag, **option.argparse_keywords())
    arguments = parser.parse_args(
        ["--slurm-setup", "module load cuda", "--slurm-account", "p1", "--slurm-setup", "source .venv/bin/activate"]
    )
    assert options_from_arguments("slurm", arguments) == ExecutorOptions(
        "slurm", account="p1", setup=("module load cuda", "source .venv/bin/activate")
    )
    assert options_from_command_line("slurm", {"--slurm-setup": "module load cuda"}) == ExecutorOptions(
        "slurm", setup=("module load cuda",)
    )
    assert resolve(options_from_arguments("slurm", arguments))[1] == SlurmOptions(
        account="p1", setup=("module load cuda", "source .venv/bin/activate")
    )


SERIAL_PLUGIN = '''
"""An executor of one's own: the runs one after another in this process's children, through the same worker."""
from dataclasses import dataclass

from driftlab.executors import ExecutorEntry, Layout, register, run_task


@dataclass(frozen=True)
class SerialOptions:
    pass


def execute(tasks, options, events):
    results = []
    for task in tasks:
        events.started(task, (task.run_dir / "config.json").exists(), {})
        results.append(run_task(task, {}))
        events.finished(results[-1])
    return results


def layout(options, pending):
    return Layout(1, "one after another")


register(ExecutorEntry("serial", SerialOptions, execute, layout=layout))
'''


def write_serial_sweep(folder: Path) -> Path:
    (folder / "serial_executor.py").write_text(SERIAL_PLUGIN)
    sweep = folder / "sweep.toml"
    sweep.write_text(
        textwrap.dedent(f"""
        base = "synthetic-fedprox"
        plugins = ["serial_executor.py"]
        overrides = {json.dumps(FOUR_RUNS)}
        seeds = [0, 1]

        [[axes]]
        name = "algorithm.mu"
        values = [{{ label = "mu=0", set = ["algorithm.mu=0"] }}, {{ label = "mu=1", set = ["algorithm.mu=1"] }}]
    """)
    )
    return sweep


def cli(*arguments: str) -> subprocess.CompletedProcess:
    # a process of its own: the plugin's executor stays out of this one's registry
    command = [sys.executable, "-m", "driftlab.cli", "sweep", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=ROOT)


@pytest.mark.slow
def test_a_plugin_executor_named_by_the_sweep_file_runs_the_sweep_to_the_local_executor_s_bytes(
    tmp_path, local_reference
):
    sweep = write_serial_sweep(tmp_path)
    out = tmp_path / "out"
    result = cli(str(sweep), "--executor", "serial", "--no-report", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "4 to run one after another x 1 thread(s)" in result.stdout and "sweep finished: 4 complete" in result.stdout
    # the same runs as the local reference (the same overrides, axis and seeds, 1 thread each), byte for byte
    mine, reference = plan(load_sweep(str(sweep))), plan(four_run_spec(), extra_overrides=FOUR_RUNS)
    assert [r.config.fingerprint() for r in mine] == [r.config.fingerprint() for r in reference]
    for run, expected in zip(mine, reference, strict=True):
        final = "final_model.safetensors"
        assert (out / run.dir / final).read_bytes() == (local_reference / expected.dir / final).read_bytes(), run.dir
        assert metrics(out / run.dir) == metrics(local_reference / expected.dir)
        assert "executor" not in json.loads((out / run.dir / "run.json").read_text())
    # its flags are its own: local's --jobs is refused by name before anything runs
    refused = cli(str(sweep), "--executor", "serial", "--jobs", "2", "--out", str(tmp_path / "refused"))
    assert (
        refused.returncode == 2
        and "--jobs is an option of --executor local, not of --executor serial" in refused.stderr
    )
    assert not (tmp_path / "refused").exists()


def test_run_sweep_s_jobs_sets_the_processes_of_executors_that_have_them():
    from driftlab.experiments.sweep.execution import _executor

    assert _executor(ExecutorOptions(), 3) == (registry.lookup("local"), LocalOptions(jobs=3))
    assert _executor(ExecutorOptions("slurm", time=5), None)[1] == SlurmOptions(time=5)
    with pytest.raises(
        ConfigError, match=r"jobs=2: executor 'ray' has no jobs option \(its options: address, runs_per_gpu\)"
    ):
        _executor(ExecutorOptions("ray"), 2)
