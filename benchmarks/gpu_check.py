"""One prepared command for a lent GPU: every CUDA path run once, and the speed goals measured, inside one time budget.

A GPU comes to this project in short windows (about 15 minutes, at most 10 per
command, a bare machine with its own CUDA build of torch that must not be
replaced), so everything it should do is one command, prepared and tested on a
CPU first (``gpu_check_test.py`` runs it with ``--quick`` in CI).  In order:

1. ``environment``: Python, torch, CUDA and the GPU's name and memory, the
   driftlab commit (``DRIFTLAB_COMMIT``, else ``git``), ``nvidia-smi -L``;
2. ``tests``: the CUDA-only tests (``-m cuda`` would miss none: they are listed
   in ``CUDA_TESTS``): whole runs of every algorithm and feature on the GPU
   against the CPU, the no-sync round under
   ``torch.cuda.set_sync_debug_mode("error")``, each precision against the CPU,
   the memory budget's GPU share;
3. ``layers``: ``benchmarks/layer_variants.py``, one training step of each
   implementation of the batched layers (grouped convolution, im2col, a
   per-client loop; the LSTM's batched recurrence against cuDNN per client),
   so that one window decides which the backend should use
   (``layer_variants.json`` beside the summary);
4. ``speed``: ``benchmarks/round_speed.py --device cuda`` for each entry of
   ``SPEED_RUNS`` (cnn at 10 and 100 clients per round, first with its grouped
   and its unfold convolutions (config key ``convolution``), mlp at 10, 100 and
   1,000, lstm, resnet18_gn; float32 with the plain-PyTorch reference row,
   tf32 and bf16 for the driftlab row), each its own subprocess;
5. ``precision``: a short real CIFAR-10 run (the ``cifar10-feddyn`` preset,
   ``PRECISION_ROUNDS`` rounds) in float32, tf32 and bf16, side by side in one
   sweep, for accuracy against float32 (skipped, saying so, without the data).

Each step runs in a subprocess with its own time limit, and the whole command
keeps to ``--budget`` seconds (a step that would start past it is recorded as
skipped, with why), so one crash or a slow step never costs the others.  Output,
in ``--out`` (at most 8 files, as the device tool returns them): ``summary.json``
(every number and each step's status; also the last line printed),
``log.txt`` (every step's output) and ``layer_variants.json``.  A short table is printed before the JSON.

Usage (on the GPU machine, from the checkout; the data copied into an ignored
folder of it, named by ``DRIFTLAB_DATA``)::

    DRIFTLAB_DATA=.gpudata python benchmarks/gpu_check.py --out $OUT --budget 300
    python benchmarks/gpu_check.py --quick --out /tmp/gpu-check     # on a CPU: the same steps, tiny, seconds

``--quick`` shrinks every step (tiny sizes, random data, CPU when there is no GPU) so the
script itself is tested where there is no GPU; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[1]

CUDA_TESTS = [
    "driftlab/experiments/run/cuda_runs_test.py",
    "driftlab/simulation/backends/vectorized_test.py::test_a_cuda_round_has_no_host_syncs_and_matches_the_cpu",
    "driftlab/simulation/backends/precision_test.py::test_on_cuda_each_precision_trains_near_the_cpu_float32_round",
    "driftlab/simulation/state/memory_budget_test.py::test_a_cuda_run_measures_its_gpu_once_and_takes_its_share",
]


def _speed_run(label: str, arguments: str, seconds: int) -> tuple[str, list[str], int]:
    """(label, round_speed's arguments, seconds allowed); ``arguments`` are separated by spaces (none holds one)."""
    return label, arguments.split(), seconds


# (label, round_speed arguments, seconds allowed): the speed goals of docs/performance.md, most important first.
SPEED_RUNS: list[tuple[str, list[str], int]] = [
    # The CNN's reference loop takes about 13 s a round at 100 clients on an H200 (2026-11-27): 90 s for 4 rounds of both.
    _speed_run("cnn-float32", "--model cnn --clients-per-round 10 100 --rows vectorized,reference", 120),
    # The convolutions as im2col and one matrix product per client (config key convolution=unfold), alone and in bf16.
    _speed_run("cnn-unfold", "--model cnn --clients-per-round 10 100 --rows vectorized --convolution unfold", 40),
    _speed_run("cnn-bf16", "--model cnn --clients-per-round 10 100 --rows vectorized --precision bf16", 40),
    _speed_run(
        "cnn-unfold-bf16",
        "--model cnn --clients-per-round 10 100 --rows vectorized --precision bf16 --convolution unfold",
        40,
    ),
    _speed_run("mlp-float32", "--model mlp --clients-per-round 10 100 --rows vectorized,reference", 100),
    # No reference row at 1,000 clients: the loop would take minutes a round; the goal is an absolute 0.1 s.
    _speed_run(
        "mlp-1000-float32", "--model mlp --num-clients 1000 --samples 50 --clients-per-round 1000 --rows vectorized", 60
    ),
    _speed_run("lstm-float32", "--model lstm --clients-per-round 10 --rows vectorized,sequential,reference", 60),
    # One client per chunk: the module's own (cuDNN) LSTM, against the batched recurrence above.
    _speed_run("lstm-chunk-1", "--model lstm --clients-per-round 10 --rows vectorized --max-chunk-clients 1", 30),
    _speed_run("resnet18_gn-float32", "--model resnet18_gn --clients-per-round 10 --rows vectorized,reference", 60),
    _speed_run("cnn-tf32", "--model cnn --clients-per-round 10 100 --rows vectorized --precision tf32", 40),
    _speed_run("resnet18_gn-tf32", "--model resnet18_gn --clients-per-round 10 --rows vectorized --precision tf32", 30),
    _speed_run("resnet18_gn-bf16", "--model resnet18_gn --clients-per-round 10 --rows vectorized --precision bf16", 30),
    _speed_run("mlp-tf32", "--model mlp --clients-per-round 10 100 --rows vectorized --precision tf32", 30),
    _speed_run("mlp-bf16", "--model mlp --clients-per-round 10 100 --rows vectorized --precision bf16", 30),
    _speed_run("lstm-tf32", "--model lstm --clients-per-round 10 --rows vectorized --precision tf32", 30),
    _speed_run("lstm-bf16", "--model lstm --clients-per-round 10 --rows vectorized --precision bf16", 30),
    _speed_run("cnn-sequential", "--model cnn --clients-per-round 10 --rows sequential", 40),
]
# Every speed run: 3 timed rounds after a warm-up, rows in one process (each row's GPU peak is reset before it).
SPEED_COMMON = ["--rounds", "3", "--in-process"]
# Seconds the speed runs leave for the precision step.
PRECISION_RESERVE = 75.0  # the step took 50 s on an H200 (2026-11-27)
STEPS = ("environment", "tests", "layers", "speed", "precision")
LAYERS_LIMIT = 90.0  # layer_variants.py keeps to its own 50 s budget, plus start-up and its float64 check
PRECISION_ROUNDS = 40
PRECISIONS = ("float32", "tf32", "bf16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for summary.json and log.txt (created)")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds the whole command may take (default 480)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny steps on whatever device there is: tests this script, numbers mean nothing",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=REPOSITORY / "runs" / "gpu-check",
        help="folder for the precision step's sweep (default runs/gpu-check in the checkout; emptied first)",
    )
    parser.add_argument(
        "--steps",
        default=",".join(STEPS),
        help="comma-separated steps to run; they run in the order " + ", ".join(STEPS),
    )
    return parser.parse_args(argv)


class Budget:
    """The command's deadline: a step gets its own limit, cut to what is left."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def run_step(command: list[str], limit: float, log: Any) -> dict[str, Any]:
    """Run one step's subprocess (its own process group, killed whole at its limit), append its output to the log."""
    started = time.monotonic()
    log.write(f"\n$ {shlex.join(command)}   (limit {limit:.0f} s)\n")
    log.flush()
    process = subprocess.Popen(
        command,
        cwd=REPOSITORY,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=max(1.0, limit))
        status = "passed" if process.returncode == 0 else f"failed (exit {process.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        status = f"timed out after {limit:.0f} s"
    log.write(output or "")
    log.write(f"[{status}; {time.monotonic() - started:.1f} s]\n")
    log.flush()
    return {
        "command": shlex.join(command),
        "status": status,
        "seconds": round(time.monotonic() - started, 1),
        "output": output or "",
    }


def last_json(output: str) -> dict[str, Any] | None:
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def environment(quick: bool) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "commit": os.environ.get("DRIFTLAB_COMMIT") or _git_commit(),
        "quick": quick,
    }
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        info.update(
            gpu=properties.name,
            gpu_count=torch.cuda.device_count(),
            multiprocessors=properties.multi_processor_count,
            gpu_memory_total_gib=round(total / 2**30, 1),
            gpu_memory_free_gib=round(free / 2**30, 1),
            capability=f"{properties.major}.{properties.minor}",
            cudnn=torch.backends.cudnn.version(),
        )
        try:
            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError) as error:
            info["nvidia_smi"] = f"not run: {error}"
    return info


def _git_commit() -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPOSITORY, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None


def speed_summary(label: str, report: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per (round_speed row, clients per round): the numbers the goals are about."""
    if report is None:
        return []
    rows = []
    for entry in report.get("results", []):
        rows.append(
            {
                "run": label,
                "model": report.get("workload", {}).get("model"),
                "precision": report.get("workload", {}).get("precision"),
                "convolution": report.get("workload", {}).get("convolution"),
                "row": entry.get("key"),
                "clients_per_round": entry.get("clients_per_round"),
                "median_seconds": entry.get("median_seconds"),
                "speedup_vs_reference": entry.get("speedup_vs_reference"),
                "peak_gpu_memory_mb": entry.get("peak_gpu_memory_mb"),
                "data": report.get("data"),
            }
        )
    return rows


def precision_sweep(args: argparse.Namespace, budget: Budget, log: Any, cuda: bool) -> dict[str, Any]:
    """float32, tf32 and bf16 on a short real CIFAR-10 run, in one sweep (three runs sharing the GPU)."""
    sys.path.insert(0, str(REPOSITORY))
    from driftlab.experiments.run.datasets import find_data

    if find_data("cifar10-jpeg") is None and not args.quick:
        return {"status": "skipped: no CIFAR-10 JPEG tarball (DRIFTLAB_DATA/cifar10-jpeg)"}
    out = args.work / "precision"
    precisions = PRECISIONS if cuda else ("float32", "bf16")  # tf32 needs CUDA
    if args.quick:
        config = ["demo-synthetic", "rounds=2", "backend=vectorized", f"device={'cuda' if cuda else 'cpu'}"]
    else:
        config = [
            "cifar10-feddyn",
            f"rounds={PRECISION_ROUNDS}",
            "evaluation.every=10",
            "device=cuda",
            "backend=vectorized",
        ]
    command = [
        sys.executable,
        "-m",
        "driftlab.cli",
        "sweep",
        config[0],
        "--out",
        str(out),
        "--no-report",
        "--grid",
        f"precision={','.join(precisions)}",
        "--jobs",
        str(len(precisions)),
        "--threads",
        "1",
        *config[1:],
    ]
    step = run_step(command, budget.left() - 5, log)
    runs = {}
    for metrics in sorted(out.glob("runs/**/metrics.jsonl")):
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        evaluated = [r for r in records if "test_accuracy" in r]
        precision = next((p for p in precisions if p in str(metrics.parent)), str(metrics.parent.relative_to(out)))
        runs[precision] = {
            "rounds": len(records),
            "test_accuracy": [round(r["test_accuracy"], 4) for r in evaluated],
            "median_round_seconds": _median([r["round_seconds"] for r in records if "round_seconds" in r]),
        }
    return {"status": step["status"], "seconds": step["seconds"], "runs": runs}


def layer_rows(report: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per layer variant: its median seconds, speedup over the backend's own layer and largest error (the JSON of
    ``layer_variants.py``, whatever it nests them in)."""
    if report is None:
        return []
    rows = []
    for workload in report.get("workloads", []):
        for variant in workload.get("variants", []):
            rows.append(
                {
                    "workload": workload.get("workload"),
                    "clients": workload.get("clients"),
                    "variant": variant.get("key"),
                    "precision": variant.get("precision"),
                    "status": variant.get("status"),
                    "median_seconds": variant.get("median_seconds"),
                    "speedup_vs_a": variant.get("speedup_vs_a"),
                    "max_relative_error": variant.get("max_relative_error"),
                }
            )
    return rows


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget = Budget(args.budget)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        print(
            f"gpu_check.py: error: --steps: unknown step(s) {', '.join(unknown)}; the steps are {', '.join(STEPS)}",
            file=sys.stderr,
        )
        return 2
    summary: dict[str, Any] = {"steps": {}}
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    with open(args.out / "log.txt", "a") as log:
        if "environment" in steps:
            summary["environment"] = environment(args.quick)
            log.write(json.dumps(summary["environment"], indent=1) + "\n")
        if "tests" in steps:
            parallel = ["-n", "4"] if cuda and _has_module("xdist") else []  # each worker its own CUDA context
            command = [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-o",
                "addopts=",
                "-rfEs",
                *parallel,
                *CUDA_TESTS,
            ]
            step = run_step(command, min(150.0, budget.left() - 5), log)
            tail = step.pop("output").strip().splitlines()
            failures = [line for line in tail if line.startswith(("FAILED", "ERROR"))]
            summary["steps"]["tests"] = {**step, "result": tail[-1] if tail else "", "failures": failures}
        if "layers" in steps:
            if budget.left() < 30:
                summary["steps"]["layers"] = {"status": "skipped: out of the command's time budget"}
            else:
                # which implementation of each batched layer is fastest here (benchmarks/layer_variants.py)
                command = [
                    sys.executable,
                    "benchmarks/layer_variants.py",
                    "--device",
                    device,
                    "--budget",
                    "50",
                    "--json",
                    str(args.out / "layer_variants.json"),
                ]
                if args.quick:
                    command.append("--quick")
                step = run_step(command, min(LAYERS_LIMIT, budget.left() - 5), log)
                report = last_json(step.pop("output"))
                summary["steps"]["layers"] = {**step, "variants": layer_rows(report)}
        if "speed" in steps:
            rows, runs = [], {}
            for label, extra, limit in SPEED_RUNS:
                if args.quick and not label.endswith(("float32", "chunk-1")):
                    continue
                reserve = PRECISION_RESERVE if "precision" in steps and not args.quick else 0.0
                if budget.left() - reserve < 20:
                    runs[label] = {"status": "skipped: out of the command's time budget"}
                    continue
                command = [sys.executable, "benchmarks/round_speed.py", "--device", device, *extra, *SPEED_COMMON]
                if args.quick:
                    model = extra[extra.index("--model") + 1]
                    command = [
                        sys.executable,
                        "benchmarks/round_speed.py",
                        "--device",
                        device,
                        "--model",
                        model,
                        "--quick",
                        "--rows",
                        "vectorized,reference",
                    ]
                limit = max(float(limit), 120.0) if args.quick else float(limit)  # a CPU shared with other work is slow
                step = run_step(command, min(limit, budget.left() - reserve - 5), log)
                report = last_json(step.pop("output"))
                runs[label] = step
                rows.extend(speed_summary(label, report))
            summary["steps"]["speed"] = {"runs": runs, "rows": rows}
        if "precision" in steps:
            if budget.left() < 30:
                summary["steps"]["precision"] = {"status": "skipped: out of the command's time budget"}
            else:
                summary["steps"]["precision"] = precision_sweep(args, budget, log, cuda)
    summary["seconds_left"] = round(budget.left(), 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_table(summary)
    print(json.dumps(summary, separators=(",", ":")))
    return 0


def print_table(summary: dict[str, Any]) -> None:
    env = summary.get("environment", {})
    print(
        f"\n{env.get('gpu', 'no GPU')} | torch {env.get('torch')} (CUDA {env.get('torch_cuda')}) | commit {env.get('commit')}"
    )
    tests = summary["steps"].get("tests")
    if tests:
        print(f"CUDA tests: {tests['status']}: {tests['result']}")
        for failure in tests["failures"]:
            print(f"  {failure}")
    layers = summary["steps"].get("layers")
    if layers:
        print(f"layer variants: {layers['status']}")
        for row in layers.get("variants", []):
            seconds, ratio = row["median_seconds"], row["speedup_vs_a"]
            print(
                f"  {row['workload']:<5}{row['clients']!s:>4} {row['variant']:<14}{row['precision']!s:<8}{row['status']!s:<10}"
                f"{'' if seconds is None else f'{seconds:.4f} s':>10}{'' if ratio is None else f'{ratio:.2f}x':>8}"
            )
    speed = summary["steps"].get("speed")
    if speed:
        print(f"{'run':<22}{'row':<12}{'clients':>8}{'s/round':>10}{'x ref':>8}")
        for row in speed["rows"]:
            seconds, ratio = row["median_seconds"], row["speedup_vs_reference"]
            print(
                f"{row['run']:<22}{str(row['row']):<12}{row['clients_per_round']!s:>8}"
                f"{seconds if seconds is None else f'{seconds:.3f}':>10}{'' if ratio is None else f'{ratio:.1f}':>8}"
            )
        for label, run in speed["runs"].items():
            if run["status"] != "passed":
                print(f"  {label}: {run['status']}")
    precision = summary["steps"].get("precision")
    if precision:
        print(f"precision: {precision.get('status')}")
        for name, run in precision.get("runs", {}).items():
            print(
                f"  {name}: {run['rounds']} rounds, accuracy {run['test_accuracy']}, median {run['median_round_seconds']} s/round"
            )


if __name__ == "__main__":
    sys.exit(main())
