from __future__ import annotations

import pytest
import torch

from driftlab.attacks.label_flipping import flip_labels


def test_flip_by_hand_and_twice_is_the_identity():
    y = torch.tensor([0, 1, 9, 4])
    assert flip_labels(y, 10).tolist() == [9, 8, 0, 5]
    assert torch.equal(flip_labels(flip_labels(y, 10), 10), y)


def test_refusals():
    with pytest.raises(ValueError, match="integer class targets"):
        flip_labels(torch.tensor([0.5]), 10)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        flip_labels(torch.tensor([10]), 10)
