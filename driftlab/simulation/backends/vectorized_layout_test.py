"""A chunk's rows: the batch schedule and the stacked corrections (vectorized_layout.py)."""

from __future__ import annotations

import torch

from driftlab.simulation.backends.vectorized_layout import BatchSchedule, StackedCorrection
from driftlab.simulation.backends.vectorized_test import CLIENT_SIZES, _tasks
from driftlab.simulation.seam import NO_CORRECTION, GradientCorrection


def test_the_batch_schedule_pads_short_batches_with_zero_weight_and_sorts_out_finished_clients():
    tasks = _tasks([NO_CORRECTION] * len(CLIENT_SIZES))
    ordered = sorted(tasks, key=lambda task: -task.num_steps)
    schedule = BatchSchedule.build(ordered, torch.float64, torch.device("cpu"))
    assert schedule.active[0] == len(tasks) and schedule.active[-1] == sum(
        t.num_steps == ordered[0].num_steps for t in ordered
    )
    for k, task in enumerate(ordered):
        for step in range(task.num_steps):
            positions = task.batches[step][task.batches[step] >= 0]
            weights = schedule.weights[step, k]
            assert torch.equal(
                schedule.rows[step, k, : len(positions)], task.sample_indices[torch.as_tensor(positions)]
            )
            torch.testing.assert_close(weights.sum(), torch.tensor(1.0, dtype=torch.float64))
            assert int((weights > 0).sum()) == len(positions)


def test_stacked_corrections_share_a_common_reference_and_zero_the_absent_terms():
    start = torch.arange(4.0)
    reference = start + 1
    stacked = StackedCorrection.stack(
        [
            NO_CORRECTION,
            GradientCorrection(quadratic=0.5, reference=reference),
            GradientCorrection(linear=torch.ones(4)),
        ],
        start,
    )
    assert stacked.reference.shape == (1, 4) and torch.equal(stacked.reference[0], reference)
    assert torch.equal(stacked.quadratic, torch.tensor([[0.0], [0.5], [0.0]]))
    assert torch.equal(stacked.linear, torch.tensor([[0.0] * 4, [0.0] * 4, [1.0] * 4]))
    assert StackedCorrection.stack([NO_CORRECTION] * 3, start).is_empty
