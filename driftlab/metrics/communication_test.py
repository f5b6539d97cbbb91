"""Bits on the wire: 32 bits per uncompressed entry; FedAvg moves one model each way per client."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import driftlab
from driftlab.metrics.communication import BITS_PER_ENTRY, model_equivalents, payload_bits
from driftlab.simulation.round.sampling import clients_per_round


def test_payload_bits_of_tensors_count_32_bits_per_entry_whatever_the_dtype():
    assert payload_bits(torch.zeros(10)) == 320
    assert payload_bits(torch.zeros(2, 5, dtype=torch.float64)) == 320
    assert payload_bits(torch.zeros(3, dtype=torch.float16)) == 96
    assert payload_bits(None) == 0
    assert payload_bits(5) == 0 and payload_bits(2.5) == 0  # scalars are not counted


def test_payload_bits_of_structures():
    @dataclasses.dataclass
    class Message:
        params: torch.Tensor
        control: torch.Tensor
        num_samples: int

    message = Message(torch.zeros(7), torch.zeros(7), 100)
    assert payload_bits(message) == 2 * 7 * 32
    assert payload_bits([torch.zeros(2), (torch.zeros(3), None)]) == 5 * 32

    class Compressed:
        bits = 123

    assert payload_bits(Compressed()) == 123
    with pytest.raises(TypeError, match="cannot count"):
        payload_bits({"a": torch.zeros(1)})


def test_model_equivalents():
    assert model_equivalents(32 * 100 * 3, 100) == 3.0
    assert BITS_PER_ENTRY == 32


def test_fedavg_upload_and_download_are_one_model_per_client():
    for precision in ("float32", "float64"):
        result = driftlab.run(
            None,
            overrides=[
                "rounds=3",
                "data.num_clients=8",
                "sampling.participation=0.5",
                "client.steps=2",
                f"precision={precision}",
            ],
        )
        clients = clients_per_round(0.5, 8)
        per_round = 32 * result.num_parameters * clients
        assert result.num_parameters == 60 * 10 + 10  # MLR on 60 features, 10 classes
        for record in result.records:
            assert record["num_reporting"] == clients
            assert record["upload_bits"] == per_round
            assert record["download_bits"] == per_round
