"""The SLURM executor: one submitit array job per sweep invocation, one array task per run.

Each array task starts the run's worker process (the same entry point as the local
executor) and waits for it. Pre-emption and time limits: SLURM sends SIGTERM to every
process of the job, so the run checkpoints its last completed round and exits;
submitit's USR2 (sent ahead of the time limit) stops the run the same way and
requeues the job, which resumes from the checkpoint. A run whose job was cancelled
or never requeued resumes when the sweep runs again, on any executor. The job id
and its log paths go into the run's ``run.json`` (``executor``) and the sweep's
``jobs.json``. ``--slurm-local`` runs the same jobs through submitit's local
executor, as processes on this machine (tests, a laptop), which stop (checkpointed)
when the sweep ends, however it ends, as the local executor's runs do.

Every job of the array gets the same resources: ``--slurm-gpus`` GPUs (default: the most any
run's device uses, ``gpus.gpu_request``; ``auto`` uses none), whose numbering inside the job
starts at 0, so each run's device is handed to it in that numbering (``gpus.renumbered``).
``--slurm-account``, ``--slurm-qos``, ``--slurm-constraint`` and ``--slurm-setup`` (shell lines
run in the job script before the run: module loads, an environment's activation) go through
to submitit's sbatch script; submitit's local executor has no use for them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from driftlab.errors import ConfigError
from driftlab.executors.gpus import gpu_request, renumbered
from driftlab.executors.processes import process_gone, run_task, set_aside_held
from driftlab.executors.registry import SWITCH, CliOption, Layout
from driftlab.executors.tasks import NO_EVENTS, Events, RunTask, TaskResult, absolute

LOG_FOLDER = "slurm-logs"  # in the sweep directory: submitit's pickles and each job's stdout/stderr
POLL_SECONDS = 1.0
STOP_SECONDS = 300  # for a run to save its checkpoint once told to stop

_workers: list[Any] = []  # this job's worker process, for `checkpoint` (a Popen cannot travel in the pickled job)


@dataclass(frozen=True)
class SlurmOptions:
    partition: str | None = None
    time: int = 60  # minutes per job
    cpus: int | None = None  # CPUs per job (default: the run's threads)
    gpus: int | None = None  # GPUs per job (default: the most any run's device uses)
    mem: int | None = None  # GB per job (default: the cluster's)
    array_parallelism: int = 256  # jobs of the array running at once
    local: bool = False  # submitit's LocalExecutor: the same jobs as processes on this machine
    account: str | None = None  # sbatch --account: whom the jobs are charged to
    qos: str | None = None  # sbatch --qos
    constraint: str | None = None  # sbatch --constraint: node features, e.g. "a100|h100"
    setup: tuple[str, ...] = ()  # shell lines the job script runs before the run (module load ..., source .../activate)


CLI_OPTIONS = (
    CliOption("--slurm-partition", "partition", str, "SLURM partition of the jobs"),
    CliOption("--slurm-time", "time", int, "time limit of each SLURM job in minutes (default: 60)", "MINUTES"),
    CliOption("--slurm-cpus", "cpus", int, "CPUs per SLURM job (default: the run's threads)"),
    CliOption(
        "--slurm-gpus", "gpus", int, "GPUs per SLURM job (default: the most any run's device uses; auto uses none)"
    ),
    CliOption("--slurm-mem", "mem", int, "memory per SLURM job in GB (default: the partition's)", "GB"),
    CliOption(
        "--slurm-array-parallelism", "array_parallelism", int, "SLURM jobs of the sweep running at once (default: 256)"
    ),
    CliOption(
        "--slurm-local",
        "local",
        SWITCH,
        "run the SLURM jobs on this machine through submitit's local executor (no cluster)",
    ),
    CliOption("--slurm-account", "account", str, "SLURM account the jobs are charged to (sbatch --account)"),
    CliOption("--slurm-qos", "qos", str, "SLURM quality of service of the jobs (sbatch --qos)"),
    CliOption(
        "--slurm-constraint", "constraint", str, "node features the jobs need (sbatch --constraint), e.g. 'a100|h100'"
    ),
    CliOption(
        "--slurm-setup",
        "setup",
        str,
        "a shell line each job runs before its run (module load, source .venv/bin/activate); give it once per line",
        "LINE",
        repeat=True,
    ),
)


def check(options: SlurmOptions) -> None:
    """Refuse impossible options, and a machine that cannot submit the jobs, before anything is planned or written."""
    for name in ("time", "cpus", "mem", "array_parallelism"):
        value = getattr(options, name)
        if value is not None and value < 1:
            raise ConfigError(f"--slurm-{name.replace('_', '-')} must be at least 1, got {value}")
    if options.gpus is not None and options.gpus < 0:
        raise ConfigError(f"--slurm-gpus must be 0 or more, got {options.gpus}")
    for name in ("account", "qos", "constraint"):
        value = getattr(options, name)
        if value is not None and (not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value)):
            raise ConfigError(f"--slurm-{name} must be one word, as sbatch --{name} takes it, got {value!r}")
    lines = (options.setup,) if isinstance(options.setup, str) else options.setup
    for line in lines:
        if not isinstance(line, str) or not line.strip() or "\n" in line:
            raise ConfigError(
                f"--slurm-setup takes one shell line each time it is given, got {line!r}; repeat the flag for several lines"
            )
    check_available(options)


def layout(options: SlurmOptions, pending: int) -> Layout:  # noqa: ARG001 - every run is a job of its own
    """A run's threads are its job's CPUs (``--slurm-cpus``), else 1."""
    return Layout(options.cpus or 1, "as slurm jobs")


def check_available(options: SlurmOptions) -> None:
    try:
        import submitit  # noqa: F401
    except ImportError:
        from driftlab.extras import install_hint

        raise ConfigError(f"--executor slurm needs submitit: {install_hint('slurm')}") from None
    if not options.local and shutil.which("sbatch") is None:
        raise ConfigError(
            "--executor slurm needs SLURM's sbatch on PATH (run the sweep on the cluster's login node); "
            "to run the same jobs on this machine, add --slurm-local"
        )


@dataclass(frozen=True)
class SlurmRun:
    """What each array task runs: the run's worker, waited for. submitit calls ``checkpoint`` on USR2 (pre-emption, time limit).

    ``sweep_pid`` (``--slurm-local`` only): the sweep on this machine; the job stops its run (checkpointed) when that
    process ends, however it ends, as a local executor's runs do. submitit's local jobs are made to outlive the
    session that submitted them, so a SIGKILLed sweep would otherwise leave them running. Cluster jobs outlive the
    sweep as SLURM intends: the next sweep leaves them alone and says so.
    """

    sweep_pid: int = 0

    def __call__(self, task: RunTask) -> TaskResult:
        import submitit

        environment = submitit.JobEnvironment()
        paths = environment.paths
        job = {
            "executor": "slurm",
            "job_id": environment.job_id,
            "stdout": str(paths.stdout),
            "stderr": str(paths.stderr),
        }
        if os.environ.get("CUDA_VISIBLE_DEVICES"):  # the node's GPUs SLURM gave the job
            job["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
        # submitit ignores SIGTERM in the job's own process; pass it on so the run checkpoints (SLURM signals
        # every process, but submitit's local executor signals only this one).
        signal.signal(signal.SIGTERM, _stop_worker)
        if self.sweep_pid:
            stop_when_gone(self.sweep_pid)
        return run_task(task, job, on_start=_workers.append)

    def checkpoint(self, task: RunTask) -> Any:
        """Stop the run at its last completed round (checkpointed), then let submitit requeue this task to resume it."""
        import submitit

        _stop_worker()
        return submitit.helpers.DelayedSubmission(self, task)


def stop_when_gone(pid: int, poll_seconds: float = 0.5) -> None:
    """Send this process SIGTERM once process ``pid`` has ended (a daemon thread watches it)."""
    import threading

    def watch() -> None:
        while not process_gone(pid):
            time.sleep(poll_seconds)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="driftlab-sweep-watch", daemon=True).start()


def _stop_worker(signum: int | None = None, frame: Any = None) -> None:  # noqa: ARG001
    """Stop this job's run (SIGTERM: it checkpoints, then exits) and wait until it has.

    Runs in a signal handler that interrupted ``Popen.wait``, whose lock it cannot take again:
    it waits by watching the process end (a zombie has ended) instead of calling ``wait``.
    """
    for process in _workers:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
    deadline = time.time() + STOP_SECONDS
    while time.time() < deadline and not all(
        process.returncode is not None or process_gone(process.pid) for process in _workers
    ):
        time.sleep(0.05)


def sweep_directory(task: RunTask) -> Path:
    """The sweep directory a task's run directory sits in (``task.key`` is the run's path inside it)."""
    return task.run_dir.parents[len(Path(task.key).parts) - 1]


def job_gpus(options: SlurmOptions, tasks: list[RunTask]) -> int:
    """The GPUs each job of the array gets: ``--slurm-gpus``, else the most any run's device uses; a ConfigError
    for a run that needs more than ``--slurm-gpus`` gives it (it would fail on its node)."""
    wanted = {task.label or task.key: gpu_request(task.config) for task in tasks}
    most = max((request.count for request in wanted.values() if not request.optional), default=0)
    if options.gpus is None:
        return most
    for label, request in wanted.items():
        if request.count > options.gpus and not (request.optional and options.gpus == 0):
            raise ConfigError(
                f"{label} uses {request.count} GPU(s) (device={request.device}), but --slurm-gpus {options.gpus} "
                f"gives each job {options.gpus}; give --slurm-gpus {request.count}, or leave it out (each job gets what the runs use)"
            )
    return options.gpus


def make_executor(options: SlurmOptions, folder: Path, cpus: int, gpus: int | None = None) -> Any:
    """submitit's executor of the array: ``gpus`` per job (default ``--slurm-gpus``, else 0)."""
    import submitit

    executor = submitit.AutoExecutor(folder=folder / "%j", cluster="local" if options.local else "slurm")
    gpus = gpus if gpus is not None else options.gpus or 0
    parameters: dict[str, Any] = {
        "name": "driftlab",
        "timeout_min": options.time,
        "cpus_per_task": cpus,
        "gpus_per_node": gpus,
    }
    if options.mem is not None:
        parameters["mem_gb"] = options.mem
    if not options.local:  # submitit's sbatch script; its local executor takes none of these
        parameters["slurm_array_parallelism"] = options.array_parallelism
        for name in ("partition", "account", "qos", "constraint"):
            if getattr(options, name):
                parameters[f"slurm_{name}"] = getattr(options, name)
        if options.setup:
            parameters["slurm_setup"] = [options.setup] if isinstance(options.setup, str) else list(options.setup)
    executor.update_parameters(**parameters)
    return executor


def execute(tasks: list[RunTask], options: SlurmOptions, events: Events = NO_EVENTS) -> list[TaskResult]:
    check_available(options)
    results, runnable = set_aside_held([absolute(task) for task in tasks], events)
    if not runnable:
        return results
    gpus = job_gpus(options, runnable)
    executor = make_executor(
        options, sweep_directory(runnable[0]) / LOG_FOLDER, options.cpus or runnable[0].threads, gpus
    )
    # a job sees only its own GPUs, numbered from 0: each run's device in that numbering
    own = [
        replace(task, config=renumbered(task.config, gpu_request(task.config).count if gpus else 0))
        for task in runnable
    ]
    jobs = executor.map_array(SlurmRun(sweep_pid=os.getpid() if options.local else 0), own)
    pending = {}
    submitted = time.perf_counter()
    for task, job in zip(runnable, jobs, strict=True):
        info = {
            "executor": "slurm",
            "job_id": str(job.job_id),
            "stdout": str(job.paths.stdout),
            "stderr": str(job.paths.stderr),
        }
        pending[info["job_id"]] = (job, task, info)
        events.started(task, (task.run_dir / "config.json").exists(), info)
    try:
        while pending:
            time.sleep(POLL_SECONDS)
            for job_id in [k for k, (job, _, _) in pending.items() if job.done()]:
                job, task, info = pending.pop(job_id)
                results.append(_result(job, task, info, time.perf_counter() - submitted))
                events.finished(results[-1])
    except BaseException:
        events.interrupted()
        # Cancelling sends the runs SIGTERM (a local job: SIGINT): each saves its last completed round.
        for job, _, _ in pending.values():
            job.cancel(check=False)
        deadline = time.time() + 120
        while time.time() < deadline and not all(job.done() for job, _, _ in pending.values()):
            time.sleep(POLL_SECONDS)
        raise
    return results


def _result(job: Any, task: RunTask, info: dict[str, Any], seconds: float) -> TaskResult:
    try:
        result = job.result()
    except Exception as error:  # noqa: BLE001 - the job died before its run could say why (killed, out of time, no node)
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        error = f"SLURM job {info['job_id']} ended without its run's result ({first}); see {info['stderr']}"
        return TaskResult(task, None, seconds, job={**info, "error": error})
    if not isinstance(result, TaskResult):
        return TaskResult(
            task,
            None,
            seconds,
            job={**info, "error": f"SLURM job {info['job_id']} returned {result!r}; see {info['stderr']}"},
        )
    return replace(result, task=task, job={**info, **result.job})
