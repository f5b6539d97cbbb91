from __future__ import annotations

import pytest
import torch

from driftlab.data.pixels import PixelNormalisation

ALL_PIXELS = torch.arange(256, dtype=torch.uint8)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int64)


@pytest.mark.parametrize("mean, std", [(0.1307, 0.3081), (0.28604059698879553, 0.35302424451492237)])
def test_one_channel_matches_the_loaders_scalar_normalisation_bit_for_bit(mean, std):
    images = ALL_PIXELS.repeat(3).view(3, 1, 16, 16)
    expected = images.to(torch.float32).div_(255.0).sub_(mean).div_(std)
    assert torch.equal(_bits(PixelNormalisation((mean,), (std,))(images)), _bits(expected))


def test_channels_match_per_channel_normalisation_bit_for_bit_and_write_into_a_buffer():
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    images = (
        torch.stack([ALL_PIXELS.view(16, 16), ALL_PIXELS.flip(0).view(16, 16), ALL_PIXELS.roll(7).view(16, 16)])
        .unsqueeze(0)
        .repeat(2, 1, 1, 1)
    )
    shape = (1, -1, 1, 1)
    expected = (
        images.to(torch.float32).div_(255.0).sub_(torch.tensor(mean).view(shape)).div_(torch.tensor(std).view(shape))
    )
    norm = PixelNormalisation(mean, std)
    assert torch.equal(_bits(norm(images)), _bits(expected))
    buffer = torch.empty(2, 3, 16, 16)
    assert norm(images, out=buffer) is buffer and torch.equal(_bits(buffer), _bits(expected))
    # [clients, batch, c, h, w] as the vectorized backend gathers them: the channel axis is the third from last
    assert torch.equal(_bits(norm(images.unsqueeze(0))[0]), _bits(expected))


def test_another_dtype_is_the_float32_values_cast():
    norm = PixelNormalisation((0.1307,), (0.3081,), dtype=torch.float64)
    values = norm(ALL_PIXELS)
    assert values.dtype == torch.float64
    assert torch.equal(values, PixelNormalisation((0.1307,), (0.3081,))(ALL_PIXELS).double())


def test_bad_normalisations_and_inputs_are_refused():
    with pytest.raises(ValueError, match="2 means but 1 deviations"):
        PixelNormalisation((0.5, 0.5), (0.2,))
    with pytest.raises(ValueError, match="deviations must be positive"):
        PixelNormalisation((0.5,), (0.0,))
    with pytest.raises(ValueError, match="takes uint8 pixels, got torch.float32"):
        PixelNormalisation((0.5,), (0.2,))(torch.zeros(2, 1, 2, 2))
    assert PixelNormalisation(0.5, 0.25) == PixelNormalisation((0.5,), (0.25,))


def test_a_data_set_takes_a_normalisation_only_for_uint8_images_with_its_channels():
    import numpy as np

    from driftlab.data.federated import FederatedDataset

    pixels = torch.zeros(4, 3, 2, 2, dtype=torch.uint8)
    labels = torch.tensor([0, 1, 0, 1])
    clients = (np.arange(4),)
    three = PixelNormalisation((0.5, 0.5, 0.5), (0.2, 0.2, 0.2))
    data = FederatedDataset("pixels", pixels, labels, pixels, labels, clients, 2, input_normalisation=three)
    with pytest.raises(ValueError, match="uint8 pixels but train_inputs are torch.float32"):
        FederatedDataset("floats", pixels.float(), labels, pixels, labels, clients, 2, input_normalisation=three)
    with pytest.raises(ValueError, match=r"has 3 channels but test_inputs have shape \(4, 12\)"):
        FederatedDataset("flat", pixels, labels, pixels.view(4, 12), labels, clients, 2, input_normalisation=three)
    other = FederatedDataset(
        "pixels",
        pixels,
        labels,
        pixels,
        labels,
        clients,
        2,
        input_normalisation=PixelNormalisation((0.4, 0.5, 0.5), (0.2, 0.2, 0.2)),
    )
    assert data.digest != other.digest  # a resume with another normalisation is other data


def test_a_run_on_your_own_uint8_images_records_what_their_normalised_floats_record():
    import numpy as np

    import driftlab
    from driftlab.data.federated import FederatedArrays

    generator = torch.Generator().manual_seed(2)
    pixels = torch.randint(0, 256, (30, 1, 6, 6), generator=generator, dtype=torch.uint8)
    labels = torch.randint(0, 3, (30,), generator=generator)
    clients = np.repeat(np.arange(3), 8)
    norm = PixelNormalisation((0.1307,), (0.3081,))

    def records(train, test, **normalisation):
        arrays = FederatedArrays(train, labels[:24], clients, test, labels[24:], num_classes=3, **normalisation)
        overrides = [
            "rounds=2",
            "model.name=mlp",
            "model.hidden=[8]",
            "client.batch_size=4",
            "data.client_test_fraction=0.25",
        ]
        return [
            {k: v for k, v in r.items() if "time" not in k and "seconds" not in k}
            for r in driftlab.run(None, overrides=overrides, data=arrays).records
        ]

    floats = records(norm(pixels[:24]), norm(pixels[24:]))
    assert records(pixels[:24], pixels[24:], input_normalisation=norm) == floats
    assert "client_test_accuracy_mean" in floats[-1] and floats[-1]["test_loss"] > 0
