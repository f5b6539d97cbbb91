"""Seconds per FedAvg round: driftlab's backends against a plain-PyTorch loop, for each zoo workload of issue 12, on CPU or CUDA.

Workloads (``--model``; every size is a flag, the defaults are these):

* ``mlp`` — the standard workload of issue 3: 100 clients x 600 MNIST samples
  (real MNIST from ../shared/data/mnist when present), MLP 784-200-200-10, SGD
  lr 0.1, batch 50, 5 local epochs, with 10 and with 100 clients per round;
* ``cnn`` — FedDyn's CIFAR-10 CNN (zoo ``cnn``, 3x32x32 inputs, 10 classes):
  100 clients x 500 images, batch 50, 5 local epochs, lr 0.1, 10 clients per
  round (10 and 100 with ``--device cuda``);
* ``lstm`` — FedDyn's Shakespeare char-LSTM (zoo ``lstm``: embedding 8, two
  LSTM layers of 100, 80-character windows, vocabulary 80): 100 clients x 500
  windows (real tiny-shakespeare roles from ../shared/data/tinyshakespeare when
  present), 10 local steps of batch 50 per client, lr 0.1, 10 clients per round;
* ``resnet18_gn`` — ResNet-18 with GroupNorm(2) (zoo ``resnet18_gn``, CIFAR stem,
  width 64), a small default that finishes on a CPU: 20 clients x 100 images,
  batch 50, 1 local epoch, 2 clients per round (10 with ``--device cuda``).

The CIFAR-shaped workloads read CIFAR-10's binary version where driftlab finds
it (``data.name=cifar10``'s usual places).  A real set that is absent or too
small for the workload is replaced by random data of its shape and encoding
(``--random-data`` forces that), and the report says which (``data``).  FedAvg
throughout, no clipping, no weight decay.  Rows (``--rows``, default ``vectorized,sequential,reference``):

* ``vectorized`` — driftlab, ``backend=vectorized`` (a round's clients trained together);
* ``sequential`` — driftlab, ``backend=sequential`` (clients one by one);
* ``reference``  — a loop written the way the FedDyn authors' code trains
  (``utils_general.train_model`` and the FedAvg driver): for each client a fresh
  model loaded from the server's state dict, a shuffled ``DataLoader`` over a
  ``Dataset`` built from the client's numpy arrays, ``torch.optim.SGD``,
  ``loss.backward()``; the client models are flattened to numpy and averaged.
  (Their loop also clips gradients at norm 10; no row clips here.)  With
  ``--device cuda`` the model lives on the GPU and each batch is copied there
  from the host, as their code does;
* ``vmap`` (only with ``--rows``) — driftlab's vectorized backend forced onto
  its generic ``torch.func.vmap(grad(...))`` path, for comparison;
* ``auto`` (only with ``--rows``) — driftlab, ``backend=auto``: whatever the
  engine picks for this model and device.

The driftlab rows go through driftlab's public API: the data are written in a
format driftlab reads (MNIST IDX, CIFAR-10 binary, LEAF Shakespeare JSON), a
config is validated by ``load_config`` and built by ``build_simulation``, and
``engine.run_round`` is timed (sampling, training, aggregation; no
evaluation); with ``--device cuda`` the config says ``device=cuda``, so
driftlab keeps the data on the GPU.

Each row runs in its own subprocess (so its peak RSS is its own), times
``--rounds`` rounds (default 5 for mlp, 3 otherwise) after a warm-up round,
and reports the median seconds per round, the speedup over the reference,
the peak RSS (and its growth over the process after loading data; on CUDA also
the peak GPU memory), and the fraction of this machine's fp32 matmul
throughput (a large ``torch.mm``, measured before and after the rows; the
higher is used) the round achieves.  FLOPs per round = 3 x forward FLOPs per
example x examples processed (clients x epochs x samples, or clients x steps x
batch), where the forward FLOPs of one example are counted by
``torch.utils.flop_counter.FlopCounterMode`` on a CPU copy of the model with
oneDNN off (so that ``nn.LSTM`` runs as matrix products the counter sees;
only matmuls and convolutions count), and 3 stands for forward plus backward.
With ``--device cuda`` the timed region starts and ends with
``torch.cuda.synchronize()`` and the report names the GPU.  The last line
printed is one JSON object with every number: ``results`` (one entry per row
and clients-per-round with ``key``, ``clients_per_round``, ``median_seconds``,
``speedup_vs_reference``, ...), ``device`` (the CPU's model and threads, or
the GPU's name), ``machine``, ``workload``, ``data`` and the matmul figures.

Usage:
    python benchmarks/round_speed.py                      # MLP, the three rows of issue 3 (a few minutes)
    python benchmarks/round_speed.py --model cnn          # FedDyn's CIFAR-10 CNN (long on a CPU: try --epochs 1)
    python benchmarks/round_speed.py --model lstm         # FedDyn's Shakespeare LSTM
    python benchmarks/round_speed.py --model resnet18_gn  # a small ResNet-18-GN round
    python benchmarks/round_speed.py --model cnn --device cuda   # on a GPU: 10 and 100 clients per round
    python benchmarks/round_speed.py --rows vectorized,vmap,auto,sequential,reference --rounds 3
    python benchmarks/round_speed.py --model lstm --threads 1   # every row (and the matmul figure) on one thread
    python benchmarks/round_speed.py --quick --model lstm # a small smoke run in-process, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

# beside this file (its directory leads sys.path when run as a script, and in the tests): the data, the machine, the
# options the MLP benchmarks share, and the reference loop; workload_data puts this checkout's driftlab on the path
from machine_info import (
    current_rss_mb,
    device_description,
    machine_description,
    matmul_gflops,
    peak_rss_mb,
    synchronize,
)
from mlp_benchmarks import check_at_least_one, set_threads
from reference_loop import reference_rounds
from workload_data import REPOSITORY, driftlab_data_section, load_training_data

ROW_NAMES = {
    "vectorized": "driftlab vectorized",
    "sequential": "driftlab sequential",
    "reference": "PyTorch reference loop",
    "vmap": "driftlab vectorized (vmap path)",
    "auto": "driftlab auto",
}
ROW_BACKENDS = {"vectorized": "vectorized", "sequential": "sequential", "vmap": "vectorized", "auto": "auto"}
DEFAULT_ROWS = ("vectorized", "sequential", "reference")


def _sizes(
    num_clients: int,
    samples: int,
    batch_size: int,
    epochs: int | None,
    steps: int | None,
    rounds: int,
    cpu: tuple[int, ...] = (2,),
    cuda: tuple[int, ...] = (2,),
) -> dict[str, Any]:
    """One run's defaults: local work is ``epochs`` (``steps`` None) or ``steps``; clients per round per device."""
    return {
        "num_clients": num_clients,
        "samples": samples,
        "batch_size": batch_size,
        "epochs": epochs,
        "steps": steps,
        "rounds": rounds,
        "clients_per_round": {"cpu": list(cpu), "cuda": list(cuda)},
    }


# model: the example's shape, the classes, then the defaults of the full run and of the --quick run (``_sizes``:
# clients, samples per client, batch, local epochs, local steps, timed rounds, clients per round on CPU and on CUDA)
_WORKLOADS = {
    "mlp": ((1, 28, 28), 10, _sizes(100, 600, 50, 5, None, 5, (10, 100), (10, 100)), _sizes(4, 60, 50, 1, None, 2)),
    "cnn": ((3, 32, 32), 10, _sizes(100, 500, 50, 5, None, 3, (10,), (10, 100)), _sizes(4, 20, 10, 1, None, 2)),
    "lstm": ((80,), 80, _sizes(100, 500, 50, None, 10, 3, (10,), (10, 100)), _sizes(4, 20, 10, None, 2, 2)),
    "resnet18_gn": ((3, 32, 32), 10, _sizes(20, 100, 50, 1, None, 3, (2,), (10,)), _sizes(4, 10, 5, 1, None, 2)),
}
MODELS: dict[str, dict[str, Any]] = {
    name: {"input_shape": shape, "num_classes": classes, "full": full, "quick": quick}
    for name, (shape, classes, full, quick) in _WORKLOADS.items()
}


# ---------------------------------------------------------------- workload


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of ``build_model`` (and keys of the ``[model]`` config section) besides name, shape and classes."""
    if args.model == "mlp":
        return {"hidden": list(args.hidden)}
    if args.model == "resnet18_gn":
        return {"width": args.width}
    return {}


def workload(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "model_options": model_options(args),
        "device": args.device,
        "num_clients": args.num_clients,
        "samples_per_client": args.samples,
        "hidden": list(args.hidden),  # the mlp's (ignored by the other models); kept for the reports of issue 3
        "learning_rate": args.lr,
        "batch_size": args.batch_size,
        "local_epochs": args.epochs,
        "local_steps": args.steps,
        "algorithm": "fedavg",
        "precision": args.precision,
        "convolution": args.convolution,
        "max_chunk_clients": args.max_chunk_clients,
        "clients_per_round": list(args.clients_per_round),
        "timed_rounds": args.rounds,
        "warmup_rounds": 1,
        "threads": torch.get_num_threads(),
    }


def examples_per_client(spec: dict[str, Any]) -> int:
    """Examples one client's local work processes in a round (``samples`` is a multiple of the batch in the defaults)."""
    if spec["local_steps"] is not None:
        return spec["local_steps"] * spec["batch_size"]
    return spec["local_epochs"] * spec["samples_per_client"]


# ---------------------------------------------------------------- rows


def driftlab_rounds(spec: dict[str, Any], inputs: torch.Tensor, targets: torch.Tensor) -> tuple[list[float], int]:
    """Seconds of each round of driftlab FedAvg (engine ``run_round``: sampling, training, aggregation; no evaluation)."""
    from driftlab.experiments.config import load_config
    from driftlab.experiments.run.assembly import build_simulation
    from driftlab.simulation.backends.vectorized import VectorizedBackend
    from driftlab.simulation.round.engine import run_round

    work = {"steps": spec["local_steps"]} if spec["local_steps"] is not None else {"epochs": spec["local_epochs"]}
    with tempfile.TemporaryDirectory() as directory:
        config = load_config(
            {
                "seed": 0,
                "rounds": 1000,
                "device": spec["device"],
                "precision": spec.get("precision", "float32"),
                "convolution": spec.get("convolution", "grouped"),
                "backend": ROW_BACKENDS[spec["row"]],
                "data": driftlab_data_section(spec, Path(directory), inputs, targets),
                "model": {"name": spec["model"], **spec["model_options"]},
                "algorithm": {"name": "fedavg"},
                "client": {"lr": spec["learning_rate"], "batch_size": spec["batch_size"], **work},
                "sampling": {"participation": spec["clients_per_round"] / spec["num_clients"]},
            }
        )
        sim, state = build_simulation(config)
    if spec["row"] == "vmap":
        sim.backend = VectorizedBackend(batched_layers=False, precision=spec.get("precision", "float32"))
    if spec.get("max_chunk_clients") and isinstance(sim.backend, VectorizedBackend):
        sim.backend.max_chunk_clients = spec["max_chunk_clients"]
    seconds = []
    for _ in range(1 + spec["timed_rounds"]):
        synchronize(spec["device"])
        started = time.perf_counter()
        state, record = run_round(sim, state)
        synchronize(spec["device"])
        seconds.append(time.perf_counter() - started)
        assert record["num_reporting"] == spec["clients_per_round"]
    return seconds[1:], sim.model.num_parameters


def build_zoo_model(spec: dict[str, Any]) -> torch.nn.Module:
    from driftlab.models import build_model

    shape, classes = MODELS[spec["model"]]["input_shape"], MODELS[spec["model"]]["num_classes"]
    options = dict(spec["model_options"])
    if "hidden" in options:
        options["hidden"] = tuple(options["hidden"])
    return build_model(spec["model"], shape, classes, **options)


def run_row(
    spec: dict[str, Any], inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None
) -> dict[str, Any]:
    """Time one row; when called in its own process, ``peak_rss_mb`` is that process's high-water mark."""
    if inputs is None:
        inputs, targets, _ = load_training_data(argparse.Namespace(**spec["data"]))
    torch.set_num_threads(spec["threads"])  # a subprocess uses the parent's thread count (--threads)
    cuda = spec["device"].startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    baseline = current_rss_mb()
    if spec["row"] == "reference":
        seconds, num_parameters = reference_rounds(spec, inputs, targets, lambda: build_zoo_model(spec))
    else:
        seconds, num_parameters = driftlab_rounds(spec, inputs, targets)
    peak = peak_rss_mb()
    return {
        "seconds": seconds,
        "num_parameters": num_parameters,
        "peak_rss_mb": peak,
        "peak_rss_growth_mb": max(0.0, peak - baseline),
        "peak_gpu_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
    }


def run_row_in_subprocess(spec: dict[str, Any]) -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
        cwd=str(REPOSITORY),
    )
    if completed.returncode != 0:
        raise RuntimeError(f"row {spec['row']} failed:\n{completed.stderr[-4000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- machine


def forward_flops_per_example(spec: dict[str, Any]) -> float:
    """Forward FLOPs of one example (matmuls and convolutions), counted by ``FlopCounterMode`` on a CPU copy of the model.

    oneDNN is off while counting: its fused ``nn.LSTM`` kernel would hide the
    recurrent matrix products from the counter (which then sees only the output layer).
    """
    from torch.utils.flop_counter import FlopCounterMode

    model = build_zoo_model(spec)
    shape, classes = MODELS[spec["model"]]["input_shape"], MODELS[spec["model"]]["num_classes"]
    batch = 2
    generator = torch.Generator().manual_seed(0)
    if spec["model"] == "lstm":
        example = torch.randint(0, classes, (batch, *shape), generator=generator)
    else:
        example = torch.randn(batch, *shape, generator=generator)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about oneDNN's TF32 setting when its flags are touched
        with torch.no_grad(), torch.backends.mkldnn.flags(enabled=False), FlopCounterMode(display=False) as counter:
            model(example)
    return counter.get_total_flops() / batch


# ---------------------------------------------------------------- main


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", choices=tuple(MODELS), default="mlp", help="workload (module docstring); default mlp"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every row trains; default cpu")
    parser.add_argument(
        "--quick", action="store_true", help="small smoke run: tiny sizes, random data, 2 timed rounds, in-process"
    )
    parser.add_argument(
        "--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated rows among {', '.join(ROW_NAMES)}"
    )
    parser.add_argument(
        "--clients-per-round",
        type=int,
        nargs="+",
        default=None,
        help="default: per model and device (module docstring)",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds after one warm-up round (default 5 for mlp, 3 otherwise)"
    )
    parser.add_argument("--num-clients", type=int, default=None)
    parser.add_argument("--samples", type=int, default=None, help="samples per client")
    parser.add_argument("--hidden", type=int, nargs="+", default=None, help="mlp hidden widths (default 200 200)")
    parser.add_argument("--width", type=int, default=None, help="resnet18_gn base width (default 64)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None, help="local epochs (default 5; lstm: --steps)")
    parser.add_argument("--steps", type=int, default=None, help="local steps instead of epochs (lstm default 10)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument(
        "--max-chunk-clients",
        type=int,
        default=None,
        help="clients per chunk of the vectorized rows (default: the backend's own, docs/performance.md)",
    )
    parser.add_argument(
        "--precision",
        choices=("float32", "tf32", "bf16"),
        default="float32",
        help="driftlab rows' local-step arithmetic (config key precision; tf32 needs cuda); the reference row stays float32",
    )
    parser.add_argument(
        "--convolution",
        choices=("grouped", "unfold"),
        default="grouped",
        help="how driftlab rows' batched layers compute convolutions (config key convolution): one grouped convolution, or "
        "im2col and a matrix product per client; the reference row is unchanged",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads of every row and of the matmul figure (default: torch's)",
    )
    parser.add_argument(
        "--random-data",
        action="store_true",
        help="random data of the workload's shape even when the real set is present",
    )
    parser.add_argument(
        "--in-process", action="store_true", help="run rows in this process (peak memory is then the whole run's)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"round_speed.py: error: --device cuda, but torch {torch.__version__} sees no CUDA device on this machine; "
            "use --device cpu",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if args.epochs is not None and args.steps is not None:
        parser.error("give either --epochs or --steps, not both")
    if args.precision == "tf32" and args.device != "cuda":
        parser.error(
            "--precision tf32 needs --device cuda (TensorFloat-32 is a GPU format); on a CPU use float32 or bf16"
        )
    set_threads(parser, args)
    quick = args.quick
    defaults = dict(MODELS[args.model]["quick" if quick else "full"])
    defaults["clients_per_round"] = defaults["clients_per_round"][args.device]
    if args.epochs is not None or args.steps is not None:
        defaults["epochs"] = defaults["steps"] = None
    defaults["hidden"] = [32] if quick else [200, 200]
    defaults["width"] = 8 if quick else 64
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if quick:
        args.random_data = True
        args.in_process = True
    unknown = [row for row in args.rows.split(",") if row not in ROW_NAMES]
    if unknown:
        parser.error(f"unknown rows {unknown}; valid: {', '.join(ROW_NAMES)}")
    check_at_least_one(parser, args, ("num_clients", "samples", "batch_size", "rounds", "width"))
    check_at_least_one(parser, args, ("epochs", "steps", "max_chunk_clients"))
    if args.model in ("cnn", "resnet18_gn") and args.num_clients * args.samples < 5:
        parser.error("CIFAR-shaped workloads need at least 5 rows in all (--num-clients x --samples)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table and, as the last line, the JSON report, which is also returned."""
    args = parse_arguments(argv)
    if args.worker:
        print(json.dumps(run_row(json.loads(args.worker))))
        return {}
    for clients_per_round in args.clients_per_round:
        if clients_per_round > args.num_clients:
            raise SystemExit(
                f"clients per round ({clients_per_round}) exceeds the number of clients ({args.num_clients})"
            )
    inputs, targets, data_kind = load_training_data(args)
    matmul_size = 1024 if args.quick else (8192 if args.device == "cuda" else 4096)
    gflops_peak = matmul_gflops(matmul_size, device=args.device)
    rows = args.rows.split(",")
    order = ["reference"] + [row for row in rows if row != "reference"] if "reference" in rows else rows
    flops_per_example = 3 * forward_flops_per_example(workload(args))
    results = []
    for clients_per_round in args.clients_per_round:
        by_row: dict[str, dict[str, Any]] = {}
        for row in order:
            spec = {
                "row": row,
                **workload(args),
                "clients_per_round": clients_per_round,
                "data": {
                    "model": args.model,
                    "num_clients": args.num_clients,
                    "samples": args.samples,
                    "random_data": data_kind == "random",
                },
            }
            measured = run_row(spec, inputs, targets) if args.in_process else run_row_in_subprocess(spec)
            median = statistics.median(measured["seconds"])
            flops = flops_per_example * clients_per_round * examples_per_client(spec)
            by_row[row] = {
                "row": ROW_NAMES[row],
                "key": row,
                "clients_per_round": clients_per_round,
                "median_seconds": median,
                "round_seconds": measured["seconds"],
                "peak_rss_mb": measured["peak_rss_mb"],
                "peak_rss_growth_mb": measured["peak_rss_growth_mb"],
                "peak_gpu_memory_mb": measured["peak_gpu_memory_mb"],
                "gflops": flops / median / 1e9,
                "fraction_of_matmul": flops / median / 1e9 / gflops_peak,
            }
            print(f"  measured {ROW_NAMES[row]} at {clients_per_round} clients/round: {median:.3f} s", file=sys.stderr)
        reference = by_row.get("reference")
        for row in rows:
            entry = by_row[row]
            entry["ratio_to_reference"] = entry["median_seconds"] / reference["median_seconds"] if reference else None
            entry["speedup_vs_reference"] = reference["median_seconds"] / entry["median_seconds"] if reference else None
            results.append(entry)
    # Other processes on a small machine make a single throughput measurement unreliable: measure again
    # after the rows and keep the higher (the fractions below then are, if anything, underestimates).
    gflops_after = matmul_gflops(matmul_size, device=args.device)
    if gflops_after > gflops_peak:
        for entry in results:
            entry["fraction_of_matmul"] = entry["gflops"] / gflops_after
    report = {
        "machine": machine_description(),
        "device": device_description(args.device),
        "matmul_gflops": max(gflops_peak, gflops_after),
        "matmul_gflops_before_and_after": [gflops_peak, gflops_after],
        "data": data_kind,
        "workload": workload(args),
        "flops_per_example": flops_per_example,
        "flops_per_round_counting": "3 x forward FLOPs per example (torch.utils.flop_counter, matmuls and convolutions) x examples processed",
        "in_process": args.in_process,
        "results": results,
    }
    print_table(report)
    print(json.dumps(report))
    return report


def print_table(report: dict[str, Any]) -> None:
    machine, device, work = report["machine"], report["device"], report["workload"]
    count, unit = (work["local_steps"], "step") if work["local_steps"] is not None else (work["local_epochs"], "epoch")
    local_work = f"{count} local {unit}{'s' if count != 1 else ''}"
    print(
        f"{work['model']} on {device['description']}; torch {machine['torch']}; fp32 matmul {report['matmul_gflops']:.1f} GFLOP/s; "
        f"data: {report['data']}, {work['num_clients']} clients x {work['samples_per_client']}, batch {work['batch_size']}, {local_work}"
    )
    gpu = device["type"] == "cuda"
    header = (
        f"{'row':34} {'clients/round':>13} {'s/round':>9} {'x ref time':>10} {'speedup':>8} {'peak RSS MB':>12} {'growth MB':>10}"
        + (f" {'GPU MB':>8}" if gpu else "")
        + f" {'GFLOP/s':>8} {'of matmul':>9}"
    )
    print(header)
    print("-" * len(header))
    for entry in report["results"]:
        ratio = "-" if entry["ratio_to_reference"] is None else f"{entry['ratio_to_reference']:.3f}"
        speedup = "-" if entry["speedup_vs_reference"] is None else f"{entry['speedup_vs_reference']:.2f}x"
        gpu_memory = f" {entry['peak_gpu_memory_mb']:>8.0f}" if gpu else ""
        print(
            f"{entry['row']:34} {entry['clients_per_round']:>13} {entry['median_seconds']:>9.3f} {ratio:>10} {speedup:>8} "
            f"{entry['peak_rss_mb']:>12.0f} {entry['peak_rss_growth_mb']:>10.0f}{gpu_memory} {entry['gflops']:>8.1f} {entry['fraction_of_matmul']:>9.1%}"
        )


if __name__ == "__main__":
    main()
