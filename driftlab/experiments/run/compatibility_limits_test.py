"""Issue 31 item 10: size and model refusals name the true cause and the true fix."""

from __future__ import annotations

import numpy as np
import pytest

import driftlab
from driftlab.experiments.config import ConfigError, load_config
from driftlab.experiments.run.compatibility import check_sizes

GIB = 2**30


def test_a_huge_quadratic_dimension_is_blamed_on_the_dimension():
    config = load_config(
        {"data": {"name": "quadratic", "quadratic_dimension": 10**9, "num_clients": 30}, "model": {"name": "quadratic"}}
    )
    with pytest.raises(ConfigError) as error:
        check_sizes(config, memory_bytes=16 * GIB)
    # 8,000 bytes per client and dimension: 16 GiB / (8,000 x 30) = 71,582 dimensions
    assert str(error.value) == (
        "data.quadratic_dimension: quadratic data of dimension 1,000,000,000 for 30 clients (about 7.81 KiB per client and dimension) "
        "needs at least 218 TiB, more than this machine's 16 GiB of memory; use a dimension of at most about 71,582 for 30 clients"
    )


def test_quadratic_clients_and_dimension_name_each_fix_that_fits():
    def refusal(clients: int, dimension: int) -> str:
        config = load_config(
            {
                "data": {"name": "quadratic", "quadratic_dimension": dimension, "num_clients": clients},
                "model": {"name": "quadratic"},
            }
        )
        with pytest.raises(ConfigError) as error:
            check_sizes(config, memory_bytes=16 * GIB)
        return str(error.value)

    # 16 GiB / 8,000 bytes = 2,147,483 client-dimensions fit
    both = refusal(10**6, 10)
    assert both.startswith(
        "data.num_clients or data.quadratic_dimension: quadratic data of dimension 10 for 1,000,000 clients"
    )
    assert both.endswith(
        "use at most about 214,748 clients of dimension 10, or a dimension of at most about 2 for 1,000,000 clients"
    )
    clients = refusal(10**9, 10)  # not even dimension 1 fits a billion clients
    assert clients.startswith("data.num_clients: ") and clients.endswith(
        "use at most about 214,748 clients of dimension 10"
    )
    neither = refusal(10**7, 10**9)
    assert neither.startswith("data.num_clients x data.quadratic_dimension: ")
    assert neither.endswith("keep data.num_clients x data.quadratic_dimension under about 2,147,483 (now 1e+16)")


def test_uint8_images_with_mlr_are_told_about_floats_and_normalisation_not_token_sequences(built_ins_only):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(40, 1, 8, 8)).astype(np.uint8)
    labels = np.arange(40) % 3
    data = driftlab.FederatedArrays(images, labels, np.arange(40) % 4, images[:5], labels[:5])
    with pytest.raises(ConfigError) as error:
        driftlab.run({"rounds": 1, "data": {"name": "custom"}, "model": {"name": "mlr"}}, None, data=data)
    message = str(error.value)
    assert "Token sequences take" not in message
    assert message.endswith(
        "The inputs are uint8 values, which only lstm/gru read (as token ids, one sequence (length,) per example); the other models "
        "compute in floating point: give float32 inputs (e.g. pixels / 255), or keep uint8 pixels and pass "
        "input_normalisation=driftlab.data.pixels.PixelNormalisation(mean, std) to FederatedArrays; then use cnn, femnist_cnn, "
        "resnet18_gn, resnet18_bn, vgg11, mlr or mlp."
    )


def test_integer_token_sequences_still_get_the_sequence_advice():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=(40, 12))  # int64 (length,) rows: token ids
    labels = np.arange(40) % 3
    data = driftlab.FederatedArrays(tokens, labels, np.arange(40) % 4, tokens[:5], labels[:5])
    with pytest.raises(ConfigError, match=r"Token sequences take model.name=lstm or gru"):
        driftlab.run({"rounds": 1, "data": {"name": "custom"}, "model": {"name": "mlr"}}, None, data=data)
