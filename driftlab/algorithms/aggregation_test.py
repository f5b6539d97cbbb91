"""Running means: hand-computed sums, the fold and the list form agree bit for bit, bad weights get clear errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from driftlab.algorithms.aggregation import (
    RunningMean,
    check_aggregation,
    client_weight,
    model_mean_fold,
    weighted_mean,
)
from driftlab.simulation.seam import RoundContext


def test_running_mean_is_the_weighted_sum_divided_once():
    mean = RunningMean().add(torch.tensor([1.0, 2.0]), 3.0).add(torch.tensor([5.0, -2.0]), 1.0)
    assert mean.weight == 4.0
    assert torch.equal(mean.total, torch.tensor([8.0, 4.0]))  # 3·(1, 2) + (5, −2)
    assert torch.equal(mean.value(), torch.tensor([2.0, 1.0]))


def test_list_form_equals_the_fold_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    vectors = [torch.randn(1000, generator=generator) for _ in range(7)]
    weights = [float(n) for n in (13, 7, 1, 250, 3, 3, 90)]
    fold = RunningMean()
    for vector, weight in zip(vectors, weights, strict=True):
        fold = fold.add(vector, weight)
    assert torch.equal(weighted_mean(vectors, weights), fold.value())
    # the order fixes the rounding: the mean is a sum in the order given, then one division
    expected = weights[0] * vectors[0]
    for vector, weight in zip(vectors[1:], weights[1:], strict=True):
        expected = expected + weight * vector
    assert torch.equal(fold.value(), expected / sum(weights))


def test_client_weights_follow_the_mode_and_count_multiplicity():
    assert client_weight(40, 1, "weighted") == 40.0
    assert client_weight(40, 2, "weighted") == 80.0  # drawn twice: weighs as two draws
    assert client_weight(40, 2, "uniform") == 2.0
    with pytest.raises(ValueError, match="unknown aggregation 'mean'; valid: weighted, uniform"):
        check_aggregation("mean")


def test_empty_and_weightless_means_are_refused():
    with pytest.raises(ValueError, match="cannot average zero vectors"):
        RunningMean().value()
    with pytest.raises(ValueError, match="weights sum to zero"):
        RunningMean().add(torch.ones(2), 0.0).value()
    with pytest.raises(ValueError):
        weighted_mean([torch.ones(2)], [1.0, 2.0])  # one weight per vector


def test_the_model_mean_fold_averages_the_messages_models_at_their_weights():
    server = SimpleNamespace(params=torch.tensor([1.0], dtype=torch.float64))
    messages = [
        SimpleNamespace(params=torch.tensor([1.0], dtype=torch.float64), num_samples=1, multiplicity=1),
        SimpleNamespace(params=torch.tensor([4.0], dtype=torch.float64), num_samples=2, multiplicity=1),
    ]

    def finish(server, client_models, context):
        return client_models.value(context.mean_denominator), {}

    plain, private = RoundContext(1, 2, 2, 1.0), RoundContext(1, 2, 2, 1.0, mean_denominator=4.0)
    assert model_mean_fold("weighted", finish).server_update(server, messages, plain)[0].item() == 3.0  # (1 + 8) / 3
    assert model_mean_fold("uniform", finish).server_update(server, messages, plain)[0].item() == 2.5
    # private: θ^{t−1} + Σ (θ_k − θ^{t−1}) / m = 1 + (0 + 3) / 4
    assert model_mean_fold("uniform", finish).server_update(server, messages, private)[0].item() == 1.75
