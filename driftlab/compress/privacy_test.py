"""Client-level DP around compression (error_feedback's module docstring): the compressed algorithm's ReleaseForm.

with_privacy(with_compression(algorithm)) clips what is uploaded, the compressed message: a clip scales its ternary
μ, so the message still travels compressed at the same bits and arrives equal to itself.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

from driftlab.algorithms import fedavg, scaffold
from driftlab.algorithms.efl_test import context
from driftlab.compress import compress_model, with_compression
from driftlab.compress.error_feedback import MODEL_IS_CHANGE, MODEL_IS_FINAL, MODEL_SENT_DENSE, CompressedPayload
from driftlab.compress.error_feedback_test import _equal
from driftlab.compress.testing import tiny_run
from driftlab.errors import ConfigError
from driftlab.metrics.communication import payload_bits
from driftlab.optim.server import make_server_optimizer
from driftlab.privacy.mechanism import with_privacy
from driftlab.privacy.settings import PrivacySettings
from driftlab.simulation.seam import Algorithm, ClientUpdate, RoundContext

SIZES = (40, 24, 8)
P = sum(SIZES)
RATIO = 0.2  # k = 8, 4, 1
FORMS = {"fedavg": MODEL_IS_FINAL, "scaffold": MODEL_IS_CHANGE}


def _inner(name: str, aggregation: str = "uniform") -> Algorithm:
    sgd = make_server_optimizer("sgd")
    return fedavg.build(sgd, aggregation=aggregation) if name == "fedavg" else scaffold.build(sgd)


def _round(algorithm: Algorithm, dtype: torch.dtype = torch.float32, seed: int = 11):
    """The server, the view and client 3's message of one round of ``algorithm`` from a random model."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn(P, generator=generator, dtype=dtype)
    server = algorithm.server_init(start)
    view = algorithm.broadcast(server)
    update = ClientUpdate(view.params, view.params + 0.1 * torch.randn(P, generator=generator, dtype=dtype), 4)
    _, message = algorithm.client_finish(view, algorithm.client_state_init(start), context(3, 1, 5), update)
    return server, view, message


def _settings(clip: float, noise_multiplier: float = 0.0) -> PrivacySettings:
    return PrivacySettings(
        clip=clip, noise_multiplier=noise_multiplier, seed=4, sampling_rate=1.0, expected_cohort=2.0, population=4
    )


def _norm(vector: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(vector))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_clipping_a_compressed_message_scales_its_ternary_and_releases_the_scaled_vector(name, dtype):
    algorithm = with_compression(_inner(name), RATIO, SIZES)
    form = algorithm.release
    _, view, message = _round(algorithm, dtype)
    assert message.model_form == FORMS[name]
    released = form.release(view, message)
    clip = 0.3 * _norm(released)
    factor = clip / _norm(released)
    clipped = form.scale(view, message, factor)
    # the same ternary code, each μ times the factor: still compressed, at the same bits
    assert clipped.model.counts == message.model.counts and clipped.model.sizes == message.model.sizes
    assert torch.equal(clipped.model.code, message.model.code)
    assert torch.equal(clipped.model.scales, message.model.scales * factor)
    assert (clipped.model_form, clipped.model_field) == (message.model_form, message.model_field)
    assert clipped.bits == message.bits == payload_bits(clipped) < payload_bits(message.payload)  # less than dense
    # what it releases is factor times what the message released, to float rounding, and within the clip
    rounding = 1e-6 if dtype == torch.float32 else 1e-14
    assert _norm(form.release(view, clipped) - factor * released) <= rounding * clip
    assert _norm(form.release(view, clipped)) <= clip * (1 + rounding)
    # the model field is exactly what its receiver rebuilds from the scaled ternary
    final = view.params + clipped.model.to_dense()
    if name == "fedavg":
        assert torch.equal(clipped.payload.params, final)
    else:
        assert torch.equal(clipped.payload.params_delta, final - view.params)
        # the field sent dense is scaled by SCAFFOLD's own form: Δc_k times the factor
        assert torch.equal(clipped.payload.control_delta, message.payload.control_delta * factor)


@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_a_clipped_compressed_message_crosses_the_wire_equal_to_itself_at_its_bits(name):
    from driftlab.deploy.wire import encode, payload_bytes

    algorithm = with_compression(_inner(name), RATIO, SIZES)
    form, codec = algorithm.release, algorithm.codec
    _, view, message = _round(algorithm)
    clipped = form.scale(view, message, 0.25)
    arrived = codec.from_wire(codec.to_wire(clipped), view.params)
    assert _equal(arrived, clipped)
    assert torch.equal(form.release(view, arrived), form.release(view, clipped))  # the server measures what was sent
    on_wire = payload_bytes(encode(codec.to_wire(clipped), run_fingerprint="run", round=1, client_id=3))
    assert clipped.bits <= 8 * on_wire < clipped.bits + 8


@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_the_noise_carrier_costs_nothing_and_is_folded_once_by_the_compressed_fold(name):
    algorithm = with_compression(_inner(name), RATIO, SIZES)
    inner = _inner(name)
    server, view, _ = _round(algorithm, torch.float64)
    released = {"fedavg": P, "scaffold": 2 * P}[name]  # θ_k − θ; cat(Δy_k, Δc_k)
    noise = torch.randn(released, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    carrier = algorithm.release.restore(view, None, noise)
    assert isinstance(carrier, CompressedPayload) and carrier.bits == 0 and carrier.model is None
    assert torch.allclose(algorithm.release.release(view, carrier), noise, rtol=0, atol=1e-12)
    context = RoundContext(1, 4, 2, 1.0, mean_denominator=2.0)
    fold = algorithm.fold()
    after, _ = fold.finish(server, fold.add(fold.start(server, context), carrier), context)
    # the wrapped fold of the wrapped carrier, then the server's error-feedback compression of its step
    inner_fold = inner.fold()
    inner_carrier = inner.release.restore(view.inner, None, noise)
    accumulator = inner_fold.add(inner_fold.start(server.inner, context), inner_carrier)
    stepped, _ = inner_fold.finish(server.inner, accumulator, context)
    sent, _ = compress_model(stepped.params - server.params, SIZES, RATIO)
    assert torch.equal(after.params, server.params + sent)
    if name == "fedavg":  # the carrier counted once, the mean dividing by the expected cohort
        assert torch.allclose(stepped.params - server.params, noise / 2, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_a_restored_message_is_no_longer_ternary_so_it_travels_dense_at_its_dense_bits(name):
    algorithm = with_compression(_inner(name), RATIO, SIZES)
    form, codec = algorithm.release, algorithm.codec
    _, view, message = _round(algorithm, torch.float64)
    released = form.release(view, message)
    generator = torch.Generator().manual_seed(3)
    noised = released + 0.01 * torch.randn(released.numel(), generator=generator, dtype=torch.float64)
    restored = form.restore(view, message, noised)
    assert (restored.model, restored.model_form) == (None, MODEL_SENT_DENSE)
    assert restored.bits == payload_bits(restored.payload) == 32 * noised.numel() > message.bits
    assert torch.allclose(form.release(view, restored), noised, rtol=0, atol=1e-12)
    assert _equal(codec.from_wire(codec.to_wire(restored), view.params), restored)
    # a dense message scales through the wrapped form and keeps its bits
    half = form.scale(view, restored, 0.5)
    assert (half.model, half.bits) == (None, restored.bits)
    assert torch.allclose(form.release(view, half), 0.5 * noised, rtol=0, atol=1e-12)


@dataclass(frozen=True)
class Doubled:
    twice: torch.Tensor  # 2 θ_k: no field is θ_k or its change, so nothing of it travels compressed


def test_a_message_without_a_model_field_is_sent_whole_at_its_whole_bits():
    inner = fedavg.build(make_server_optimizer("sgd"), aggregation="uniform")

    def client_finish(view, client, ctx, update):
        return None, Doubled(2 * update.final_params)

    plugin = dataclasses.replace(inner, client_finish=client_finish, release=None, lacks=())
    algorithm = with_compression(plugin, RATIO, SIZES)
    _, view, message = _round(algorithm)
    assert (message.model, message.model_form, message.bits) == (None, MODEL_SENT_DENSE, 32 * P)
    assert _equal(algorithm.codec.from_wire(algorithm.codec.to_wire(message), view.params), message)


def test_compression_passes_the_wrapped_algorithms_refusal_through():
    weighted = with_compression(_inner("fedavg", aggregation="weighted"), RATIO, SIZES)
    assert weighted.release is None and weighted.release_refusal == fedavg.WEIGHTED_REFUSAL
    formless = with_compression(dataclasses.replace(_inner("fedavg"), release=None), RATIO, SIZES)
    assert formless.release is None and formless.release_refusal is None
    settings = _settings(clip=1.0)
    with pytest.raises(
        ConfigError,
        match='^\\[privacy\\] with algorithm.name = "fedavg": aggregation = "weighted" .*set algorithm.aggregation = "uniform"$',
    ):
        with_privacy(weighted, settings)
    with pytest.raises(ConfigError, match=r"gives no release form .*give Algorithm\(release=ReleaseForm"):
        with_privacy(formless, settings)


@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_private_compressed_upload_is_clipped_compressed_and_its_residual_keeps_what_was_clipped(name):
    compressed = with_compression(_inner(name), RATIO, SIZES)
    _, view, plain = _round(compressed)
    clip = 0.5 * _norm(compressed.release.release(view, plain))
    private = with_privacy(compressed, _settings(clip))
    generator = torch.Generator().manual_seed(11)
    start = torch.randn(P, generator=generator)
    update = ClientUpdate(start, start + 0.1 * torch.randn(P, generator=generator), 4)
    server = private.server_init(start)
    states = {}
    for label, algorithm, state in (("plain", compressed, server.inner), ("private", private, server)):
        client = compressed.client_state_init(start)
        states[label], message = algorithm.client_finish(algorithm.broadcast(state), client, context(3, 1, 5), update)
    assert message.bits == plain.bits and torch.equal(message.model.code, plain.model.code)
    factor = clip / _norm(compressed.release.release(view, plain))
    assert torch.equal(message.model.scales, plain.model.scales * factor)
    assert _norm(compressed.release.release(view, message)) <= clip * (1 + 1e-6)
    # the clip is not fed back: the residual is Δ_k − ST(Δ_k), as without privacy
    assert torch.equal(states["private"].residual, states["plain"].residual)
    # the server folds the clipped message as it arrived (within its tolerance, it rescales nothing)
    context_ = RoundContext(1, 4, 1, 1.0)
    moved, metrics = private.server_update(server, [message], context_)
    expected, _ = compressed.server_update(server.inner, [message], context_)
    assert torch.equal(moved.params, expected.params)
    assert metrics["privacy_clipped_fraction"] == 1.0


@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_an_empty_private_round_releases_its_noise_through_the_compressed_server(name):
    compressed = with_compression(_inner(name), RATIO, SIZES)
    private = with_privacy(compressed, _settings(clip=0.1, noise_multiplier=1.0))
    start = torch.randn(P, generator=torch.Generator().manual_seed(2))
    server = private.server_init(start)
    assert server.dimension == (P if name == "fedavg" else 2 * P)  # the released vector of a compressed message
    moved, metrics = private.server_update(server, [], RoundContext(1, 4, 0, 1.0))
    assert metrics["privacy_noise_std"] == 0.1
    # the model moves by ST of the noised step: ≤ k entries per tensor, of one magnitude, and not nothing
    step = moved.params - start
    for piece, kept in zip(torch.split(step, SIZES), (8, 4, 1), strict=True):
        nonzero = piece[piece != 0]
        assert 0 < len(nonzero) <= kept
        assert torch.allclose(nonzero.abs(), nonzero.abs().mean().expand(len(nonzero)), rtol=1e-6, atol=0)
    assert not math.isclose(float(moved.inner.residual.abs().max()), 0.0)


TINY = tiny_run(3, "algorithm.aggregation=uniform", "compression.ratio=0.1")


def test_a_private_compressed_run_uploads_clipped_messages_at_the_st_bits():
    import driftlab

    private = ["sampling.mode=poisson", "privacy.clip=0.05", "privacy.noise_multiplier=0.8"]
    result = driftlab.run(None, overrides=[*TINY, *private])
    st_bits = (32 + 60 + min(600, 60 * 10)) + (32 + 1 + min(10, 1 * 4))  # error_feedback_test's MLR sizes
    for record in result.records:
        assert record["upload_bits"] == record["num_reporting"] * st_bits
        assert record["privacy_clip"] == 0.05 and record["privacy_clipped_fraction"] == 1.0
    assert math.isclose(result.records[0]["privacy_noise_std"], 0.8 * 0.05)


def test_compression_with_privacy_that_clips_and_noises_nothing_is_the_run_without_it():
    import driftlab

    plain = driftlab.run(None, overrides=TINY)
    private = driftlab.run(None, overrides=[*TINY, "privacy.clip=inf", "privacy.noise_multiplier=0"])
    assert torch.equal(plain.final_params, private.final_params)
    assert [r["upload_bits"] for r in plain.records] == [r["upload_bits"] for r in private.records]
