"""Seconds per FedAvg round: driftlab's vectorized and sequential backends against a plain-PyTorch loop.

The standard workload (issue 3): 100 clients x 600 MNIST samples (real MNIST
from ../shared/data/mnist when present, MNIST-shaped random data otherwise),
MLP 784-200-200-10, SGD lr 0.1, batch 50, 5 local epochs, FedAvg, with 10 and
with 100 clients per round.  Rows:

* ``vectorized`` — driftlab, ``backend=vectorized`` (a round's clients trained together);
* ``sequential`` — driftlab, ``backend=sequential`` (clients one by one);
* ``reference``  — a loop written the way the FedDyn authors' code trains
  (``utils_general.train_model`` and the FedAvg driver): for each client a fresh
  model loaded from the server's state dict, a shuffled ``DataLoader`` over the
  client's data, ``torch.optim.SGD``, ``loss.backward()``; the client models
  are flattened to numpy and averaged.  (Their loop also clips gradients at
  norm 10; the workload here has no clipping on any row.)
* ``vmap`` (only with ``--rows``) — driftlab's vectorized backend forced onto
  its generic ``torch.func.vmap(grad(...))`` path, for comparison.

Each row runs in its own subprocess (so its peak RSS is its own), times at
least 5 rounds after a warm-up round, and reports the median seconds per
round, the ratio to the reference, the peak RSS (and its growth over the
process after loading data), and the fraction of this machine's fp32 matmul
throughput (measured here with a large ``torch.mm``) the round achieves,
counting ``6 x parameters x samples`` FLOPs per round.  The last line printed
is one JSON object with every number.

Usage:
    python benchmarks/round_speed.py              # the full benchmark (a few minutes)
    python benchmarks/round_speed.py --quick      # a small smoke run in-process
    python benchmarks/round_speed.py --rows vectorized,vmap,sequential,reference
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPOSITORY = Path(__file__).resolve().parents[1]
MNIST_ROOT = REPOSITORY.parent / "shared" / "data" / "mnist"
ROW_NAMES = {
    "vectorized": "driftlab vectorized",
    "sequential": "driftlab sequential",
    "reference": "PyTorch reference loop",
    "vmap": "driftlab vectorized (vmap path)",
}
DEFAULT_ROWS = ("vectorized", "sequential", "reference")


# ---------------------------------------------------------------- workload


def workload(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "num_clients": args.num_clients,
        "samples_per_client": args.samples,
        "hidden": list(args.hidden),
        "learning_rate": args.lr,
        "batch_size": args.batch_size,
        "local_epochs": args.epochs,
        "algorithm": "fedavg",
        "clients_per_round": list(args.clients_per_round),
        "timed_rounds": args.rounds,
        "warmup_rounds": 1,
        "threads": torch.get_num_threads(),
    }


def load_training_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``num_clients · samples`` MNIST training rows (normalised as the FedDyn code does), or random data of that shape."""
    needed = args.num_clients * args.samples
    if not args.random_data and MNIST_ROOT.is_dir():
        from driftlab.data.idx import load_mnist_tensors

        inputs, targets, _, _ = load_mnist_tensors(MNIST_ROOT)
        if len(targets) >= needed:
            return inputs[:needed].contiguous(), targets[:needed].contiguous(), "mnist"
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(needed, 1, 28, 28, generator=generator)
    targets = torch.randint(0, 10, (needed,), generator=generator)
    return inputs, targets, "random"


def write_idx_directory(directory: Path, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """The rows as (uncompressed) MNIST IDX files, so driftlab loads them through its ordinary ``data.name=mnist`` path.

    Pixels are stored as the uint8 values whose normalisation gives back ``inputs``
    to within the 1/255 quantisation (random data is clipped to the pixel range).
    """
    from driftlab.data.idx import MNIST_MEAN, MNIST_STD

    pixels = ((inputs.squeeze(1) * MNIST_STD + MNIST_MEAN) * 255.0).round().clamp(0, 255).to(torch.uint8).numpy()
    labels = targets.to(torch.uint8).numpy()
    for prefix, count in (("train", len(labels)), ("t10k", min(len(labels), 1000))):
        header = bytes([0, 0, 0x08, 3]) + np.array([count, 28, 28], dtype=">u4").tobytes()
        (directory / f"{prefix}-images-idx3-ubyte").write_bytes(header + pixels[:count].tobytes())
        header = bytes([0, 0, 0x08, 1]) + np.array([count], dtype=">u4").tobytes()
        (directory / f"{prefix}-labels-idx1-ubyte").write_bytes(header + labels[:count].tobytes())


# ---------------------------------------------------------------- rows


def driftlab_rounds(spec: dict[str, Any], inputs: torch.Tensor, targets: torch.Tensor) -> tuple[list[float], int]:
    """Seconds of each round of driftlab FedAvg (engine ``run_round``: sampling, training, aggregation; no evaluation)."""
    from driftlab.experiments.config import load_config
    from driftlab.experiments.runner import build_simulation
    from driftlab.simulation.engine import run_round
    from driftlab.simulation.vectorized import VectorizedBackend

    with tempfile.TemporaryDirectory() as directory:
        write_idx_directory(Path(directory), inputs, targets)
        config = load_config(
            {
                "seed": 0,
                "rounds": 1000,
                "backend": "sequential" if spec["row"] == "sequential" else "vectorized",
                "data": {"name": "mnist", "root": directory, "num_clients": spec["num_clients"], "partition": "iid", "quotas": "balanced"},
                "model": {"name": "mlp", "hidden": spec["hidden"]},
                "algorithm": {"name": "fedavg"},
                "client": {"lr": spec["learning_rate"], "batch_size": spec["batch_size"], "epochs": spec["local_epochs"]},
                "sampling": {"participation": spec["clients_per_round"] / spec["num_clients"]},
            }
        )
        sim, state = build_simulation(config)
    if spec["row"] == "vmap":
        sim.backend = VectorizedBackend(batched_layers=False)
    seconds = []
    for _ in range(1 + spec["timed_rounds"]):
        started = time.perf_counter()
        state, record = run_round(sim, state)
        seconds.append(time.perf_counter() - started)
        assert record["num_reporting"] == spec["clients_per_round"]
    return seconds[1:], sim.model.num_parameters


def reference_rounds(spec: dict[str, Any], inputs: torch.Tensor, targets: torch.Tensor) -> tuple[list[float], int]:
    """Seconds of each round of the FedDyn-style loop (module docstring)."""
    from torch import nn
    from torch.utils import data as torch_data

    from driftlab.models import build_model

    class ClientDataset(torch_data.Dataset):  # the FedDyn code's `Dataset`: tensors made from numpy per loader
        def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
            self.x_data = torch.tensor(x).float()
            self.y_data = torch.tensor(y).long()

        def __len__(self) -> int:
            return len(self.x_data)

        def __getitem__(self, index: int):
            return self.x_data[index], self.y_data[index]

    def model_func() -> nn.Module:
        return build_model("mlp", (1, 28, 28), 10, hidden=tuple(spec["hidden"]))

    def get_mdl_params(model: nn.Module) -> np.ndarray:
        return np.concatenate([p.detach().cpu().numpy().reshape(-1) for p in model.parameters()])

    def set_client_from_params(model: nn.Module, params: np.ndarray) -> None:
        state, offset = copy.deepcopy(dict(model.named_parameters())), 0
        for name, value in state.items():
            count = value.numel()
            state[name].data.copy_(torch.tensor(params[offset : offset + count].reshape(value.shape)))
            offset += count
        model.load_state_dict(state)

    torch.manual_seed(0)
    n, clients = spec["samples_per_client"], spec["num_clients"]
    client_x = [inputs[k * n : (k + 1) * n].numpy() for k in range(clients)]
    client_y = [targets[k * n : (k + 1) * n].numpy() for k in range(clients)]
    weights = np.full(clients, float(n))
    avg_model = model_func()
    rng = np.random.default_rng(0)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    seconds = []
    for _ in range(1 + spec["timed_rounds"]):
        started = time.perf_counter()
        selected = rng.choice(clients, spec["clients_per_round"], replace=False)
        params = []
        for k in selected:
            model = model_func()
            model.load_state_dict(copy.deepcopy(dict(avg_model.named_parameters())))
            loader = torch_data.DataLoader(ClientDataset(client_x[k], client_y[k]), batch_size=spec["batch_size"], shuffle=True)
            optimizer = torch.optim.SGD(model.parameters(), lr=spec["learning_rate"])
            model.train()
            for _epoch in range(spec["local_epochs"]):
                for batch_x, batch_y in loader:
                    loss = loss_fn(model(batch_x), batch_y.reshape(-1).long()) / list(batch_y.size())[0]
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            params.append(get_mdl_params(model))
        stacked = np.stack(params)
        average = np.sum(stacked * weights[selected, None] / np.sum(weights[selected]), axis=0)
        set_client_from_params(avg_model, average)
        seconds.append(time.perf_counter() - started)
    return seconds[1:], sum(p.numel() for p in avg_model.parameters())


def run_row(spec: dict[str, Any], inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> dict[str, Any]:
    """Time one row; when called in its own process, ``peak_rss_mb`` is that process's high-water mark."""
    if inputs is None:
        inputs, targets, _ = load_training_data(argparse.Namespace(**spec["data"]))
    baseline = current_rss_mb()
    rounds = reference_rounds if spec["row"] == "reference" else driftlab_rounds
    seconds, num_parameters = rounds(spec, inputs, targets)
    peak = peak_rss_mb()
    return {"seconds": seconds, "num_parameters": num_parameters, "peak_rss_mb": peak, "peak_rss_growth_mb": max(0.0, peak - baseline)}


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


def current_rss_mb() -> float:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return peak_rss_mb()


def peak_rss_mb() -> float:
    """This process's RSS high-water mark.

    Linux's ``VmHWM`` belongs to the address space, which ``exec`` replaces;
    ``ru_maxrss`` would not do for a subprocess, as Linux carries it over from
    the parent across ``fork``/``exec``.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def matmul_gflops(size: int = 4096, repeats: int = 5) -> float:
    """The best of ``repeats`` fp32 ``torch.mm`` of two ``size x size`` matrices, in GFLOP/s (2·n³ FLOPs each)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up: thread pool, page faults
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


def machine_description() -> dict[str, Any]:
    model_name = platform.processor()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                model_name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {
        "cpu": model_name,
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


# ---------------------------------------------------------------- main


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run: tiny sizes, random data, 2 timed rounds, in-process")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated rows among {', '.join(ROW_NAMES)}")
    parser.add_argument("--clients-per-round", type=int, nargs="+", default=None, help="default: 10 100")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds after one warm-up round (default 5)")
    parser.add_argument("--num-clients", type=int, default=None)
    parser.add_argument("--samples", type=int, default=None, help="samples per client")
    parser.add_argument("--hidden", type=int, nargs="+", default=None)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--random-data", action="store_true", help="MNIST-shaped random data even when MNIST is present")
    parser.add_argument("--in-process", action="store_true", help="run rows in this process (peak memory is then the whole run's)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {
        "clients_per_round": [2] if quick else [10, 100],
        "rounds": 2 if quick else 5,
        "num_clients": 4 if quick else 100,
        "samples": 60 if quick else 600,
        "hidden": [32] if quick else [200, 200],
        "epochs": 1 if quick else 5,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if quick:
        args.random_data = True
        args.in_process = True
    unknown = [row for row in args.rows.split(",") if row not in ROW_NAMES]
    if unknown:
        parser.error(f"unknown rows {unknown}; valid: {', '.join(ROW_NAMES)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table and, as the last line, the JSON report, which is also returned."""
    args = parse_arguments(argv)
    if args.worker:
        print(json.dumps(run_row(json.loads(args.worker))))
        return {}
    inputs, targets, data_kind = load_training_data(args)
    gflops_peak = matmul_gflops(1024 if args.quick else 4096)
    rows = args.rows.split(",")
    order = ["reference"] + [row for row in rows if row != "reference"] if "reference" in rows else rows
    results = []
    for clients_per_round in args.clients_per_round:
        if clients_per_round > args.num_clients:
            raise SystemExit(f"clients per round ({clients_per_round}) exceeds the number of clients ({args.num_clients})")
        by_row: dict[str, dict[str, Any]] = {}
        for row in order:
            spec = {
                "row": row,
                **workload(args),
                "clients_per_round": clients_per_round,
                "data": {"num_clients": args.num_clients, "samples": args.samples, "random_data": data_kind == "random"},
            }
            measured = run_row(spec, inputs, targets) if args.in_process else run_row_in_subprocess(spec)
            median = statistics.median(measured["seconds"])
            flops = 6 * measured["num_parameters"] * clients_per_round * args.samples * args.epochs
            by_row[row] = {
                "row": ROW_NAMES[row],
                "key": row,
                "clients_per_round": clients_per_round,
                "median_seconds": median,
                "round_seconds": measured["seconds"],
                "peak_rss_mb": measured["peak_rss_mb"],
                "peak_rss_growth_mb": measured["peak_rss_growth_mb"],
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
    gflops_after = matmul_gflops(1024 if args.quick else 4096)
    if gflops_after > gflops_peak:
        for entry in results:
            entry["fraction_of_matmul"] = entry["gflops"] / gflops_after
    report = {
        "machine": machine_description(),
        "matmul_gflops": max(gflops_peak, gflops_after),
        "matmul_gflops_before_and_after": [gflops_peak, gflops_after],
        "data": data_kind,
        "workload": workload(args),
        "flops_per_round_counting": "6 x parameters x samples processed",
        "in_process": args.in_process,
        "results": results,
    }
    print_table(report)
    print(json.dumps(report))
    return report


def print_table(report: dict[str, Any]) -> None:
    machine = report["machine"]
    print(f"{machine['cpu']}, {machine['logical_cpus']} CPUs, torch {machine['torch']} ({machine['torch_threads']} threads); "
          f"fp32 matmul {report['matmul_gflops']:.1f} GFLOP/s; data: {report['data']}")
    header = f"{'row':34} {'clients/round':>13} {'s/round':>9} {'x ref time':>10} {'speedup':>8} {'peak RSS MB':>12} {'growth MB':>10} {'GFLOP/s':>8} {'of matmul':>9}"
    print(header)
    print("-" * len(header))
    for entry in report["results"]:
        ratio = "-" if entry["ratio_to_reference"] is None else f"{entry['ratio_to_reference']:.3f}"
        speedup = "-" if entry["speedup_vs_reference"] is None else f"{entry['speedup_vs_reference']:.2f}x"
        print(
            f"{entry['row']:34} {entry['clients_per_round']:>13} {entry['median_seconds']:>9.3f} {ratio:>10} {speedup:>8} "
            f"{entry['peak_rss_mb']:>12.0f} {entry['peak_rss_growth_mb']:>10.0f} {entry['gflops']:>8.1f} {entry['fraction_of_matmul']:>9.1%}"
        )


if __name__ == "__main__":
    main()
