"""The built-in algorithms' ``ReleaseForm``s (seam.py) and their folds under a public ``mean_denominator``.

A form promises (seam.ReleaseForm): the server update depends on the round's
messages only through ``Σ_P release(m_k)`` with unit weight per message, its
means over reporting clients divide by ``RoundContext.mean_denominator`` when
set, and ``restore(view, None, z)`` is a carrier that the fold counts once.
Checked here for the six built-in algorithms, in one parametrized list and in
a hand-computed round each.  Numbers are multiples of 1/4 in float64, so every
sum and division by 2, 4 or 8 here is exact and the checks compare bits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

from driftlab.algorithms import adabest, apfl, ditto, efl, fedamp, fedavg, feddyn, fedgate, fedprox, mime, scaffold
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.seam import Algorithm, RoundContext

D = 3  # model size in the parametrized cases
NUM_REGISTERED = 8


def sgd() -> Any:
    return make_server_optimizer("sgd")


def quarters(*shape: int, seed: int) -> torch.Tensor:
    """Multiples of 1/4 in [−2, 2]: sums and halvings stay exact in float64."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=generator).to(torch.float64) / 4


def context(mean_denominator: float | None, num_registered: int = NUM_REGISTERED, lr: float = 1.0) -> RoundContext:
    return RoundContext(
        round=3,
        num_registered=num_registered,
        num_selected=4,
        server_learning_rate=lr,
        mean_denominator=mean_denominator,
    )


# ---------------------------------------------------------------- the six algorithms, as cases


@dataclass(frozen=True)
class Case:
    """A private configuration of one algorithm, a server state whose extra fields are not zero, a message
    template per client (its fields other than the released ones as a real client sends them), and the
    server state the algorithm must reach from ``S = Σ release + z`` (hand-derived from its update rule)."""

    name: str
    algorithm: Callable[[], Algorithm]
    server: Callable[[Algorithm, torch.Tensor], Any]
    template: Callable[[int], Any]
    released_size: int  # in units of D
    expected: Callable[[Any, torch.Tensor, float], dict[str, torch.Tensor]]  # (server, S, m) -> fields


def plain_server(algorithm: Algorithm, params: torch.Tensor) -> Any:
    return algorithm.server_init(params)


def scaffold_server(algorithm: Algorithm, params: torch.Tensor) -> Any:
    return dataclasses.replace(algorithm.server_init(params), control=quarters(D, seed=11))


def feddyn_server(algorithm: Algorithm, params: torch.Tensor) -> Any:
    return dataclasses.replace(algorithm.server_init(params), dual_sum=quarters(D, seed=12))


def adabest_server(algorithm: Algorithm, params: torch.Tensor) -> Any:
    return dataclasses.replace(algorithm.server_init(params), client_average=quarters(D, seed=13))


def efl_server(algorithm: Algorithm, params: torch.Tensor) -> Any:
    return dataclasses.replace(
        algorithm.server_init(params), fisher_sum=quarters(D, seed=14).abs(), weighted_model_sum=quarters(D, seed=15)
    )


def zeros() -> torch.Tensor:
    return torch.zeros(D, dtype=torch.float64)


def efl_template(k: int) -> efl.ClientMessage:
    # Client 1 is a straggler kept with its plain weight (incomplete = "plain").
    return efl.ClientMessage(
        zeros(), zeros(), zeros(), num_samples=5 + 3 * k, multiplicity=1, completed_fraction=0.5 if k == 1 else 1.0
    )


BETA = 0.5
CASES = [
    Case(
        "fedavg",
        lambda: fedavg.build(sgd(), aggregation="uniform"),
        plain_server,
        lambda k: fedavg.ClientMessage(zeros(), num_samples=5 + 3 * k, multiplicity=1),
        1,
        lambda server, total, m: {"params": server.params + total / m},
    ),
    Case(
        "fedprox",
        lambda: fedprox.build(sgd(), mu=0.25, aggregation="uniform"),
        plain_server,
        lambda k: fedavg.ClientMessage(zeros(), num_samples=5 + 3 * k, multiplicity=1),
        1,
        lambda server, total, m: {"params": server.params + total / m},
    ),
    Case(
        "scaffold",
        lambda: scaffold.build(sgd()),
        scaffold_server,
        lambda k: scaffold.ClientMessage(zeros(), zeros(), multiplicity=1),
        2,
        lambda server, total, m: {
            "params": server.params + total[:D] / m,  # mean part: / m
            "control": server.control + total[D:] / NUM_REGISTERED,  # sum part: / N, as ever
        },
    ),
    Case(
        "feddyn",
        lambda: feddyn.build(alpha=0.25),
        feddyn_server,
        lambda k: feddyn.ClientMessage(zeros(), multiplicity=1),
        1,
        lambda server, total, m: {
            "params": server.params + total / m + (server.dual_sum + total) / NUM_REGISTERED,
            "dual_sum": server.dual_sum + total,
        },
    ),
    Case(
        "adabest",
        lambda: adabest.build(mu=0.25, beta=BETA, aggregation="uniform"),
        adabest_server,
        lambda k: adabest.ClientMessage(zeros(), num_samples=5 + 3 * k, multiplicity=1),
        1,
        lambda server, total, m: {
            "client_average": server.params + total / m,
            "params": server.params + total / m - BETA * (server.client_average - (server.params + total / m)),
        },
    ),
    Case(
        "efl",
        lambda: efl.build(sgd(), elastic=0.5, incomplete="plain", aggregation="uniform"),
        efl_server,
        efl_template,
        3,
        lambda server, total, m: {
            "params": server.params + total[:D] / m,  # mean part
            "fisher_sum": server.fisher_sum + total[D : 2 * D],  # U, V are plain sums
            "weighted_model_sum": server.weighted_model_sum + total[2 * D :],
        },
    ),
    Case(
        "efl-no-fisher",
        lambda: efl.build(sgd(), elastic=0.0, incomplete="drop", aggregation="uniform"),
        plain_server,
        lambda k: efl.ClientMessage(zeros(), None, None, num_samples=5 + 3 * k, multiplicity=1, completed_fraction=1.0),
        1,
        lambda server, total, m: {"params": server.params + total / m},
    ),
    Case(  # releases cat(y_k − x, g_k): the model mean and the momentum's gradient mean share the denominator
        "mimelite",
        lambda: mime.build(sgd(), momentum=BETA, aggregation="uniform"),
        lambda algorithm, params: dataclasses.replace(algorithm.server_init(params), momentum=quarters(D, seed=17)),
        lambda k: mime.ClientMessage(zeros(), zeros(), num_samples=5 + 3 * k, multiplicity=1),
        2,
        lambda server, total, m: {
            "params": server.params + total[:D] / m,
            "momentum": BETA * server.momentum + total[D:] / m,
        },
    ),
    Case(  # Mime releases cat(y_k − x, g_k) too; ḡ is the momentum's input and the next round's control variate c
        "mime",
        lambda: mime.build(sgd(), momentum=BETA, aggregation="uniform", control_variate=True),
        lambda algorithm, params: dataclasses.replace(
            algorithm.server_init(params), momentum=quarters(D, seed=18), control_variate=quarters(D, seed=19)
        ),
        lambda k: mime.ClientMessage(zeros(), zeros(), num_samples=5 + 3 * k, multiplicity=1),
        2,
        lambda server, total, m: {
            "params": server.params + total[:D] / m,
            "momentum": BETA * server.momentum + total[D:] / m,
            "control_variate": total[D:] / m,
        },
    ),
    Case(  # a server whose D is not zero: D^t = −Σ/m, exactly in quarters
        "fedgate",
        lambda: fedgate.build(sgd()),
        lambda algorithm, params: dataclasses.replace(algorithm.server_init(params), mean_change=quarters(D, seed=16)),
        lambda k: fedgate.ClientMessage(zeros(), multiplicity=1),
        1,
        lambda server, total, m: {"params": server.params + total / m, "mean_change": -total / m},
    ),
    Case(  # FedAvg's message and form: the personal model v_k never leaves the client
        "ditto",
        lambda: ditto.build(sgd(), lam=0.5, aggregation="uniform"),
        plain_server,
        lambda k: ditto.ClientMessage(zeros(), num_samples=5 + 3 * k, multiplicity=1),
        1,
        lambda server, total, m: {"params": server.params + total / m},
    ),
    Case(  # FedAvg's message and form: v_k and α_k never leave the client
        "apfl",
        lambda: apfl.build(sgd(), aggregation="uniform"),
        plain_server,
        lambda k: fedavg.ClientMessage(zeros(), num_samples=5 + 3 * k, multiplicity=1),
        1,
        lambda server, total, m: {"params": server.params + total / m},
    ),
]


@dataclass(frozen=True)
class Round:
    algorithm: Algorithm
    server: Any
    view: Any
    releases: list[torch.Tensor]
    messages: list[Any]


def make_round(case: Case, num_messages: int = 3, seed: int = 0) -> Round:
    algorithm = case.algorithm()
    server = case.server(algorithm, quarters(D, seed=100 + seed))
    view = algorithm.broadcast(server)
    releases = [quarters(case.released_size * D, seed=200 + 10 * seed + k) for k in range(num_messages)]
    messages = [algorithm.release.restore(view, case.template(k), x) for k, x in enumerate(releases)]
    return Round(algorithm, server, view, releases, messages)


def assert_fields(state: Any, expected: dict[str, torch.Tensor]) -> None:
    for name, value in expected.items():
        assert torch.equal(getattr(state, name), value), (name, getattr(state, name), value)


ids = [case.name for case in CASES]


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_a_private_configuration_has_a_form_and_no_refusal(case):
    algorithm = case.algorithm()
    assert algorithm.release is not None and algorithm.release_refusal is None


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_restore_then_release_gives_the_released_vector(case):
    run = make_round(case)
    form = run.algorithm.release
    for x, message in zip(run.releases, run.messages, strict=True):
        assert torch.equal(form.release(run.view, message), x)
        again = form.restore(run.view, message, form.release(run.view, message))
        assert torch.equal(form.release(run.view, again), x)
        assert type(again) is type(message)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_restore_keeps_the_fields_it_does_not_release(case):
    run = make_round(case)
    form = run.algorithm.release
    template = case.template(1)
    restored = form.restore(run.view, template, quarters(case.released_size * D, seed=7))
    for field in ("num_samples", "multiplicity", "completed_fraction"):
        if hasattr(template, field):
            assert getattr(restored, field) == getattr(template, field)


@pytest.mark.parametrize("factor", [0.5, 0.0, 2.0])
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_scale_releases_the_scaled_vector(case, factor):
    run = make_round(case)
    form = run.algorithm.release
    for x, message in zip(run.releases, run.messages, strict=True):
        assert torch.equal(form.release(run.view, form.scale(run.view, message, factor)), factor * x)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_the_carrier_releases_its_vector_with_unit_weight(case):
    run = make_round(case)
    form = run.algorithm.release
    z = quarters(case.released_size * D, seed=9)
    carrier = form.restore(run.view, None, z)
    assert torch.equal(form.release(run.view, carrier), z)
    assert carrier.multiplicity == 1
    assert getattr(carrier, "completed_fraction", 1.0) == 1.0
    # Alone in a round whose mean divides by 1, the carrier moves the state by exactly z: one unit-weight message.
    new_server, _ = run.algorithm.server_update(run.server, [carrier], context(1.0))
    assert_fields(new_server, case.expected(run.server, z, 1.0))


@pytest.mark.parametrize("m", [2.0, 4.0, 8.0])
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_fold_of_carrier_and_messages_is_the_sum_over_the_public_denominator(case, m):
    run = make_round(case)
    z = quarters(case.released_size * D, seed=9)
    carrier = run.algorithm.release.restore(run.view, None, z)
    new_server, _ = run.algorithm.server_update(run.server, [carrier, *run.messages], context(m))
    total = z + sum(run.releases)
    assert_fields(new_server, case.expected(run.server, total, m))


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_private_fold_depends_on_the_sum_of_releases_only_not_on_how_many_reported(case):
    # |P| is private: three messages, their sum in one message, and the sum plus a zero message must agree.
    run = make_round(case)
    form = run.algorithm.release
    total = sum(run.releases)
    one = form.restore(run.view, case.template(0), total)
    nothing = form.restore(run.view, case.template(1), torch.zeros_like(total))
    results = [
        run.algorithm.server_update(run.server, messages, context(4.0))[0]
        for messages in (run.messages, [one], [one, nothing])
    ]
    expected = case.expected(run.server, total, 4.0)
    for result in results:
        assert_fields(result, expected)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_without_a_denominator_the_fold_is_the_mean_over_reporting_clients(case):
    # mean_denominator None: the fold as before (mean over |P| = 4), and a denominator equal to |P| agrees.
    run = make_round(case, num_messages=4, seed=1)
    total = sum(run.releases)
    plain, plain_metrics = run.algorithm.server_update(run.server, run.messages, context(None))
    assert_fields(plain, case.expected(run.server, total, 4.0))
    private, private_metrics = run.algorithm.server_update(run.server, run.messages, context(4.0))
    for field in dataclasses.fields(plain):
        value = getattr(plain, field.name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(getattr(private, field.name), value), field.name
    assert private_metrics == plain_metrics


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_release_is_flat_and_one_vector_per_message(case):
    run = make_round(case)
    x = run.algorithm.release.release(run.view, run.messages[0])
    assert x.shape == (case.released_size * D,) and x.dtype == torch.float64


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "algorithm, phrases",
    [
        (lambda: fedavg.build(sgd(), aggregation="weighted"), ['set algorithm.aggregation = "uniform"', "n_k"]),
        (lambda: fedavg.build(sgd()), ['set algorithm.aggregation = "uniform"']),  # weighted is FedAvg's default
        (lambda: fedprox.build(sgd(), mu=0.1), ['set algorithm.aggregation = "uniform"']),
        (lambda: adabest.build(aggregation="weighted"), ['set algorithm.aggregation = "uniform"']),
        (
            lambda: efl.build(sgd(), incomplete="plain", aggregation="weighted"),
            ['set algorithm.aggregation = "uniform"'],
        ),
        (
            lambda: efl.build(sgd(), incomplete="adaptive", aggregation="uniform"),
            ['set algorithm.incomplete = "drop" or "plain"', "E/s_k"],
        ),
        (
            lambda: efl.build(sgd()),  # EFL's defaults: both
            ['set algorithm.aggregation = "uniform"', 'set algorithm.incomplete = "drop" or "plain"'],
        ),
        (lambda: fedamp.build(num_clients=4), ["remove [privacy]", "w_k"]),  # one model per client, used on its own
    ],
    ids=[
        "fedavg-weighted",
        "fedavg-default",
        "fedprox-default",
        "adabest-weighted",
        "efl-weighted",
        "efl-adaptive",
        "efl-default",
        "fedamp",
    ],
)
def test_configurations_without_a_bounded_sensitivity_are_refused_naming_the_fix(algorithm, phrases):
    built = algorithm()
    assert built.release is None
    assert "\n" not in built.release_refusal
    for phrase in phrases:
        assert phrase in built.release_refusal


def test_adabest_default_aggregation_is_private():
    assert adabest.build().release is not None


# ---------------------------------------------------------------- a hand-computed round each (D = 2)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def private_round(
    algorithm: Algorithm,
    server: Any,
    messages: list[Any],
    z: torch.Tensor,
    m: float,
    num_registered: int = NUM_REGISTERED,
) -> Any:
    carrier = algorithm.release.restore(algorithm.broadcast(server), None, z)
    return algorithm.server_update(server, [carrier, *messages], context(m, num_registered))[0]


@pytest.mark.parametrize(
    "build",
    [lambda: fedavg.build(sgd(), aggregation="uniform"), lambda: fedprox.build(sgd(), mu=0.5, aggregation="uniform")],
    ids=["fedavg", "fedprox"],
)
def test_fedavg_and_fedprox_by_hand(build):
    algorithm = build()
    server = algorithm.server_init(t(1, 2))
    messages = [fedavg.ClientMessage(t(2, 2), 10, 1), fedavg.ClientMessage(t(1, 4), 30, 1)]  # x = (1, 0), (0, 2)
    # θ + (x1 + x2 + z)/m = (1, 2) + ((1, 0) + (0, 2) + (1, −2))/4 = (1.5, 2)
    assert torch.equal(private_round(algorithm, server, messages, t(1, -2), 4.0).params, t(1.5, 2))
    # Without a denominator: the plain mean over the two reporting clients, (1.5, 3).
    assert torch.equal(algorithm.server_update(server, messages, context(None))[0].params, t(1.5, 3))


def test_scaffold_by_hand():
    algorithm = scaffold.build(sgd())
    server = scaffold.ServerState(params=t(0, 1), control=t(1, 1), optimizer_state=sgd().init(t(0, 1)))
    messages = [scaffold.ClientMessage(t(2, 0), t(1, 0), 1), scaffold.ClientMessage(t(0, 2), t(0, -1), 1)]
    z = t(2, 2, 1, 1)
    new = private_round(algorithm, server, messages, z, 4.0, num_registered=8)
    # Δy: ((2, 0) + (0, 2) + (2, 2))/4 = (1, 1), θ = (1, 2); Δc: ((1, 0) + (0, −1) + (1, 1))/N=8 = (0.25, 0)
    assert torch.equal(new.params, t(1, 2))
    assert torch.equal(new.control, t(1.25, 1))
    plain = algorithm.server_update(server, messages, context(None, 8))[0]
    assert torch.equal(plain.params, t(1, 2))  # ((2, 0) + (0, 2))/2 = (1, 1)
    assert torch.equal(plain.control, t(1.125, 1 - 0.125))


def test_feddyn_by_hand():
    algorithm = feddyn.build(alpha=0.5)
    server = feddyn.ServerState(params=t(1, 1), dual_sum=t(2, 0))
    messages = [feddyn.ClientMessage(t(3, 1), 1), feddyn.ClientMessage(t(1, 3), 1)]  # x = (2, 0), (0, 2)
    new = private_round(algorithm, server, messages, t(0, 2), 2.0, num_registered=4)
    # S = (2, 4): mean = (1, 1) + S/2 = (2, 3); Σλ = (2, 0) + S = (4, 4); θ = (2, 3) + (4, 4)/4 = (3, 4)
    assert torch.equal(new.dual_sum, t(4, 4))
    assert torch.equal(new.params, t(3, 4))
    plain = algorithm.server_update(server, messages, context(None, 4))[0]
    # mean_P θ_k = (2, 2); Σλ = (4, 2); θ = (2, 2) + (1, 0.5)
    assert torch.equal(plain.dual_sum, t(4, 2))
    assert torch.equal(plain.params, t(3, 2.5))


def test_adabest_by_hand():
    algorithm = adabest.build(mu=0.5, beta=0.5)
    server = adabest.ServerState(params=t(1, 1), client_average=t(2, 0))
    messages = [adabest.ClientMessage(t(2, 1), 10, 1), adabest.ClientMessage(t(1, 2), 20, 1)]  # x = (1, 0), (0, 1)
    new = private_round(algorithm, server, messages, t(1, 1), 4.0)
    # θ̄ = (1, 1) + (2, 2)/4 = (1.5, 1.5); h = 0.5((2, 0) − θ̄) = (0.25, −0.75); θ = θ̄ − h = (1.25, 2.25)
    assert torch.equal(new.client_average, t(1.5, 1.5))
    assert torch.equal(new.params, t(1.25, 2.25))
    plain = algorithm.server_update(server, messages, context(None))[0]
    # θ̄ = (1.5, 1.5) too (the mean of (2, 1), (1, 2)), so the same θ
    assert torch.equal(plain.params, t(1.25, 2.25))


def test_efl_by_hand():
    algorithm = efl.build(sgd(), elastic=0.5, incomplete="plain", aggregation="uniform")
    state = algorithm.server_init(t(1, 1))
    server = dataclasses.replace(state, fisher_sum=t(1, 1), weighted_model_sum=t(1, 2))
    messages = [
        efl.ClientMessage(t(2, 1), t(1, 0), t(2, 0), num_samples=10, multiplicity=1, completed_fraction=1.0),
        efl.ClientMessage(t(1, 3), t(0, 1), t(0, 3), num_samples=30, multiplicity=1, completed_fraction=0.5),
    ]
    z = t(1, 0, 0, 1, 1, 1)
    new = private_round(algorithm, server, messages, z, 2.0)
    # θ: (1, 1) + ((1, 0) + (0, 2) + (1, 0))/2 = (2, 2); U = (1, 1) + (1, 1) + (0, 1); V = (1, 2) + (2, 3) + (1, 1)
    assert torch.equal(new.params, t(2, 2))
    assert torch.equal(new.fisher_sum, t(2, 3))
    assert torch.equal(new.weighted_model_sum, t(4, 6))
    plain = algorithm.server_update(server, messages, context(None))[0]
    assert torch.equal(plain.params, t(1.5, 2))  # the straggler kept with its plain weight 1/2
    assert torch.equal(plain.fisher_sum, t(2, 2))


def test_scaffold_restore_gives_back_the_very_same_values():
    # SCAFFOLD's message is its release, split: restoring it loses no bit, whatever the numbers.
    algorithm = scaffold.build(sgd())
    view = algorithm.broadcast(algorithm.server_init(torch.randn(5)))
    message = scaffold.ClientMessage(torch.randn(5), torch.randn(5), 2)
    restored = algorithm.release.restore(view, message, algorithm.release.release(view, message))
    assert torch.equal(restored.params_delta, message.params_delta)
    assert torch.equal(restored.control_delta, message.control_delta)
    assert restored.multiplicity == 2
