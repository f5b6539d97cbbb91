"""Local SGD: minibatch plans, the corrected step (clip, quadratic term, weight decay), decaying K in a run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import driftlab
from driftlab.data.federated import FederatedDataset
from driftlab.models import build_model
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import (
    PAD,
    BoundModule,
    ClientTask,
    LocalSettings,
    SequentialBackend,
    TrainingData,
    batch_plan,
    corrected_step,
    objective_gradient_norm,
    steps_for_epochs,
)
from driftlab.simulation.backends.objectives import LocalObjective, LocalStep, LossTerm
from driftlab.simulation.round.sampling import clients_per_round
from driftlab.simulation.seam import NO_CORRECTION, GradientCorrection

# ------------------------------------------------------------------ batch_plan


def test_batch_plan_shape_padding_and_epoch_permutations():
    n, batch, epochs = 7, 3, 4
    per_epoch = math.ceil(n / batch)
    plan = batch_plan(seed=1, round_index=2, client_id=5, num_samples=n, batch_size=batch, num_steps=per_epoch * epochs)
    assert plan.shape == (per_epoch * epochs, batch)
    assert plan.dtype == np.int64
    for epoch in range(epochs):
        rows = plan[epoch * per_epoch : (epoch + 1) * per_epoch]
        # the last batch of an epoch is short: 7 = 3 + 3 + 1, padded with PAD
        assert (rows[:-1] != PAD).all()
        assert (rows[-1] == PAD).sum() == per_epoch * batch - n
        assert rows[-1][0] != PAD and (rows[-1][1:] == PAD).all()
        # each epoch visits every sample exactly once
        assert sorted(rows[rows != PAD].tolist()) == list(range(n))
    # fresh permutations: epochs are not all in the same order
    orders = {
        tuple(plan[e * per_epoch : (e + 1) * per_epoch][plan[e * per_epoch : (e + 1) * per_epoch] != PAD])
        for e in range(epochs)
    }
    assert len(orders) > 1


def test_batch_plan_fixed_step_count_is_a_prefix_of_longer_work():
    long = batch_plan(3, 4, 2, num_samples=23, batch_size=5, num_steps=17)
    for k in (0, 1, 4, 5, 6, 11):
        short = batch_plan(3, 4, 2, num_samples=23, batch_size=5, num_steps=k)
        assert short.shape == (k, 5)
        assert np.array_equal(short, long[:k])


def test_batch_plan_is_determined_by_seed_round_and_client():
    args = dict(num_samples=30, batch_size=4, num_steps=12)
    reference = batch_plan(0, 1, 0, **args)
    assert np.array_equal(reference, batch_plan(0, 1, 0, **args))
    assert not np.array_equal(reference, batch_plan(1, 1, 0, **args))  # seed
    assert not np.array_equal(reference, batch_plan(0, 2, 0, **args))  # round
    assert not np.array_equal(reference, batch_plan(0, 1, 1, **args))  # client


def test_batch_plan_batch_larger_than_client_uses_the_whole_client():
    plan = batch_plan(0, 1, 0, num_samples=4, batch_size=10, num_steps=3)
    assert plan.shape == (3, 4)
    for row in plan:
        assert sorted(row.tolist()) == [0, 1, 2, 3]


def test_batch_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_samples"):
        batch_plan(0, 1, 0, num_samples=0, batch_size=3, num_steps=1)
    with pytest.raises(ValueError):
        batch_plan(0, 1, 0, num_samples=5, batch_size=0, num_steps=1)


def test_steps_for_epochs():
    assert steps_for_epochs(7, 3, 2) == 6  # 2 · ⌈7/3⌉
    assert steps_for_epochs(10, 10, 1) == 1
    assert steps_for_epochs(1, 10, 3) == 3
    assert steps_for_epochs(101, 10, 5) == 55


# ------------------------------------------------------------------ corrected_step


def _vec(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_plain_sgd_step():
    theta, grad = _vec(1.0, 2.0, -1.0), _vec(0.5, -0.25, 2.0)
    out = corrected_step(theta, grad, NO_CORRECTION, LocalSettings(0.1))
    assert out.tolist() == pytest.approx([0.95, 2.025, -1.2])


@pytest.mark.parametrize("clip", [0.5, 1.0, 100.0])
def test_clipping_matches_torch_clip_grad_norm(clip):
    theta, grad = _vec(1.0, 2.0, -1.0, 0.0), _vec(3.0, -4.0, 1.0, 2.0)
    parameter = torch.nn.Parameter(theta.clone())
    parameter.grad = grad.clone()
    torch.nn.utils.clip_grad_norm_([parameter], clip)
    expected = theta - 0.1 * parameter.grad
    out = corrected_step(theta, grad, NO_CORRECTION, LocalSettings(0.1, clip_norm=clip))
    assert torch.allclose(out, expected, rtol=0, atol=1e-15)
    if clip == 100.0:
        assert torch.equal(out, theta - 0.1 * grad)  # below the threshold: untouched


def test_linear_correction_is_clipped_quadratic_and_weight_decay_are_not():
    theta = _vec(1.0, -2.0)
    grad = _vec(2.0, 1.0)
    linear = _vec(1.0, 3.0)  # g + a = (3, 4), norm 5
    quadratic = _vec(0.5, 2.0)
    reference = _vec(0.0, 1.0)
    lr, wd, clip = 0.1, 0.01, 1.0
    correction = GradientCorrection(linear=linear, quadratic=quadratic, reference=reference)
    out = corrected_step(theta, grad, correction, LocalSettings(lr, weight_decay=wd, clip_norm=clip))
    scale = clip / (5.0 + 1e-6)
    g = [3.0 * scale, 4.0 * scale]
    g = [g[0] + 0.5 * (1.0 - 0.0), g[1] + 2.0 * (-2.0 - 1.0)]  # quadratic term after clipping
    g = [g[0] + wd * 1.0, g[1] + wd * -2.0]  # weight decay after clipping
    expected = [1.0 - lr * g[0], -2.0 - lr * g[1]]
    assert out.tolist() == pytest.approx(expected, abs=1e-12)


def test_scalar_quadratic_and_weight_decay_without_clipping():
    theta, grad = _vec(2.0, 0.0), _vec(0.0, 1.0)
    correction = GradientCorrection(quadratic=0.3, reference=_vec(1.0, 1.0))
    out = corrected_step(theta, grad, correction, LocalSettings(0.5, weight_decay=0.1))
    # g = (0, 1) + 0.3·((2,0) − (1,1)) + 0.1·(2, 0) = (0.5, 0.7)
    assert out.tolist() == pytest.approx([2.0 - 0.25, 0.0 - 0.35])


def test_quadratic_needs_a_reference():
    with pytest.raises(ValueError, match="reference"):
        GradientCorrection(quadratic=0.1)


# ------------------------------------------------------------------ the sequential backend against a hand loop


def test_sequential_backend_is_minibatch_sgd_over_the_batch_plan():
    torch.manual_seed(0)
    inputs = torch.randn(9, 3, dtype=torch.float64)
    targets = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2])
    model = FlatModel.wrap(build_model("mlr", (3,), 3)).to("cpu", torch.float64)
    theta0 = model.initial_parameters()
    rows = torch.tensor([8, 1, 4, 6, 2], dtype=torch.long)
    batches = batch_plan(0, 1, 7, num_samples=5, batch_size=2, num_steps=4)
    settings = LocalSettings(0.3, weight_decay=0.01)
    task = ClientTask(7, rows, batches, NO_CORRECTION)
    items = list(SequentialBackend().train(model, theta0, [task], settings, TrainingData(inputs, targets)))
    assert len(items) == 1 and items[0][0] == 0
    result = items[0][1]

    theta = theta0.clone()
    for step in range(4):
        positions = [p for p in batches[step].tolist() if p != PAD]
        chosen = rows[positions]
        leaf = theta.clone().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(model.forward(leaf, inputs[chosen]), targets[chosen])
        (gradient,) = torch.autograd.grad(loss, leaf)
        theta = theta - 0.3 * (gradient + 0.01 * theta)
    assert torch.allclose(result, theta, rtol=0, atol=1e-12)
    assert not torch.allclose(result, theta0)


# ------------------------------------------------------------------ loss terms and local steps (objectives.py)


def _one_client_setup():
    torch.manual_seed(0)
    inputs = torch.randn(9, 3, dtype=torch.float64)
    targets = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2])
    model = FlatModel.wrap(build_model("mlr", (3,), 3)).to("cpu", torch.float64)
    rows = torch.tensor([8, 1, 4, 6, 2], dtype=torch.long)
    return model, TrainingData(inputs, targets), rows


def test_a_loss_term_is_differentiated_through_the_outputs_and_the_parameters_by_hand():
    model, data, rows = _one_client_setup()
    theta0 = model.initial_parameters()
    batches = batch_plan(0, 1, 7, num_samples=5, batch_size=2, num_steps=3)
    anchor = torch.linspace(-1, 1, theta0.numel(), dtype=torch.float64)

    def term(batch, anchor):  # a function of the outputs (weighted batch mean) and of θ directly
        return 0.3 * (batch.weights * batch.outputs.pow(2).sum(dim=1)).sum() + 0.2 * torch.sum(
            (batch.params - anchor) ** 2
        )

    settings = LocalSettings(0.3, clip_norm=0.8)
    task = ClientTask(7, rows, batches, LocalObjective(loss_term=LossTerm(term, (anchor,))))
    ((_, result, done),) = list(SequentialBackend().train(model, theta0, [task], settings, data))

    theta = theta0.clone()
    for step in range(3):
        chosen = rows[[p for p in batches[step].tolist() if p != PAD]]
        leaf = theta.clone().requires_grad_(True)
        outputs = model.forward(leaf, data.inputs[chosen])
        loss = (
            torch.nn.functional.cross_entropy(outputs, data.targets[chosen])
            + 0.3 * outputs.pow(2).sum(dim=1).mean()
            + 0.2 * torch.sum((leaf - anchor) ** 2)
        )
        (gradient,) = torch.autograd.grad(loss, leaf)
        gradient = gradient * min(1.0, 0.8 / (float(gradient.norm()) + 1e-6))  # the term is clipped with the loss
        theta = theta - 0.3 * gradient
    assert done == 3
    torch.testing.assert_close(result, theta, rtol=0, atol=1e-12)


def test_the_stopping_norm_of_an_objective_with_a_loss_term_includes_the_term():
    model, data, rows = _one_client_setup()
    theta = model.initial_parameters()
    shift = torch.linspace(0.5, -0.5, theta.numel(), dtype=torch.float64)
    bound = BoundModule(model, theta)
    settings = LocalSettings(0.1, weight_decay=0.01)
    batches = batch_plan(0, 1, 7, 5, 2, 1)
    # ⟨shift, θ⟩ as a loss term has the gradient of the linear correction a = shift
    as_term = ClientTask(7, rows, batches, LossTerm(lambda batch, shift: torch.dot(batch.params, shift), (shift,)))
    as_correction = ClientTask(7, rows, batches, GradientCorrection(linear=shift))
    without = ClientTask(7, rows, batches, NO_CORRECTION)
    norm = objective_gradient_norm(bound, theta, as_term, settings, data)
    assert norm == pytest.approx(objective_gradient_norm(bound, theta, as_correction, settings, data), rel=1e-12)
    assert norm != pytest.approx(objective_gradient_norm(bound, theta, without, settings, data), rel=1e-3)


def test_a_local_step_keeps_its_state_across_steps_and_restarts_it_every_round():
    model, data, rows = _one_client_setup()
    theta0 = model.initial_parameters()
    seen = []

    def counting_sgd(params, gradient, state, learning_rate):
        (count,) = state
        seen.append(int(count))
        return params - learning_rate * gradient, (count + 1,)

    task = ClientTask(
        7, rows, batch_plan(0, 1, 7, 5, 2, 3), LocalObjective(local_step=LocalStep(counting_sgd, (torch.tensor(0),)))
    )
    default = ClientTask(7, rows, task.batches, NO_CORRECTION)
    backend = SequentialBackend()
    for _ in range(2):
        ((_, final, done),) = list(backend.train(model, theta0, [task], LocalSettings(0.1), data))
        ((_, expected, _),) = list(backend.train(model, theta0, [default], LocalSettings(0.1), data))
        assert done == 3 and torch.equal(final, expected)
    assert seen == [0, 1, 2, 0, 1, 2]


# ------------------------------------------------------------------ clients on single-threaded threads


def test_clients_on_parallel_threads_give_the_same_models_and_restore_the_thread_count():
    torch.manual_seed(0)
    inputs, targets = torch.randn(60, 1, 4, 4), torch.randint(0, 3, (60,))
    model = FlatModel.wrap(build_model("mlp", (1, 4, 4), 3, hidden=(6,)))
    theta0 = model.initial_parameters()
    term = LossTerm(lambda batch, anchor: torch.sum((batch.params - anchor) ** 2), (theta0,))
    objectives = [
        NO_CORRECTION,
        GradientCorrection(linear=torch.full_like(theta0, 0.01)),
        term,
        NO_CORRECTION,
        term,
        NO_CORRECTION,
    ]
    tasks = [
        ClientTask(k, torch.arange(10 * k, 10 * k + 10), batch_plan(0, 1, k, 10, 3, 4 + k), objective)
        for k, objective in enumerate(objectives)
    ]
    settings, data = LocalSettings(0.1, clip_norm=1.0), TrainingData(inputs, targets)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        parallel = SequentialBackend()
        assert (
            parallel.workers(theta0, len(tasks)) == 2
            and SequentialBackend(parallel_clients=False).workers(theta0, len(tasks)) == 1
        )
        for _ in range(2):  # a second round reuses the bound copies
            together = {p: (t, d) for p, t, d in parallel.train(model, theta0, tasks, settings, data)}
            assert torch.get_num_threads() == 2
            alone = {
                p: (t, d)
                for p, t, d in SequentialBackend(parallel_clients=False).train(model, theta0, tasks, settings, data)
            }
            assert sorted(together) == list(range(len(tasks)))
            for position, (params, done) in alone.items():
                assert together[position][1] == done and torch.equal(together[position][0], params)
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ decaying K through a run


def test_decaying_local_steps_follow_the_schedule_in_the_records():
    k0, decay, num_clients, participation = 9, 0.6, 8, 0.5
    result = driftlab.run(
        None,
        overrides=[
            "rounds=6",
            f"data.num_clients={num_clients}",
            f"sampling.participation={participation}",
            f'client.steps={{kind="exponential", initial={k0}, decay={decay}}}',
            "evaluation.every=100",
        ],
    )
    clients = clients_per_round(participation, num_clients)
    steps = [r["local_steps"] for r in result.records]
    expected = [max(1, math.ceil(k0 * decay ** (t - 1))) * clients for t in range(1, 7)]
    assert steps == expected
    assert expected == [36, 24, 16, 8, 8, 4]  # K_t = 9, ⌈5.4⌉, ⌈3.24⌉, ⌈1.94⌉, ⌈1.17⌉, max(1, ⌈0.70⌉), × 4 clients
    assert result.summary["local_steps"] == sum(expected)


def test_epochs_give_per_client_step_counts():
    result = driftlab.run(
        None,
        overrides=[
            "rounds=1",
            "data.num_clients=5",
            "sampling.participation=1.0",
            "client.epochs=2",
            "client.batch_size=50",
        ],
    )
    from driftlab.experiments.run.runner import build_simulation

    sim, _ = build_simulation(result.config)
    expected = sum(steps_for_epochs(int(n), 50, 2) for n in sim.data.client_sizes)
    assert result.records[0]["local_steps"] == expected


def test_inverse_time_local_steps_in_a_run():
    result = driftlab.run(
        None,
        overrides=[
            "rounds=4",
            "data.num_clients=5",
            "sampling.participation=0.2",
            'client.steps={kind="inverse_time", a=10, b=1}',
            "evaluation.every=100",
        ],
    )
    assert [r["local_steps"] for r in result.records] == [
        max(1, math.ceil(10 / (1 + t))) for t in range(1, 5)
    ]  # 5, 4, 3, 2


def test_tiny_data_set_trains_with_padding():
    data = FederatedDataset(
        "t",
        torch.randn(5, 2),
        torch.tensor([0, 1, 0, 1, 0]),
        torch.randn(2, 2),
        torch.tensor([0, 1]),
        (np.array([0, 1, 2], dtype=np.int64), np.array([3, 4], dtype=np.int64)),
        num_classes=2,
    )
    assert data.client_sizes.tolist() == [3, 2]
    model = FlatModel.wrap(build_model("mlr", (2,), 2))
    theta0 = model.initial_parameters()
    task = ClientTask(0, torch.tensor([0, 1, 2]), batch_plan(0, 1, 0, 3, 2, 4), NO_CORRECTION)
    ((position, final, *_),) = list(
        SequentialBackend().train(
            model, theta0, [task], LocalSettings(0.1), TrainingData(data.train_inputs, data.train_targets)
        )
    )
    assert position == 0 and torch.isfinite(final).all() and not torch.equal(final, theta0)


# ------------------------------------------------------------------ uint8 images normalised batch by batch


def _pixel_run(
    backend_name: str,
    data: FederatedDataset,
    model_name: str,
    augment: bool,
    dtype: torch.dtype,
    algorithm_name: str = "fedavg",
):
    """Final parameters after two rounds, and the evaluation at them."""
    from driftlab.algorithms import fedavg, fedprox
    from driftlab.experiments.run.runner import BACKENDS
    from driftlab.optim.server import make_server_optimizer
    from driftlab.simulation.evaluation import evaluate
    from driftlab.simulation.round.engine import run_round
    from driftlab.simulation.round.setup import Simulation, SimulationState
    from driftlab.simulation.state.state_store import InMemoryClientStore
    from driftlab.simulation.testing import seeded_model, small_plan

    model = seeded_model(model_name, data.input_shape, hidden=(16,), dtype=dtype)
    theta = model.initial_parameters()
    gamma = 0.9 if algorithm_name == "fedprox" else None
    plan = small_plan(client_lr=0.05, local_epochs=2, augment=augment, inexact_gamma=gamma)
    algorithm = (
        fedprox.build(make_server_optimizer("sgd"), mu=0.1) if gamma else fedavg.build(make_server_optimizer("sgd"))
    )
    sim = Simulation(model, data, algorithm, BACKENDS[backend_name](), plan, torch.device("cpu"), dtype, theta)
    state = SimulationState(0, algorithm.server_init(theta), InMemoryClientStore(None))
    for _ in range(2):
        state, _ = run_round(sim, state)
    return state.server.params, evaluate(sim, state.server.params)


def _pixel_data(channels: int, size: int, normalise: bool) -> FederatedDataset:
    from driftlab.data.pixels import PixelNormalisation

    generator = torch.Generator().manual_seed(1)
    pixels = torch.randint(0, 256, (48, channels, size, size), generator=generator, dtype=torch.uint8)
    labels = torch.randint(0, 3, (48,), generator=generator)
    norm = (
        PixelNormalisation((0.1307,), (0.3081,))
        if channels == 1
        else PixelNormalisation((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    )
    clients = tuple(np.arange(i * 10, i * 10 + 10) for i in range(4))
    if normalise:  # as the loaders gave it: the whole set normalised up front
        return FederatedDataset("float", norm(pixels[:40]), labels[:40], norm(pixels[40:]), labels[40:], clients, 3)
    return FederatedDataset(
        "pixels", pixels[:40], labels[:40], pixels[40:], labels[40:], clients, 3, input_normalisation=norm
    )


@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
@pytest.mark.parametrize(
    "channels, size, model_name, augment, dtype, algorithm_name",
    [
        (1, 8, "mlp", False, torch.float32, "fedavg"),  # MNIST-like; the vectorized backend's fused MLP
        (1, 8, "mlp", False, torch.float64, "fedprox"),  # a float64 run, and γ-inexact stopping's full gradients
        (
            3,
            32,
            "cnn",
            True,
            torch.float32,
            "fedavg",
        ),  # CIFAR-like with flip and pad-crop (padding the normalised image)
    ],
)
def test_uint8_images_train_and_evaluate_bit_for_bit_as_their_normalised_floats(
    backend, channels, size, model_name, augment, dtype, algorithm_name
):
    floats, float_metrics = _pixel_run(
        backend, _pixel_data(channels, size, normalise=True), model_name, augment, dtype, algorithm_name
    )
    pixels, pixel_metrics = _pixel_run(
        backend, _pixel_data(channels, size, normalise=False), model_name, augment, dtype, algorithm_name
    )
    assert torch.equal(pixels, floats)
    assert pixel_metrics == float_metrics
    assert float_metrics["test_loss"] > 0
