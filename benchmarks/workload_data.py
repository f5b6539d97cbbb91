"""The benchmarks' training data: real sets where driftlab finds them, else random rows of their shape, and the files
driftlab reads them back from (MNIST IDX, CIFAR-10 binary, LEAF Shakespeare JSON).

Client ``k`` holds rows ``k·samples ..`` of what ``load_training_data`` returns; ``driftlab_data_section`` writes them
into a folder and gives the ``[data]`` config section that reads exactly those rows, so a driftlab row and the plain
PyTorch reference loop of ``round_speed.py`` train on the same examples.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))  # the driftlab of this checkout, also in the row subprocesses


def _shared_data(name: str) -> Path:
    """Where driftlab looks for a data set (``$DRIFTLAB_DATA/<name>`` when set, else ../shared/data/<name>), so that a
    copy carried to another machine is found as a run finds it."""
    from driftlab.experiments.run.datasets import find_data

    return find_data(name) or REPOSITORY.parent / "shared" / "data" / name


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
    if spec["model"] == "lstm":  # one LEAF user per client: the natural partition gives each its own rows
        write_leaf_shakespeare_directory(directory, inputs, targets, spec["num_clients"])
        return {"name": "shakespeare_leaf", "root": str(directory), "partition": "natural"}
    # balanced IID quotas over rows in order: client k gets rows k·samples .., as the reference loop splits them
    name = "mnist" if spec["model"] == "mlp" else "cifar10"
    (write_idx_directory if name == "mnist" else write_cifar10_directory)(directory, inputs, targets)
    return {
        "name": name,
        "root": str(directory),
        "num_clients": spec["num_clients"],
        "partition": "iid",
        "quotas": "balanced",
    }
