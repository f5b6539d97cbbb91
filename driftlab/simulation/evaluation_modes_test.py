"""Every forward of a run sees the mode its purpose asks for: local steps in training mode, every evaluation in
evaluation mode (server and client-mean models, personal and fine-tuned models, validation rows, the train-loss pass,
dissimilarity, γ-inexact stopping's measurement), on both backends, in FedBuff and with Ditto's personal steps.

A spy layer records ``self.training`` with whether the call comes from a local step (``train_one_client`` or
``train_chunk``, measurements inside them excluded); the runs go through ``driftlab.run(..., model=...)``.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

import driftlab

LOCAL_STEPS = {"train_one_client", "train_chunk"}
# Inside local training but not a step: γ-inexact stopping's full gradients (a measurement, evaluation mode), and the
# vectorized backend's one-batch probe of the vmapped step (a training step it throws away).
NOT_STEPS = {"objective_gradient_norm", "_norm", "vmap_problem", "stacked_problem"}
PROBES = {"vmap_problem", "stacked_problem"}


CALLS: list[tuple[bool, bool, bool]] = []  # module-level: the backends' copies of the spy record here too


class ModeSpy(nn.Module):
    """The identity, recording ``(self.training, from a local step, from a probe)`` at every forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = {frame.function for frame in inspect.stack(context=0)}
        CALLS.append((self.training, bool(frames & LOCAL_STEPS) and not frames & NOT_STEPS, bool(frames & PROBES)))
        return x


TINY = ["rounds=3", "data.num_clients=6", "client.steps=3", "precision=float64", "seed=2"]
CASES = {
    "sequential": [
        "backend=sequential",
        "evaluation.train_loss_clients=0",
        "evaluation.dissimilarity_every=1",
        "client.inexact_gamma=0.9",
        "client.epochs=2",
        "client.steps=none",
    ],
    # γ-inexact stopping's measurement on the vectorized backend: modes_test (a run of it here takes minutes)
    "vectorized": ["backend=vectorized", "evaluation.model=reporting_mean"],
    "finetune": ["backend=vectorized", "evaluation.finetune_steps=2"],
    "ditto": ["backend=sequential", "algorithm.name=ditto", "algorithm.lam=0.5", "evaluation.personal=true"],
    "fedbuff": [
        "backend=vectorized",
        "algorithm.name=fedavg",
        "algorithm.aggregation=uniform",
        "system.profiles=lognormal",
        "asynchronous.concurrency=3",
        "asynchronous.buffer=2",
    ],
}


GIVEN_IN_EVAL_MODE = {"vectorized", "ditto", "fedbuff"}  # a user's module after .eval(): local steps still train


@pytest.mark.parametrize("case", list(CASES))
def test_local_steps_train_and_every_evaluation_evaluates(case):
    spies: list[ModeSpy] = []

    def factory(input_shape, num_classes):
        spy = ModeSpy()
        spies.append(spy)
        torch.manual_seed(0)
        module = nn.Sequential(
            nn.Flatten(),
            nn.Linear(math.prod(input_shape), 16),
            spy,
            nn.Dropout(0.2),
            nn.ReLU(),
            nn.Linear(16, num_classes),
        )
        return module.train(given_training)

    given_training = case not in GIVEN_IN_EVAL_MODE
    CALLS.clear()
    result = driftlab.run(None, model=factory, overrides=[*TINY, *CASES[case]])
    calls = list(CALLS)
    steps = [training for training, step, probe in calls if step]
    others = [training for training, step, probe in calls if not step and not probe]
    assert steps and others  # both kinds ran
    assert all(steps), "a local step ran in evaluation mode"
    assert not any(others), "an evaluation or a measurement ran in training mode"
    assert all(spy.training is given_training for spy in spies)  # the user's module is left in the mode it was given
    record = result.records[-1]
    assert "test_accuracy" in record
    if case == "sequential":
        assert "dissimilarity_b2" in record
    if case in ("finetune", "ditto"):
        assert "personal_test_accuracy_mean" in record


def test_evaluation_is_deterministic_and_reruns_are_bit_identical_with_dropout():
    def factory(input_shape, num_classes):
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Flatten(), nn.Linear(math.prod(input_shape), 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, num_classes)
        )

    runs = {
        backend: [driftlab.run(None, model=factory, overrides=[*TINY, f"backend={backend}"]) for _ in range(2)]
        for backend in ("sequential", "vectorized")
    }
    for first, second in runs.values():
        assert torch.equal(first.final_params, second.final_params)
        assert [r["test_loss"] for r in first.records] == [r["test_loss"] for r in second.records]
    sequential, vectorized = runs["sequential"][0], runs["vectorized"][0]
    assert torch.allclose(sequential.final_params, vectorized.final_params, rtol=1e-12, atol=1e-12)
    for a, b in zip(sequential.records, vectorized.records, strict=True):
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-10)
