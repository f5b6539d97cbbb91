"""``with_privacy``: clipping and its server-side bound, seeded central and local noise, adaptive clipping, refusals.

Most tests use a tiny "mean of θ_k" algorithm written here with its own
``ReleaseForm`` (its clients send their change θ_k − θ and its fold is
``θ + Σ_P (θ_k − θ) / m``: linear in the released changes with unit weight, so
the form's promise holds), so that expected values are exact; the built-in FedAvg (uniform) and SCAFFOLD check the same
properties on real forms (SCAFFOLD's releases two model-sized vectors).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

from driftlab.algorithms import fedavg, feddyn, scaffold
from driftlab.algorithms.aggregation import RunningMean
from driftlab.errors import ConfigError
from driftlab.experiments.config import load_config
from driftlab.experiments.run.runner import build_simulation
from driftlab.optim.server import make_server_optimizer
from driftlab.privacy import mechanism
from driftlab.privacy.mechanism import PrivateClientView, PrivateMessage, PrivateServerState, with_privacy
from driftlab.privacy.settings import AdaptiveClipping, PrivacySettings
from driftlab.randomness import Stream, generator, seeded_torch_generator
from driftlab.simulation.round.engine import run_round
from driftlab.simulation.round.ordered_fold import OrderedFold
from driftlab.simulation.seam import (
    NO_CORRECTION,
    Algorithm,
    ClientContext,
    ClientUpdate,
    MessageCodec,
    ReleaseForm,
    RoundContext,
    ServerFold,
)

P = 12
SEED = 7

# ------------------------------------------------------------------------------------------ a "mean of θ_k" algorithm


@dataclass(frozen=True)
class MeanState:
    params: torch.Tensor


@dataclass(frozen=True)
class MeanView:
    params: torch.Tensor


@dataclass(frozen=True)
class MeanMessage:
    change: torch.Tensor  # θ_k − θ


def mean_algorithm(form: bool = True) -> Algorithm:
    """θ⁺ = θ + Σ_P (θ_k − θ) / (m, or |P|): the mean of the clients' models, as a sum of released changes."""

    def start(server: MeanState, context: RoundContext) -> RunningMean:
        return RunningMean()

    def add(changes: RunningMean, message: MeanMessage) -> RunningMean:
        return changes.add(message.change, 1.0)

    def finish(server: MeanState, changes: RunningMean, context: RoundContext) -> tuple[MeanState, dict[str, float]]:
        return MeanState(server.params + changes.value(context.mean_denominator)), {"mean_metric": 1.0}

    def client_finish(view, client, context, update):
        return None, MeanMessage(update.final_params - view.params)

    def restore(view: MeanView, message: MeanMessage | None, vector: torch.Tensor) -> MeanMessage:
        return MeanMessage(vector)

    release = ReleaseForm(lambda view, message: message.change, restore) if form else None
    fold = ServerFold(start, add, finish)
    return Algorithm(
        "mean", MeanState, lambda view, client, context: NO_CORRECTION, client_finish, fold.server_update,
        lambda server: MeanView(server.params), server_fold=fold, release=release,
    )  # fmt: skip


def settings(clip: float = 1.0, z: float = 0.0, **changes) -> PrivacySettings:
    base = dict(clip=clip, noise_multiplier=z, seed=SEED, sampling_rate=0.5, expected_cohort=4.0, population=8)
    return PrivacySettings(**{**base, **changes})


def context(client_id: int, round_index: int = 1) -> ClientContext:
    return ClientContext(client_id, round_index, num_samples=5, mean_num_samples=5.0, num_registered=8,
                         planned_steps=3, client_lr=0.1)  # fmt: skip


def round_context(round_index: int = 1, selected: int = 3) -> RoundContext:
    return RoundContext(round_index, num_registered=8, num_selected=selected, server_learning_rate=1.0)


def random_update(start: torch.Tensor, norm: float, seed: int) -> ClientUpdate:
    direction = torch.randn(start.shape, generator=torch.Generator().manual_seed(seed), dtype=start.dtype)
    return ClientUpdate(start, start + direction * (norm / float(direction.norm())), 3)


def client_messages(algorithm: Algorithm, server, norms, round_index: int = 1, first_id: int = 0):
    """Each client k's message after an update of norm ``norms[k]`` from the broadcast model."""
    view = algorithm.broadcast(server)
    state = algorithm.client_state_init(view.params) if algorithm.client_state_init is not None else None
    messages = []
    for k, size in enumerate(norms):
        update = random_update(view.params, size, seed=100 * round_index + k)
        _, message = algorithm.client_finish(view, state, context(first_id + k, round_index), update)
        messages.append(message)
    return messages


def recording(algorithm: Algorithm, added: list) -> Algorithm:
    """``algorithm`` whose fold records every message it adds (the carrier included)."""
    inner = algorithm.fold()

    def add(accumulator, message):
        added.append(message)
        return inner.add(accumulator, message)

    fold = ServerFold(inner.start, add, inner.finish)
    return dataclasses.replace(algorithm, server_fold=fold, server_update=fold.server_update)


def sgd() -> object:
    return make_server_optimizer("sgd")


def theta0(dtype=torch.float64) -> torch.Tensor:
    return torch.randn(P, generator=torch.Generator().manual_seed(3), dtype=dtype)


BUILT_INS = {
    "mean": lambda: mean_algorithm(),
    "fedavg": lambda: fedavg.build(sgd(), aggregation="uniform"),
    "scaffold": lambda: scaffold.build(sgd()),
}


def finished_with_and_without_privacy(name: str, clip: float, norm: float, seed: int):
    """Built-in ``name`` (``inner``), the broadcast view, client 0's update of norm ``norm`` from it, and the message
    ``inner`` sends for it, then the one ``inner`` under [privacy] at ``clip`` sends."""
    inner = BUILT_INS[name]()
    private = with_privacy(inner, settings(clip=clip))
    view = private.broadcast(private.server_init(theta0()))
    update = random_update(view.params, norm, seed=seed)
    state = inner.client_state_init(view.params) if inner.client_state_init is not None else None
    _, plain = inner.client_finish(view, state, context(0), update)
    _, message = private.client_finish(view, state, context(0), update)
    return inner, view, update, plain, message


def release_norm(algorithm: Algorithm, view, message) -> float:
    return float(algorithm.release.release(view, message).norm())


# ----------------------------------------------------------------------------------------------------------- clipping


@pytest.mark.parametrize("name", sorted(BUILT_INS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_message_the_server_adds_is_within_the_clip(name, dtype):
    inner = BUILT_INS[name]()
    added: list = []
    clip = 0.8
    private = with_privacy(recording(inner, added), settings(clip))
    server = private.server_init(theta0(dtype))
    for t in (1, 2, 3):
        norms = [0.01, 0.2, 0.79, 0.81, 5.0, 300.0]
        messages = client_messages(private, server, norms, round_index=t)
        view = inner.broadcast(server.inner)
        unclipped = [release_norm(inner, view, m) for m in client_messages(inner, server.inner, norms, t)]
        assert 0 < sum(size > clip for size in unclipped) < len(norms)
        del added[:]
        server, metrics = private.server_update(server, messages, round_context(t, 6))
        assert len(added) == 6
        for message, size in zip(added, unclipped, strict=True):
            assert release_norm(inner, view, message) <= clip * (1 + 1e-6)
            assert release_norm(inner, view, message) == pytest.approx(min(size, clip), rel=1e-5)
        assert metrics["privacy_clipped_fraction"] == sum(size > clip for size in unclipped) / 6
        assert metrics["privacy_clip"] == clip and metrics["privacy_noise_std"] == 0.0
        assert "privacy_epsilon" not in metrics  # no δ, no accounting


@pytest.mark.parametrize("name", sorted(BUILT_INS))
def test_an_honest_client_under_the_clip_is_untouched(name):
    # SCAFFOLD's release, with Δc, is some 3.5 times longer than the update of norm 2
    inner, view, update, expected, message = finished_with_and_without_privacy(name, clip=10.0, norm=2.0, seed=1)
    for field in dataclasses.fields(expected):
        mine, theirs = getattr(message, field.name), getattr(expected, field.name)
        assert torch.equal(mine, theirs) if isinstance(theirs, torch.Tensor) else mine == theirs
    assert release_norm(inner, view, message) < 10.0
    if name == "fedavg":  # θ_k itself travels: the very tensor the client trained, not a copy
        assert message.params is update.final_params


@pytest.mark.parametrize("name", sorted(BUILT_INS))
def test_the_clients_clip_scales_the_released_vector_to_the_clip(name):
    inner, view, _, unclipped, message = finished_with_and_without_privacy(name, clip=0.5, norm=4.0, seed=2)
    released, original = inner.release.release(view, message), inner.release.release(view, unclipped)
    assert float(released.norm()) == pytest.approx(0.5, rel=1e-12)
    assert torch.allclose(released, original * (0.5 / float(original.norm())), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", sorted(BUILT_INS))
def test_a_forged_over_norm_message_is_rescaled_by_the_server(name):
    inner = BUILT_INS[name]()
    added: list = []
    private = with_privacy(recording(inner, added), settings(clip=1.0))
    server = private.server_init(theta0())
    view = inner.broadcast(server.inner)
    honest = client_messages(inner, server.inner, [0.5])[0]  # the unwrapped client: nothing clipped it
    direction = inner.release.release(view, honest) / release_norm(inner, view, honest)
    forged = inner.release.restore(view, honest, direction * 1000.0)
    fold = private.fold()
    sums = fold.add(fold.start(server, round_context()), forged)
    assert release_norm(inner, view, added[0]) == pytest.approx(1.0, rel=1e-12)
    assert torch.allclose(inner.release.release(view, added[0]), direction, rtol=1e-9, atol=1e-12)
    _, metrics = fold.finish(server, sums, round_context())
    assert metrics["privacy_clipped_fraction"] == 1.0
    # a message at the clip up to rounding is not rescaled again: the server adds the very object
    at_clip = inner.release.restore(view, honest, direction * (1.0 + 5e-6))
    fold.add(fold.start(server, round_context()), at_clip)
    assert added[-1] is at_clip


# ------------------------------------------------------------------------------------------- clip = ∞, z = 0: a no-op


@pytest.mark.parametrize("name", sorted(BUILT_INS))
def test_no_clip_and_no_noise_leave_the_server_update_bit_for_bit(name):
    inner = BUILT_INS[name]() if name != "fedavg" else fedavg.build(make_server_optimizer("adam"), "uniform")
    private = with_privacy(inner, settings(clip=math.inf))
    plain_server = inner.server_init(theta0(torch.float32))
    server = private.server_init(theta0(torch.float32))
    assert server.dimension == 0  # no central noise: nothing to size
    for t in (1, 2, 3, 4):
        norms = [0.3 * (t + k) for k in range(t % 3 + 1)]
        plain_messages = client_messages(inner, plain_server, norms, round_index=t)
        messages = client_messages(private, server, norms, round_index=t)
        plain_server, plain_metrics = inner.server_update(plain_server, plain_messages, round_context(t))
        server, metrics = private.server_update(server, messages, round_context(t))
        assert torch.equal(server.params, plain_server.params)
        for field in dataclasses.fields(plain_server):
            value = getattr(plain_server, field.name)
            if isinstance(value, torch.Tensor):
                assert torch.equal(getattr(server.inner, field.name), value)
        assert {key: value for key, value in metrics.items() if not key.startswith("privacy_")} == plain_metrics
        assert metrics["privacy_noise_std"] == 0.0 and "privacy_clip" not in metrics
    # a round where nobody reported leaves the state as it is
    empty, metrics = private.server_update(server, [], round_context(5, 0))
    assert empty.inner is server.inner and metrics["privacy_clipped_fraction"] == 0.0


def test_no_clip_and_no_noise_run_bit_for_bit_through_the_engine():
    overrides = ["rounds=3", "data.num_clients=6", "sampling.participation=0.5", "client.steps=2", "seed=5",
                 "algorithm.aggregation=uniform", "evaluation.every=100"]  # fmt: skip
    config = load_config(None, overrides)
    plain_sim, plain_state = build_simulation(config)
    sim, state = build_simulation(config)
    sim.algorithm = with_privacy(sim.algorithm, settings(clip=math.inf, population=6))
    state = dataclasses.replace(state, server=sim.algorithm.server_init(sim.initial_params))
    for _ in range(config.rounds):
        plain_state, plain_record = run_round(plain_sim, plain_state)
        state, record = run_round(sim, state)
        assert torch.equal(state.server.params, plain_state.server.params)
        assert record["upload_bits"] == plain_record["upload_bits"]
        assert record["download_bits"] == plain_record["download_bits"]


# ------------------------------------------------------------------------------------------------------ central noise


def drawn_noise(std: float, size: int, round_index: int, dtype=torch.float64, seed: int = SEED) -> torch.Tensor:
    """The central noise of a round, drawn as the mechanism promises: CPU, model dtype, from (seed, round)."""
    return (
        torch.randn(size, generator=seeded_torch_generator(seed, Stream.PRIVACY_NOISE, round_index), dtype=dtype) * std
    )


def test_central_noise_on_zero_messages_is_the_drawn_noise_over_m():
    private = with_privacy(mean_algorithm(), settings(clip=0.5, z=1.5))
    server = private.server_init(theta0())
    assert server.dimension == P
    messages = client_messages(private, server, [0.0, 0.0], round_index=2)  # θ_k = θ: nothing released
    assert all(not message.change.any() for message in messages)
    new, metrics = private.server_update(server, messages, round_context(2))
    assert torch.equal(new.params, server.params + drawn_noise(1.5 * 0.5, P, 2) / 4.0)
    assert metrics["privacy_noise_std"] == 0.75 and metrics["mean_metric"] == 1.0


def test_central_noise_reaches_scaffolds_model_over_m_and_its_control_over_n():
    inner = scaffold.build(sgd())
    private = with_privacy(inner, settings(clip=0.5, z=2.0))
    server = private.server_init(theta0())
    assert server.dimension == 2 * P
    view = inner.broadcast(server.inner)
    zero = scaffold.ClientMessage(torch.zeros(P, dtype=torch.float64), torch.zeros(P, dtype=torch.float64), 1)
    new, _ = private.server_update(server, [zero, zero], round_context(3, 2))
    xi = drawn_noise(1.0, 2 * P, 3)
    assert torch.allclose(new.params, view.params + xi[:P] / 4.0, rtol=0, atol=1e-15)  # η_g = 1, divided by m
    assert torch.allclose(new.inner.control, view.control + xi[P:] / 8.0, rtol=0, atol=1e-15)  # Σ Δc / N


def test_central_noise_reaches_fedavg_over_m_whoever_reported():
    added: list = []
    inner = fedavg.build(sgd(), "uniform")
    private = with_privacy(recording(inner, added), settings(clip=1.0, z=1.0))
    server = private.server_init(theta0())
    messages = client_messages(private, server, [0.2, 0.4])
    new, _ = private.server_update(server, messages, round_context(1, 2))
    # the carrier of the noise is folded first, with unit weight, then the clients' messages in their order
    assert len(added) == 3 and added[1:] == messages
    assert added[0].num_samples == 1 and added[0].multiplicity == 1
    view = inner.broadcast(server.inner)
    assert torch.allclose(inner.release.release(view, added[0]), drawn_noise(1.0, P, 1), rtol=0, atol=1e-14)
    released = sum(message.params - server.params for message in messages)
    expected = server.params + (drawn_noise(1.0, P, 1) + released) / 4.0  # m = 4, not the 2 that reported
    assert torch.allclose(new.params, expected, rtol=0, atol=1e-14)


@pytest.mark.parametrize("cohort", [None, 40.0])
def test_the_noise_has_the_std_it_promises(cohort):
    """Sample std of D = 200 000 coordinates against σ = zC (· m/M): its standard error is σ/√(2D); within 5 of them."""
    size = 200_000
    config = settings(clip=0.7, z=1.3, noise_cohort_size=cohort)
    sigma = 1.3 * 0.7 * (4.0 / cohort if cohort else 1.0)
    private = with_privacy(mean_algorithm(), config)
    server = private.server_init(torch.zeros(size, dtype=torch.float64))
    new, metrics = private.server_update(server, [], round_context(4, 0))
    noise = (new.params - server.params) * 4.0  # the sum's noise, divided by m in the mean
    assert metrics["privacy_noise_std"] == pytest.approx(sigma, rel=1e-12)
    assert abs(float(noise.std()) - sigma) < 5 * sigma / math.sqrt(2 * size)
    assert abs(float(noise.mean())) < 5 * sigma / math.sqrt(size)


def test_the_noise_depends_on_seed_and_round_only():
    def step(seed: int, round_index: int) -> torch.Tensor:
        private = with_privacy(mean_algorithm(), settings(clip=1.0, z=1.0, seed=seed))
        server = private.server_init(torch.zeros(P, dtype=torch.float64))
        return private.server_update(server, [], round_context(round_index, 0))[0].params

    assert torch.equal(step(SEED, 3), step(SEED, 3))
    assert not torch.equal(step(SEED, 3), step(SEED, 4))
    assert not torch.equal(step(SEED, 3), step(SEED + 1, 3))


def test_an_empty_round_with_noise_moves_the_model_by_the_noise_through_the_ordered_fold():
    private = with_privacy(mean_algorithm(), settings(clip=2.0, z=0.5))
    server = private.server_init(theta0())
    assert private.fold().finishes_empty
    folded = OrderedFold(private.fold(), server, round_context(6, 0), order=[]).result()
    assert torch.equal(folded.server.params, server.params + drawn_noise(1.0, P, 6) / 4.0)
    assert folded.metrics["privacy_clipped_fraction"] == 0.0 and folded.reporting_clients == []


def test_the_noise_is_drawn_on_the_cpu_in_the_models_dtype():
    private = with_privacy(mean_algorithm(), settings(clip=1.0, z=1.0))
    server = private.server_init(torch.zeros(P, dtype=torch.float32))
    new, _ = private.server_update(server, [], round_context(2, 0))
    assert new.params.dtype == torch.float32
    assert torch.equal(new.params, drawn_noise(1.0, P, 2, torch.float32) / 4.0)


# -------------------------------------------------------------------------------------------------------- local noise


def test_local_noise_is_the_clients_own_draw_deterministic_and_different_per_client():
    inner = mean_algorithm()
    config = settings(clip=1.0, z=0.8, noise="local")
    private = with_privacy(inner, config)
    server = private.server_init(theta0())
    view = private.broadcast(server)
    update = random_update(view.params, 3.0, seed=9)  # clipped to 1, then noised
    sent = {k: private.client_finish(view, None, context(k, 5), update)[1] for k in (0, 1)}
    again = private.client_finish(view, None, context(0, 5), update)[1]
    assert torch.equal(sent[0].change, again.change)
    assert not torch.equal(sent[0].change, sent[1].change)
    clipped = (update.final_params - view.params) / 3.0
    for k in (0, 1):
        stream = seeded_torch_generator(SEED, Stream.PRIVACY_LOCAL_NOISE, 5, k)
        draws = torch.randn(P, generator=stream, dtype=torch.float64)
        assert torch.allclose(sent[k].change, clipped + 0.8 * draws, rtol=0, atol=1e-12)
    # the server adds no noise of its own, keeps the noised messages whole and means over the reporting clients
    new, metrics = private.server_update(server, [sent[0], sent[1]], round_context(5, 2))
    assert server.dimension == 0
    assert torch.equal(new.params, view.params + (sent[0].change + sent[1].change) / 2)
    assert metrics["privacy_noise_std"] == 0.8 and "privacy_clipped_fraction" not in metrics


# -------------------------------------------------------------------------------------------------- adaptive clipping

ADAPTIVE = AdaptiveClipping(target_quantile=0.5, learning_rate=0.2, count_noise=0.5)


def test_adaptive_clipping_moves_the_clip_by_the_noised_count():
    config = settings(clip=1.0, adaptive=ADAPTIVE)
    private = with_privacy(mean_algorithm(), config)
    server = private.server_init(theta0())
    view = private.broadcast(server)
    assert isinstance(view, PrivateClientView) and view.clip == 1.0 and torch.equal(view.params, server.params)
    norms = [0.5, 0.9, 1.5, 2.0, 0.1]  # 3 within C_1 = 1
    messages = client_messages(private, server, norms, round_index=1)
    assert [message.within_clip for message in messages] == [True, True, False, False, True]
    new, metrics = private.server_update(server, messages, round_context(1, 5))
    noise = float(generator(SEED, Stream.PRIVACY_CLIP_COUNT, 1).standard_normal()) * 0.5
    fraction = (3 - 5 / 2 + noise) / 4.0 + 0.5  # b̃ = (Σ (b_k − ½) + N(0, σ_b²)) / m + ½ (within [0, 1] here)
    assert 0 < fraction < 1
    expected = 1.0 * math.exp(-0.2 * (fraction - 0.5))
    assert new.clip == pytest.approx(expected, rel=1e-15)
    assert metrics["privacy_clip"] == 1.0 and metrics["privacy_clipped_fraction"] == pytest.approx(2 / 5)
    # round 2 clips at C_2, and its view says so
    assert private.broadcast(new).clip == new.clip
    second = client_messages(private, new, [5.0], round_index=2)[0]
    assert float(second.payload.change.norm()) == pytest.approx(new.clip, rel=1e-12)
    # an empty round still moves the clip (nobody reported: b̃ = noise / m + ½)
    after, _ = private.server_update(new, [], round_context(2, 0))
    noise2 = float(generator(SEED, Stream.PRIVACY_CLIP_COUNT, 2).standard_normal()) * 0.5
    assert after.clip == pytest.approx(new.clip * math.exp(-0.2 * (noise2 / 4.0 + 0.5 - 0.5)), rel=1e-15)
    assert after.inner is new.inner


def test_adaptive_clipping_clamps_the_noised_fraction_to_0_and_1():
    loud = settings(clip=1.0, adaptive=dataclasses.replace(ADAPTIVE, count_noise=1e6))
    private = with_privacy(mean_algorithm(), loud)
    server = private.server_init(theta0())
    new, _ = private.server_update(server, [], round_context(1, 0))
    drawn = float(generator(SEED, Stream.PRIVACY_CLIP_COUNT, 1).standard_normal())
    fraction = 1.0 if drawn > 0 else 0.0  # a noise of 1e6 puts b̃ far outside [0, 1] before the clamp
    assert new.clip == pytest.approx(math.exp(-0.2 * (fraction - 0.5)), rel=1e-15)


def test_adaptive_clipping_noises_the_update_with_z_delta():
    config = settings(clip=1.0, z=1.0, adaptive=ADAPTIVE)  # σ_b = z/2 leaves nothing for the update: refused
    with pytest.raises(ConfigError, match="raise privacy.count_noise"):
        with_privacy(mean_algorithm(), config)
    config = settings(clip=1.0, z=1.0, adaptive=dataclasses.replace(ADAPTIVE, count_noise=2.0))
    private = with_privacy(mean_algorithm(), config)
    server = private.server_init(torch.zeros(P, dtype=torch.float64))
    new, metrics = private.server_update(server, [], round_context(1, 0))
    z_delta = (1.0 - 1 / 16) ** -0.5
    assert metrics["privacy_noise_std"] == pytest.approx(z_delta, rel=1e-12)
    assert torch.allclose(new.params, drawn_noise(z_delta, P, 1) / 4.0, rtol=1e-12, atol=0)


def test_the_private_message_codec_round_trips_over_the_inner_codec():
    private = with_privacy(mean_algorithm(), settings(clip=1.0, adaptive=ADAPTIVE))
    server = private.server_init(theta0())
    message = client_messages(private, server, [3.0])[0]
    codec = private.codec
    assert codec.unplanned == ("within_clip",)
    rebuilt = codec.from_wire(codec.to_wire(message), server.params)
    assert rebuilt.within_clip is False and torch.equal(rebuilt.payload.change, message.payload.change)
    with pytest.raises(ValueError, match="a MeanMessage arrived, a PrivateMessage was expected"):
        codec.from_wire(message.payload, server.params)
    with pytest.raises(ValueError, match="not a bool"):
        codec.from_wire(PrivateMessage(message.payload, 1), server.params)
    # composed over a codec that changes what travels (as compression's does)
    inner = MessageCodec(lambda m: ("sent", m), lambda sent, start: sent[1], unplanned=("bits",))
    composed = mechanism.private_codec(inner)
    assert composed.to_wire(message) == PrivateMessage(("sent", message.payload), False)
    assert composed.from_wire(composed.to_wire(message), server.params) == message
    assert composed.unplanned == ("within_clip", "payload/bits")


def test_without_adaptive_clipping_views_messages_and_codec_are_the_algorithms():
    inner = fedavg.build(sgd(), "uniform")
    private = with_privacy(inner, settings(clip=1.0, z=1.0))
    server = private.server_init(theta0())
    assert isinstance(server, PrivateServerState) and server.params is server.inner.params
    assert isinstance(private.broadcast(server), fedavg.ClientView)
    assert isinstance(client_messages(private, server, [2.0])[0], fedavg.ClientMessage)
    assert private.codec is inner.codec
    assert private.name == "fedavg" and private.client_state_init is inner.client_state_init
    assert private.release is None and private.release_refusal == "the algorithm is private already"


def test_membership_hooks_reach_the_wrapped_state():
    inner = feddyn.build(alpha=0.1)
    private = with_privacy(inner, settings(clip=1.0))
    server = private.server_init(theta0())
    client = dataclasses.replace(inner.client_state_init(theta0()), dual=torch.ones(P, dtype=torch.float64))
    joined = private.client_joined(server, client)
    assert torch.equal(joined.inner.dual_sum, inner.client_joined(server.inner, client).dual_sum)
    assert joined.clip == server.clip


# ---------------------------------------------------------------------------------------------------------- accounting


def test_epsilon_is_recorded_every_round_when_delta_is_set():
    accounting = pytest.importorskip("driftlab.privacy.accounting")
    pytest.importorskip("opacus")
    config = settings(clip=1.0, z=1.1, delta=1e-3)
    private = with_privacy(mean_algorithm(), config)
    server = private.server_init(theta0())
    for t in (1, 2):
        server, metrics = private.server_update(server, [], round_context(t, 0))
        assert metrics["privacy_epsilon"] == accounting.run_epsilon(config, t)
    assert metrics["privacy_epsilon"] > accounting.run_epsilon(config, 1) > 0
    # no noise: ε is ∞, left out (every recorded number must be finite); the report reads ∞ from the zero std
    _, metrics = with_privacy(mean_algorithm(), settings(clip=1.0, delta=1e-3)).server_update(
        server, [], round_context(3, 0)
    )
    assert "privacy_epsilon" not in metrics and metrics["privacy_noise_std"] == 0.0


# ------------------------------------------------------------------------------------------------------------ refusals


def test_refusals_name_the_fix():
    with pytest.raises(ConfigError, match='set algorithm.aggregation = "uniform"') as weighted:
        with_privacy(fedavg.build(sgd(), "weighted"), settings())
    assert (
        str(weighted.value) == f'[privacy] with algorithm.name = "fedavg": {fedavg.WEIGHTED_REFUSAL}'
    )  # the one template
    with pytest.raises(ConfigError) as plugin:
        with_privacy(dataclasses.replace(mean_algorithm(form=False), name="moon"), settings())
    assert str(plugin.value) == (
        '[privacy] with algorithm.name = "moon": it gives no release form (seam.ReleaseForm: the vector its message '
        "reveals), so its sensitivity cannot be bounded; give Algorithm(release=ReleaseForm(release, restore)) "
        "(docs/design.md, Client-level differential privacy)"
    )
    with pytest.raises(
        ConfigError, match='^\\[privacy\\] with algorithm.name = "mean": the algorithm is private already$'
    ):
        with_privacy(with_privacy(mean_algorithm(), settings()), settings())
    with pytest.raises(ConfigError, match="set privacy.clip to a finite norm"):
        with_privacy(mean_algorithm(), settings(clip=math.inf, z=1.0))
    with pytest.raises(ConfigError, match='set privacy.noise = "central"'):
        with_privacy(mean_algorithm(), settings(noise="local", adaptive=ADAPTIVE))


def test_an_algorithm_that_sends_nothing_for_a_still_client_cannot_size_its_noise():
    silent = dataclasses.replace(mean_algorithm(), client_finish=lambda view, client, context, update: (None, None))
    private = with_privacy(silent, settings(z=1.0))
    with pytest.raises(ConfigError, match="length of its released vector"):
        private.server_init(theta0())


def test_central_noise_runs_through_the_engine_repeatably_and_moves_empty_rounds():
    overrides = ["rounds=6", "data.num_clients=6", "sampling.mode=poisson", "sampling.participation=0.2",
                 "client.steps=2", "seed=3", "algorithm.aggregation=uniform", "evaluation.every=100"]  # fmt: skip
    config = load_config(None, overrides)

    def run() -> tuple[list[torch.Tensor], list[dict]]:
        sim, state = build_simulation(config)
        sim.algorithm = with_privacy(
            sim.algorithm, settings(clip=0.5, z=1.0, seed=3, sampling_rate=0.2, expected_cohort=1.2)
        )
        state = dataclasses.replace(state, server=sim.algorithm.server_init(sim.initial_params))
        models, records = [state.server.params], []
        for _ in range(config.rounds):
            state, record = run_round(sim, state)
            models.append(state.server.params)
            records.append(record)
        return models, records

    models, records = run()
    again, _ = run()
    assert all(torch.equal(a, b) for a, b in zip(models, again, strict=True))
    assert [record["num_reporting"] for record in records][:2] == [0, 0]  # seed 3: nobody in rounds 1 and 2
    for before, after, record in zip(models[:-1], models[1:], records, strict=True):
        assert not torch.equal(before, after)  # every round releases its noise, reported or not
        assert record["privacy_clip"] == 0.5 and record["privacy_noise_std"] == 0.5


# ----------------------------------------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class Extended(Algorithm):
    """An ``Algorithm`` with a field the wrapper was written without: it must flow through untouched."""

    extra: str = "unset"


def extended(algorithm: Algorithm, extra: str) -> Extended:
    return Extended(
        **{field.name: getattr(algorithm, field.name) for field in dataclasses.fields(Algorithm)}, extra=extra
    )


def test_the_private_bundle_forwards_every_field_it_does_not_change():
    inner = dataclasses.replace(extended(scaffold.build(sgd()), "a later field"), plugin="algorithm plugin 'x' (x.py)")
    private = with_privacy(inner, settings(clip=1.0))
    assert isinstance(private, Extended) and private.extra == "a later field"
    assert (private.name, private.plugin, private.client_state_init) == (
        inner.name,
        inner.plugin,
        inner.client_state_init,
    )
    assert private.server_fold is not inner.server_fold and private.release is None and not private.asynchronous


def test_an_algorithm_with_views_of_their_own_is_refused_rather_than_sent_the_broadcast():
    inner = fedavg.build(sgd(), aggregation="uniform")
    own_views = dataclasses.replace(inner, client_view=lambda server, client_id, states: inner.broadcast(server))
    with pytest.raises(ConfigError, match=r"a view of its own \(Algorithm.client_view\).*remove \[privacy\]"):
        with_privacy(own_views, settings(clip=1.0))
