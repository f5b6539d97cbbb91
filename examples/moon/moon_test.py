"""The MOON example: its term is the paper's loss on the outputs, both backends train it alike, and a sweep of it
runs from the repository root with no install and reports it beside FedAvg."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from driftlab.experiments.sweep.testing import sweep_command
from driftlab.models import build_model
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import (
    ClientTask,
    LocalSettings,
    SequentialBackend,
    TrainingData,
    batch_plan,
)
from driftlab.simulation.backends.objectives import LocalBatch
from driftlab.simulation.backends.vectorized import VectorizedBackend
from driftlab.simulation.seam import ClientContext

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def _moon():
    if "moon" in sys.modules and Path(sys.modules["moon"].__file__).resolve() == HERE / "moon.py":
        return sys.modules["moon"]  # pytest's doctest run imported it already
    spec = importlib.util.spec_from_file_location("moon", HERE / "moon.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["moon"] = module
    spec.loader.exec_module(module)
    return module


def test_the_term_is_the_papers_contrastive_loss_on_the_outputs():
    moon = _moon()
    generator = torch.Generator().manual_seed(0)
    z, z_global, z_previous = (torch.randn(3, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    models = {1: z_global, 2: z_previous}
    batch = LocalBatch(
        torch.zeros(1),
        z,
        torch.zeros(3, 1),
        torch.zeros(3),
        torch.full((3,), 1 / 3, dtype=torch.float64),
        lambda p, x: models[int(p)],
    )
    value = moon.contrastive_term(mu=2.0, temperature=0.5)(batch, torch.tensor(1), torch.tensor(2))
    expected = 0.0
    for i in range(3):
        positive = math.exp(float(torch.cosine_similarity(z[i], z_global[i], dim=0)) / 0.5)
        negative = math.exp(float(torch.cosine_similarity(z[i], z_previous[i], dim=0)) / 0.5)
        expected += -math.log(positive / (positive + negative)) / 3
    assert float(value) == pytest.approx(2.0 * expected, rel=1e-12)


def test_a_round_of_moon_clients_trains_alike_on_both_backends():
    moon = _moon()
    torch.manual_seed(0)
    model = FlatModel.wrap(build_model("mlp", (6,), 4, hidden=(8,))).to("cpu", torch.float64)
    start = model.initial_parameters()
    algorithm = moon.build(make_server_optimizer("sgd"), mu=1.0, temperature=0.5)
    view = algorithm.broadcast(algorithm.server_init(start))  # what the clients receive: view.params, θ^{t−1}
    generator = torch.Generator().manual_seed(1)
    data = TrainingData(
        torch.randn(40, 6, generator=generator, dtype=torch.float64), torch.randint(0, 4, (40,), generator=generator)
    )
    tasks = []
    for k, size in enumerate((15, 25)):
        previous = moon.ClientState(
            start + 0.1 * torch.randn(start.shape, generator=generator, dtype=torch.float64)
        )  # clients that trained before
        context = ClientContext(k, 1, size, 20.0, 2, 6, 0.1)
        objective = algorithm.client_objective(view, previous, context)
        tasks.append(
            ClientTask(k, torch.arange(15 * k, 15 * k + size), batch_plan(0, 1, k, size, 5, 6 - 2 * k), objective)
        )
    settings = LocalSettings(0.1)
    expected = {p: (t.clone(), d) for p, t, d in SequentialBackend().train(model, start, tasks, settings, data)}
    actual = {p: (t.clone(), d) for p, t, d in VectorizedBackend().train(model, start, tasks, settings, data)}
    plain_tasks = [ClientTask(t.client_id, t.sample_indices, t.batches, t.correction.correction) for t in tasks]
    plain = {p: t.clone() for p, t, _ in SequentialBackend().train(model, start, plain_tasks, settings, data)}
    for position, (params, done) in expected.items():
        assert actual[position][1] == done
        torch.testing.assert_close(actual[position][0], params, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(params, plain[position])  # the term did something


@pytest.mark.slow
def test_the_sweep_runs_from_the_repository_root_and_reports(tmp_path):
    out = tmp_path / "out"
    command = sweep_command("examples/moon/sweep.toml", "--out", str(out), "--seeds", "0", "--jobs", "1", "rounds=2")
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "runs/moon-outputs/seed-0/config.json").read_text())
    assert config["algorithm"]["name"] == "moon" and [Path(p).name for p in config["plugins"]] == ["moon.py"]
    assert (out / "runs/moon-outputs/seed-0/final_model.safetensors").read_bytes() != (
        out / "runs/fedavg/seed-0/final_model.safetensors"
    ).read_bytes()
    assert "| MOON (outputs) | 1 |" in (out / "report" / "report.md").read_text()
