"""Model replacement, the trigger, batch poisoning and the attack-success metric, by hand."""

from __future__ import annotations

import pytest
import torch

from driftlab.attacks.backdoor import (
    Trigger,
    add_trigger,
    attack_success_rate,
    model_replacement,
    poison_batch,
    replacement_scale,
)
from driftlab.attacks.byzantine import poison_generator

F64 = torch.float64


def test_model_replacement_by_hand_replaces_the_global_model():
    global_params = torch.tensor([1.0, 1.0], dtype=F64)
    backdoored = torch.tensor([1.5, 0.5], dtype=F64)
    assert replacement_scale(10, 1.0) == 10.0 and replacement_scale(10, 0.5) == 20.0
    reported = model_replacement(backdoored, global_params, num_clients=10, server_lr=1.0)
    assert reported.tolist() == [6.0, -4.0]  # 10 · (X − G) + G
    # nine honest clients whose changes cancel (here: none), FedAvg with η = 1: G⁺ = G + (1/10) Σ (L_i − G) = X
    changes = torch.stack([reported - global_params] + [torch.zeros(2, dtype=F64)] * 9)
    assert torch.equal(global_params + changes.mean(dim=0), backdoored)


def test_trigger_sets_the_bottom_right_square_and_leaves_the_input_alone():
    images = torch.zeros(2, 1, 4, 4)
    triggered = add_trigger(images, Trigger(size=2, value=1.0))
    assert images.sum().item() == 0
    assert triggered[0, 0].tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]
    with pytest.raises(ValueError, match="at least that size"):
        add_trigger(torch.zeros(1, 2, 2), Trigger(size=3))


def test_poison_batch_is_seeded_and_relabels_the_triggered_rows():
    images, targets = torch.zeros(4, 1, 3, 3), torch.tensor([1, 2, 3, 4])
    trigger = Trigger(size=1, value=5.0, target_label=0)
    poisoned, labels = poison_batch(images, targets, trigger, 0.5, poison_generator(1, 2, 3))
    again, _ = poison_batch(images, targets, trigger, 0.5, poison_generator(1, 2, 3))
    rows = (poisoned[:, 0, -1, -1] == 5.0).nonzero().flatten()
    assert len(rows) == 2 and torch.equal(poisoned, again)
    assert labels[rows].tolist() == [0, 0] and (labels == 0).sum().item() == 2


def test_attack_success_counts_non_target_examples_predicted_as_the_target():
    # eligible: examples 0, 2, 3 (true label ≠ 0); predicted 0 on example 0 only
    assert attack_success_rate(torch.tensor([0, 0, 1, 2]), torch.tensor([1, 0, 1, 3]), 0) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="differs from the backdoor's target"):
        attack_success_rate(torch.tensor([0]), torch.tensor([0]), 0)
