import numpy as np
import pytest
import torch

from driftlab.data.quadratic import (
    CONTINUOUS_MINIMIZER,
    QuadraticObjective,
    random_quadratic_clients,
    scalar_quadratic_clients,
    surrogate_minimizer,
)


def test_scalar_family_minimiser_approaches_the_continuous_value():
    data = scalar_quadratic_clients(400)
    assert data.known_minimizer.shape == (1,)
    assert abs(data.known_minimizer[0] - CONTINUOUS_MINIMIZER) < 2e-3
    assert abs(CONTINUOUS_MINIMIZER - 0.5234) < 1e-4


def test_client_weights_follow_inverse_square_root_of_curvature():
    data = scalar_quadratic_clients(5)
    z = np.linspace(1, 3, 5)
    sizes = data.client_sizes.astype(float)
    np.testing.assert_allclose(sizes / sizes[0], 1 / np.sqrt(z), rtol=2e-3)
    # the minimiser is computed from the integer weights actually used
    p = sizes / sizes.sum()
    assert data.known_minimizer[0] == pytest.approx((p * 1.0).sum() / (p * z).sum(), rel=1e-12)


def test_objective_rows_evaluate_the_client_function():
    model = QuadraticObjective(1)
    with torch.no_grad():
        model.x.fill_(0.5)
    rows = torch.tensor([[2.0, 1.0], [3.0, 1.0]])
    # ½ z x² − x at x = 0.5: z=2 → 0.25 − 0.5; z=3 → 0.375 − 0.5
    torch.testing.assert_close(model(rows), torch.tensor([-0.25, -0.125]))


def test_surrogate_equals_minimiser_for_one_local_step_and_differs_for_many():
    z = np.linspace(1, 3, 50)
    p = (1 / np.sqrt(z)) / (1 / np.sqrt(z)).sum()
    exact = (p / 1).sum() / (p * z).sum()
    assert surrogate_minimizer(z, p, 0.1, 1) == pytest.approx(exact, rel=1e-12)
    assert abs(surrogate_minimizer(z, p, 0.1, 10) - exact) > 0.02


def test_multidimensional_minimiser_is_a_stationary_point():
    data = random_quadratic_clients(6, 4, seed=1)
    x = torch.tensor(data.known_minimizer, dtype=torch.float64, requires_grad=True)
    model = QuadraticObjective(4).double()
    objective = torch.func.functional_call(model, {"x": x}, (data.train_inputs.double(),)).mean()
    (gradient,) = torch.autograd.grad(objective, x)
    assert float(gradient.norm()) < 1e-5


def test_bad_quadratic_inputs_are_rejected():
    with pytest.raises(ValueError, match="num_clients"):
        scalar_quadratic_clients(0)


def test_the_quadratic_starts_where_model_start_says():
    import driftlab

    config = driftlab.load_config("quadratic-constant-k", overrides=["model.start=0.4", "rounds=1"])
    first = driftlab.run(config).records[0]
    plain = driftlab.run(driftlab.load_config("quadratic-constant-k", overrides=["rounds=1"])).records[0]
    assert first["distance_to_minimizer"] != plain["distance_to_minimizer"]
    from driftlab.data.quadratic import QuadraticObjective

    assert torch.equal(QuadraticObjective(3, start=0.4).x.detach(), torch.full((3,), 0.4))
    assert QuadraticObjective(2).x.tolist() == [0.0, 0.0]
    assert config.fingerprint() != driftlab.load_config("quadratic-constant-k", overrides=["rounds=1"]).fingerprint()
