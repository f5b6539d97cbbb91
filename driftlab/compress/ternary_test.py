"""ST (top-k + ternary) and its bit count, checked on hand-made tensors (algorithms.md, "EFL")."""

from __future__ import annotations

import pytest
import torch

from driftlab.algorithms import fedavg
from driftlab.compress import compress_model, kept_entries, sparse_ternary, ternary_bits, with_compression
from driftlab.compress.ternary import TernaryVector
from driftlab.optim.server import make_server_optimizer

# n = 10, q = 0.3: k = 3; the three largest |T| are −4.0 (index 7), −3.0 (index 1), 2.0 (index 3).
HAND = [0.5, -3.0, 0.1, 2.0, 0.0, -0.2, 1.0, -4.0, 0.3, 0.05]


def test_st_on_hand_made_tensor_keeps_the_k_largest_magnitudes_at_their_mean():
    tensor = torch.tensor(HAND, dtype=torch.float64)
    out = sparse_ternary(tensor, 0.3)
    # μ = (4 + 3 + 2) / 3 = 3; signs of the kept entries; zeros elsewhere
    expected = [0.0, -3.0, 0.0, 3.0, 0.0, 0.0, 0.0, -3.0, 0.0, 0.0]
    assert out.tolist() == expected
    assert out.dtype == torch.float64
    assert torch.nonzero(out).flatten().tolist() == [1, 3, 7]
    assert set(out.abs().unique().tolist()) == {0.0, 3.0}
    # the input is not modified
    assert tensor.tolist() == HAND


def test_st_scale_is_mean_magnitude_not_signed_mean():
    """The paper's Algorithm 2 (as extracted) averages signed values; the sheet's mean magnitude keeps ±μ."""
    tensor = torch.tensor([5.0, -5.0, 1.0, -1.0], dtype=torch.float64)
    out = sparse_ternary(tensor, 0.5)  # k = 2: 5 and −5; signed mean would be 0
    assert out.tolist() == [5.0, -5.0, 0.0, 0.0]


def test_st_keeps_shape_of_a_matrix():
    tensor = torch.tensor(HAND, dtype=torch.float64).reshape(2, 5)
    out = sparse_ternary(tensor, 0.3)
    assert out.shape == (2, 5)
    assert out.reshape(-1).tolist() == [0.0, -3.0, 0.0, 3.0, 0.0, 0.0, 0.0, -3.0, 0.0, 0.0]


def test_st_keeps_at_least_one_entry():
    tensor = torch.tensor([0.1, -0.7, 0.2], dtype=torch.float64)
    out = sparse_ternary(tensor, 0.01)  # ⌊0.03⌋ = 0 → k = 1
    assert out.tolist() == [0.0, -0.7, 0.0]


def test_st_of_zero_tensor_is_zero():
    out = sparse_ternary(torch.zeros(7, dtype=torch.float64), 0.5)
    assert out.tolist() == [0.0] * 7


@pytest.mark.parametrize(
    "numel, ratio, kept",
    [
        (10, 0.3, 3),
        (1000, 0.01, 10),
        (600, 0.1, 60),
        (10, 0.1, 1),
        (10, 0.01, 1),
        (3, 0.5, 1),
        (7, 1.0, 7),
        (1, 0.5, 1),
    ],
)
def test_kept_entries_is_floor_of_q_n_at_least_one(numel, ratio, kept):
    assert kept_entries(numel, ratio) == kept


@pytest.mark.parametrize(
    "numel, kept, bits",
    [
        (10, 3, 45),  # 32 + 3 + min(10, 3·4 = 12)
        (1000, 10, 142),  # 32 + 10 + min(1000, 10·10 = 100)
        (600, 60, 692),  # 32 + 60 + min(600, 60·10 = 600)
        (10, 1, 37),  # 32 + 1 + min(10, 4)
        (4, 1, 35),  # 32 + 1 + min(4, 2)
        (1024, 512, 32 + 512 + 1024),  # mask cheaper than indices: min(1024, 512·10)
        (1, 1, 33),  # 32 + 1 + min(1, 1·0)
    ],
)
def test_ternary_bits(numel, kept, bits):
    assert ternary_bits(numel, kept) == bits


def test_compress_model_applies_st_per_tensor():
    first = torch.tensor(HAND, dtype=torch.float64)
    second = torch.tensor([0.5, -0.25, 2.5, 1.0], dtype=torch.float64)
    vector = torch.cat([first, second])
    out, bits = compress_model(vector, (10, 4), 0.3)
    # tensor 1: as the hand case; tensor 2: k = max(⌊1.2⌋, 1) = 1, keeps 2.5
    assert out.tolist() == [0.0, -3.0, 0.0, 3.0, 0.0, 0.0, 0.0, -3.0, 0.0, 0.0] + [0.0, 0.0, 2.5, 0.0]
    assert bits == 45 + 35
    # per tensor, not over the whole vector: ST of the concatenation would keep −4, −3, 2.5, 2 at a different scale
    whole = sparse_ternary(vector, 0.3)
    assert not torch.equal(whole, out)


def test_compress_model_on_mlr_sizes():
    torch.manual_seed(0)
    vector = torch.randn(610, dtype=torch.float64)
    out, bits = compress_model(vector, (600, 10), 0.1)
    assert bits == 692 + 37
    assert int((out[:600] != 0).sum()) == 60
    assert int((out[600:] != 0).sum()) == 1
    # kept are the largest magnitudes of each tensor, at their mean magnitude
    top = vector[:600].abs().topk(60).indices
    assert set(torch.nonzero(out[:600]).flatten().tolist()) == set(top.tolist())
    assert torch.allclose(out[:600][top].abs(), vector[:600][top].abs().mean().expand(60), rtol=0, atol=1e-15)
    assert torch.equal(torch.sign(out[:600][top]), torch.sign(vector[:600][top]))
    assert out[600 + int(vector[600:].abs().argmax())] == vector[600:].abs().max() * torch.sign(
        vector[600:][vector[600:].abs().argmax()]
    )


def test_ratio_one_is_identity_at_32_bits_per_entry():
    vector = torch.tensor(HAND + [1.5, -2.5], dtype=torch.float64)
    out, bits = compress_model(vector, (10, 2), 1.0)
    assert torch.equal(out, vector)
    assert bits == 32 * 12


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5, float("nan")])
def test_bad_ratio_is_rejected(ratio):
    with pytest.raises(ValueError, match="ratio"):
        compress_model(torch.zeros(4), (4,), ratio)
    with pytest.raises(ValueError, match="ratio"):
        with_compression(fedavg.build(make_server_optimizer("sgd")), ratio, (4,))


def test_tensor_sizes_must_cover_the_vector():
    with pytest.raises(ValueError, match="tensor sizes"):
        compress_model(torch.zeros(5), (3, 1), 0.5)


def test_a_scaled_ternary_vector_keeps_its_signs_positions_and_bits_and_scales_each_mu():
    first = torch.tensor(HAND, dtype=torch.float64)
    second = torch.tensor([0.5, -0.25, 2.5, 1.0], dtype=torch.float64)
    out, bits = compress_model(torch.cat([first, second]), (10, 4), 0.3)
    code = TernaryVector.from_dense(out, (10, 4))
    half = code.scaled(0.5)
    # μ = 3 for the first tensor, 2.5 for the second: halved, on the same entries with the same signs
    assert half.to_dense().tolist() == [0.0, -1.5, 0.0, 1.5, 0.0, 0.0, 0.0, -1.5, 0.0, 0.0] + [0.0, 0.0, 1.25, 0.0]
    assert half.scales.tolist() == [1.5, 1.25] and half.counts == code.counts == (3, 1)
    assert torch.equal(half.code, code.code) and half.sizes == code.sizes
    assert half.bits == code.bits == bits
    assert torch.equal(code.scaled(1.0).to_dense(), out)  # scaling by 1 is the vector itself, bit for bit


@pytest.mark.parametrize("factor", [-0.5, float("inf"), float("nan")])
def test_a_ternary_vector_scales_only_by_a_finite_non_negative_factor(factor):
    code = TernaryVector.from_dense(compress_model(torch.tensor(HAND, dtype=torch.float64), (10,), 0.3)[0], (10,))
    with pytest.raises(ValueError, match="finite factor ≥ 0"):
        code.scaled(factor)
