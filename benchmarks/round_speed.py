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
import contextlib
import copy
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))  # the driftlab of this checkout, also in the row subprocesses


def _shared_data(name: str) -> Path:
    """Where driftlab looks for a data set (``$DRIFTLAB_DATA/<name>`` when set, else ../shared/data/<name>), so that a
    copy carried to another machine is found as a run finds it."""
    from driftlab.experiments.run.datasets import find_data

    return find_data(name) or REPOSITORY.parent / "shared" / "data" / name


ROW_NAMES = {
    "vectorized": "driftlab vectorized",
    "sequential": "driftlab sequential",
    "reference": "PyTorch reference loop",
    "vmap": "driftlab vectorized (vmap path)",
    "auto": "driftlab auto",
}
ROW_BACKENDS = {"vectorized": "vectorized", "sequential": "sequential", "vmap": "vectorized", "auto": "auto"}
DEFAULT_ROWS = ("vectorized", "sequential", "reference")

# Per model: the example's shape and classes, and the defaults of the full and of the --quick run
# (clients_per_round per device; steps=None means epochs of local work).
MODELS: dict[str, dict[str, Any]] = {
    "mlp": {
        "input_shape": (1, 28, 28),
        "num_classes": 10,
        "full": {
            "num_clients": 100,
            "samples": 600,
            "batch_size": 50,
            "epochs": 5,
            "steps": None,
            "rounds": 5,
            "clients_per_round": {"cpu": [10, 100], "cuda": [10, 100]},
        },
        "quick": {
            "num_clients": 4,
            "samples": 60,
            "batch_size": 50,
            "epochs": 1,
            "steps": None,
            "rounds": 2,
            "clients_per_round": {"cpu": [2], "cuda": [2]},
        },
    },
    "cnn": {
        "input_shape": (3, 32, 32),
        "num_classes": 10,
        "full": {
            "num_clients": 100,
            "samples": 500,
            "batch_size": 50,
            "epochs": 5,
            "steps": None,
            "rounds": 3,
            "clients_per_round": {"cpu": [10], "cuda": [10, 100]},
        },
        "quick": {
            "num_clients": 4,
            "samples": 20,
            "batch_size": 10,
            "epochs": 1,
            "steps": None,
            "rounds": 2,
            "clients_per_round": {"cpu": [2], "cuda": [2]},
        },
    },
    "lstm": {
        "input_shape": (80,),
        "num_classes": 80,
        "full": {
            "num_clients": 100,
            "samples": 500,
            "batch_size": 50,
            "epochs": None,
            "steps": 10,
            "rounds": 3,
            "clients_per_round": {"cpu": [10], "cuda": [10, 100]},
        },
        "quick": {
            "num_clients": 4,
            "samples": 20,
            "batch_size": 10,
            "epochs": None,
            "steps": 2,
            "rounds": 2,
            "clients_per_round": {"cpu": [2], "cuda": [2]},
        },
    },
    "resnet18_gn": {
        "input_shape": (3, 32, 32),
        "num_classes": 10,
        "full": {
            "num_clients": 20,
            "samples": 100,
            "batch_size": 50,
            "epochs": 1,
            "steps": None,
            "rounds": 3,
            "clients_per_round": {"cpu": [2], "cuda": [10]},
        },
        "quick": {
            "num_clients": 4,
            "samples": 10,
            "batch_size": 5,
            "epochs": 1,
            "steps": None,
            "rounds": 2,
            "clients_per_round": {"cpu": [2], "cuda": [2]},
        },
    },
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


def load_training_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``num_clients · samples`` training rows, client ``k`` holding rows ``k·samples ..``, and what they are.

    Real data where present and large enough (MNIST normalised as the FedDyn code
    does; CIFAR-10's binary version; tiny-shakespeare's largest roles), else
    random data of the same shape and encoding.
    """
    needed = args.num_clients * args.samples
    model = getattr(args, "model", "mlp")
    if model == "mlp":
        return _mnist_rows(args, needed)
    if model == "lstm":
        return _shakespeare_rows(args, needed)
    return _cifar10_rows(args, needed)


def _mnist_rows(args: argparse.Namespace, needed: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    mnist_root = _shared_data("mnist")
    if not args.random_data and mnist_root.is_dir():
        from driftlab.data.idx import load_mnist_tensors

        inputs, targets, _, _ = load_mnist_tensors(mnist_root)
        if len(targets) >= needed:
            return inputs[:needed].contiguous(), targets[:needed].contiguous(), "mnist"
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(needed, 1, 28, 28, generator=generator)
    targets = torch.randint(0, 10, (needed,), generator=generator)
    return inputs, targets, "random"


def _cifar10_rows(args: argparse.Namespace, needed: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    from driftlab.data.images import CIFAR10_MEAN, CIFAR10_STD

    if not args.random_data:
        from driftlab.data.federated import DataFileError
        from driftlab.data.images import load_cifar_tensors
        from driftlab.experiments.run.datasets import default_data_root

        root = default_data_root("cifar10")
        if root.exists():
            try:
                inputs, targets, _, _ = load_cifar_tensors(root, 10)
            except DataFileError:
                inputs = None
            if inputs is not None and len(targets) >= needed:
                return inputs[:needed].contiguous(), targets[:needed].contiguous(), "cifar10"
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (needed, 3, 32, 32), generator=generator, dtype=torch.uint8)
    mean, std = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    inputs = (pixels.to(torch.float32) / 255.0 - mean) / std  # as the CIFAR loader normalises its pixels
    targets = torch.randint(0, 10, (needed,), generator=generator)
    return inputs, targets, "random"


def _shakespeare_rows(args: argparse.Namespace, needed: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    shakespeare_text = _shared_data("tinyshakespeare") / "input.txt.gz"
    if not args.random_data and shakespeare_text.is_file():
        from driftlab.data.shakespeare import load_shakespeare_text

        test_fraction = 0.2
        # floor((1 - test_fraction)·n) training windows per role must cover `samples`
        per_role = math.ceil(args.samples / (1 - test_fraction)) + 1
        dataset = load_shakespeare_text(
            shakespeare_text,
            max_clients=args.num_clients,
            samples_per_client=per_role,
            test_fraction=test_fraction,
            seed=0,
        )
        rows = [np.asarray(indices)[: args.samples] for indices in dataset.client_indices]
        if dataset.num_clients >= args.num_clients and all(len(r) == args.samples for r in rows):
            chosen = torch.as_tensor(np.concatenate(rows), dtype=torch.long)
            return (
                dataset.train_inputs[chosen].long().contiguous(),
                dataset.train_targets[chosen].long().contiguous(),
                "shakespeare",
            )
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 80, (needed, 80), generator=generator)
    targets = torch.randint(0, 80, (needed,), generator=generator)
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


def write_cifar10_directory(directory: Path, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """The rows as CIFAR-10's binary files (``data_batch_1..5.bin`` in order, ``test_batch.bin``), for ``data.name=cifar10``.

    Pixels are the uint8 values whose normalisation gives back ``inputs`` (exactly,
    for rows made from pixels); at least 5 rows, so that no batch file is empty.
    """
    from driftlab.data.images import CIFAR10_MEAN, CIFAR10_STD

    mean, std = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    pixels = ((inputs * std + mean) * 255.0).round().clamp(0, 255).to(torch.uint8).reshape(len(inputs), -1).numpy()
    records = np.concatenate([targets.to(torch.uint8).numpy()[:, None], pixels], axis=1)
    for index, part in enumerate(np.array_split(records, 5), start=1):
        (directory / f"data_batch_{index}.bin").write_bytes(part.tobytes())
    (directory / "test_batch.bin").write_bytes(records[: min(len(records), 1000)].tobytes())


def write_leaf_shakespeare_directory(
    directory: Path, inputs: torch.Tensor, targets: torch.Tensor, num_clients: int
) -> None:
    """The rows as LEAF Shakespeare JSON (``train/`` and ``test/``), one user per client, for ``data.name=shakespeare_leaf``.

    Character ids are written as LEAF's characters, which driftlab encodes back to the same ids.
    """
    from driftlab.data.leaf import LEAF_ALL_LETTERS

    letters = np.array(list(LEAF_ALL_LETTERS))
    windows = ["".join(row) for row in letters[inputs.numpy()]]
    nexts = letters[targets.numpy()].tolist()
    per_client = len(windows) // num_clients
    users = [f"client_{k:04d}" for k in range(num_clients)]
    train = {"users": users, "num_samples": [per_client] * num_clients, "user_data": {}}
    test = {"users": users, "num_samples": [1] * num_clients, "user_data": {}}
    for k, user in enumerate(users):
        rows = slice(k * per_client, (k + 1) * per_client)
        train["user_data"][user] = {"x": windows[rows], "y": nexts[rows]}
        test["user_data"][user] = {"x": windows[rows][:1], "y": nexts[rows][:1]}
    for split, content in (("train", train), ("test", test)):
        (directory / split).mkdir()
        (directory / split / f"all_data_{split}.json").write_text(json.dumps(content))


def driftlab_data_section(
    spec: dict[str, Any], directory: Path, inputs: torch.Tensor, targets: torch.Tensor
) -> dict[str, Any]:
    """Write the rows into ``directory`` and return the ``[data]`` config section that reads them back."""
    if spec["model"] == "mlp":
        write_idx_directory(directory, inputs, targets)
        return {
            "name": "mnist",
            "root": str(directory),
            "num_clients": spec["num_clients"],
            "partition": "iid",
            "quotas": "balanced",
        }
    if spec["model"] == "lstm":
        write_leaf_shakespeare_directory(directory, inputs, targets, spec["num_clients"])
        return {"name": "shakespeare_leaf", "root": str(directory), "partition": "natural"}
    write_cifar10_directory(directory, inputs, targets)
    return {
        "name": "cifar10",
        "root": str(directory),
        "num_clients": spec["num_clients"],
        "partition": "iid",
        "quotas": "balanced",
    }


# ---------------------------------------------------------------- rows


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


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


def reference_rounds(spec: dict[str, Any], inputs: torch.Tensor, targets: torch.Tensor) -> tuple[list[float], int]:
    """Seconds of each round of the FedDyn-style loop (module docstring)."""
    from torch import nn
    from torch.utils import data as torch_data

    device = torch.device(spec["device"])
    token_inputs = not inputs.is_floating_point()

    class ClientDataset(torch_data.Dataset):  # the FedDyn code's `Dataset`: tensors made from numpy per loader
        def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
            self.x_data = torch.tensor(x).long() if token_inputs else torch.tensor(x).float()
            self.y_data = torch.tensor(y).long()

        def __len__(self) -> int:
            return len(self.x_data)

        def __getitem__(self, index: int):
            return self.x_data[index], self.y_data[index]

    def model_func() -> nn.Module:
        return build_zoo_model(spec).to(device)

    def get_mdl_params(model: nn.Module) -> np.ndarray:
        return np.concatenate([p.detach().cpu().numpy().reshape(-1) for p in model.parameters()])

    def set_client_from_params(model: nn.Module, params: np.ndarray) -> None:
        state, offset = copy.deepcopy(dict(model.named_parameters())), 0
        for name, value in state.items():
            count = value.numel()
            state[name].data.copy_(torch.tensor(params[offset : offset + count].reshape(value.shape)).to(device))
            offset += count
        model.load_state_dict(state)

    def batches(loader: torch_data.DataLoader):
        """The FedDyn driver's local work: whole epochs, or a fixed number of steps drawn from reshuffled passes."""
        if spec["local_steps"] is None:
            for _epoch in range(spec["local_epochs"]):
                yield from loader
            return
        done = 0
        while True:
            for batch in loader:
                yield batch
                done += 1
                if done == spec["local_steps"]:
                    return

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
        synchronize(spec["device"])
        started = time.perf_counter()
        selected = rng.choice(clients, spec["clients_per_round"], replace=False)
        params = []
        for k in selected:
            model = model_func()
            model.load_state_dict(copy.deepcopy(dict(avg_model.named_parameters())))
            loader = torch_data.DataLoader(
                ClientDataset(client_x[k], client_y[k]), batch_size=spec["batch_size"], shuffle=True
            )
            optimizer = torch.optim.SGD(model.parameters(), lr=spec["learning_rate"])
            model.train()
            for batch_x, batch_y in batches(loader):
                batch_x, batch_y = batch_x.to(device), batch_y.to(device)
                loss = loss_fn(model(batch_x), batch_y.reshape(-1).long()) / list(batch_y.size())[0]
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            params.append(get_mdl_params(model))
        stacked = np.stack(params)
        average = np.sum(stacked * weights[selected, None] / np.sum(weights[selected]), axis=0)
        set_client_from_params(avg_model, average)
        synchronize(spec["device"])
        seconds.append(time.perf_counter() - started)
    return seconds[1:], sum(p.numel() for p in avg_model.parameters())


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
    rounds = reference_rounds if spec["row"] == "reference" else driftlab_rounds
    seconds, num_parameters = rounds(spec, inputs, targets)
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


def matmul_gflops(size: int = 4096, repeats: int = 5, device: str = "cpu") -> float:
    """The best of ``repeats`` fp32 ``torch.mm`` of two ``size x size`` matrices on ``device``, in GFLOP/s (2·n³ FLOPs each).

    On CUDA this is true fp32 unless the process allowed TF32 (``torch.backends.cuda.matmul.allow_tf32``, off by default).
    """
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    torch.mm(a, b)  # warm-up: thread pool, page faults, CUDA context and kernels
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


def cpu_model_name() -> str:
    model_name = platform.processor()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                model_name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return model_name


def machine_description() -> dict[str, Any]:
    return {
        "cpu": cpu_model_name(),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def device_description(device: str) -> dict[str, Any]:
    """What the rows ran on: the CPU's model and threads, or the GPU's name, memory and CUDA version."""
    if device.startswith("cuda"):
        properties = torch.cuda.get_device_properties(torch.device(device))
        return {
            "type": "cuda",
            "name": properties.name,
            "memory_gib": round(properties.total_memory / 2**30, 1),
            "compute_capability": f"{properties.major}.{properties.minor}",
            "cuda": torch.version.cuda,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            # PyTorch's default (True) lets cuDNN use TF32 in convolutions: the reference loop runs with it, as the
            # authors' code would; driftlab's float32 rows turn it off (precision.local_arithmetic)
            "tf32_cudnn_reference": torch.backends.cudnn.allow_tf32,
            "description": f"{properties.name} ({properties.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda})",
        }
    name, threads = cpu_model_name(), torch.get_num_threads()
    return {
        "type": "cpu",
        "name": name,
        "threads": threads,
        "logical_cpus": os.cpu_count(),
        "description": f"{name}, {threads} torch threads of {os.cpu_count()} logical CPUs",
    }


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


def settle_mlp_options(args: argparse.Namespace, quick: dict[str, Any], full: dict[str, Any]) -> None:
    """The MLP workload's options (async_speed, privacy_overhead): each left unset takes ``quick``'s value under
    --quick, else ``full``'s; --quick also means random data and a hidden layer of 8 (else [200, 200])."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.random_data = args.random_data or args.quick
    args.hidden = [8] if args.quick else [200, 200]


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


def report_head(device: str, data_kind: str) -> dict[str, Any]:
    """The first fields of every benchmark's report: the machine, the device and the data."""
    return {"machine": machine_description(), "device": device_description(device), "data": data_kind}


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
