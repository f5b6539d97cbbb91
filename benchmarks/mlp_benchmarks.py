"""What the benchmarks of the MLP workload of issue 3 share (``async_speed.py``, ``privacy_overhead.py``, and the
option checks of ``round_speed.py``): its options, its driftlab config and data, and the table's printing."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch
from machine_info import report_head
from workload_data import driftlab_data_section, load_training_data

__all__ = [
    "check_at_least_one",
    "mlp_config",
    "mlp_data_section",
    "mlp_workload",
    "print_header",
    "print_mlp_heading",
    "print_row",
    "report_head",
    "set_threads",
    "settle_mlp_options",
]


def set_threads(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Apply ``--threads`` (torch's intra-op threads, every row's) once it is checked."""
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)


def check_at_least_one(parser: argparse.ArgumentParser, args: argparse.Namespace, keys: tuple[str, ...]) -> None:
    """Each of the options ``keys`` that is set must be at least 1."""
    for key in keys:
        if getattr(args, key) is not None and getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1, got {getattr(args, key)}")


def settle_mlp_options(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    quick: dict[str, Any],
    full: dict[str, Any],
) -> None:
    """The MLP workload's options (async_speed, privacy_overhead): each left unset takes ``quick``'s value under
    --quick, else ``full``'s; --quick also means random data and a hidden layer of 8 (else [200, 200]). Every
    option of ``full`` that is a number must then be at least 1 (``check_at_least_one``), and ``--threads`` is applied
    (``set_threads``)."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.random_data = args.random_data or args.quick
    args.hidden = [8] if args.quick else [200, 200]
    check_at_least_one(parser, args, tuple(key for key, value in full.items() if isinstance(value, int)))
    set_threads(parser, args)


def mlp_workload(args: argparse.Namespace) -> dict[str, Any]:
    """The report's description of the MLP workload's model, data and local training (``settle_mlp_options``)."""
    return {
        "model": "mlp",
        "hidden": list(args.hidden),
        "backend": "vectorized",
        "num_clients": args.num_clients,
        "samples_per_client": args.samples,
        "learning_rate": 0.1,
        "batch_size": 50,
        "local_epochs": args.epochs,
    }


def mlp_config(args: argparse.Namespace, data_section: dict[str, Any], rounds: int) -> dict[str, Any]:
    """The driftlab config of the MLP workload (``mlp_workload``) over ``data_section``: seed 0, the vectorized
    backend, FedAvg with uniform aggregation; ``rounds`` only bounds how many rounds the timing may run."""
    return {
        "seed": 0,
        "rounds": rounds,
        "backend": "vectorized",
        "data": data_section,
        "model": {"name": "mlp", "hidden": list(args.hidden)},
        "algorithm": {"name": "fedavg", "aggregation": "uniform"},
        "client": {"lr": 0.1, "batch_size": 50, "epochs": args.epochs},
    }


@contextlib.contextmanager
def mlp_data_section(args: argparse.Namespace) -> Iterator[tuple[dict[str, Any], str]]:
    """The MLP workload's ``[data]`` section over files written to a temporary folder (removed on exit), and what
    the data are ("mnist" or "random")."""
    spec = argparse.Namespace(
        model="mlp", num_clients=args.num_clients, samples=args.samples, random_data=args.random_data
    )
    inputs, targets, data_kind = load_training_data(spec)
    with tempfile.TemporaryDirectory() as directory:
        yield (
            driftlab_data_section({"model": "mlp", "num_clients": args.num_clients}, Path(directory), inputs, targets),
            data_kind,
        )


def print_mlp_heading(report: dict[str, Any], settings: str) -> None:
    """The first two lines of an MLP workload's table (``mlp_workload``, ``report_head``): model, device, torch and
    load; data and local training, then the benchmark's own ``settings``."""
    work, machine, device = report["workload"], report["machine"], report["device"]
    load = machine["load_average_1min"]
    print(f"mlp {work['hidden']} on {device['description']}; torch {machine['torch']}; load average {load}")
    print(
        f"data: {report['data']}, {work['num_clients']} clients x {work['samples_per_client']}, "
        f"batch {work['batch_size']}, {work['local_epochs']} local epochs; {settings}"
    )


def print_row(cells: list[str], widths: list[int]) -> None:
    """One row of a table, each cell right-aligned to its column's width."""
    print(" ".join(f"{cell:>{width}}" for cell, width in zip(cells, widths, strict=True)))


def print_header(columns: list[str], widths: list[int]) -> None:
    """A table's column names (``print_row``) and a rule under them."""
    header = " ".join(f"{name:>{width}}" for name, width in zip(columns, widths, strict=True))
    print(header)
    print("-" * len(header))
