"""Which algorithms may run asynchronously (FedBuff), and what the others say instead.

Every built-in either declares FedBuff's rule (``Algorithm.asynchronous``: FedAvg and FedProx with uniform
aggregation) or refuses with its own reason and a fix; the compression and privacy wrappers refuse whatever they
wrap.  The declared rule is checked on a hand-computed buffer: FedAvg's fold fed staleness-weighted carriers with
``mean_denominator = B`` is FedBuff's server step (Nguyen et al. 2022, Algorithm 1, with a FedOpt server).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from driftlab.algorithms import adabest, efl, fedavg, feddyn, registry, scaffold
from driftlab.algorithms.plugin_guard import guarded
from driftlab.compress import error_feedback, with_compression
from driftlab.optim.server import make_server_optimizer
from driftlab.privacy import mechanism
from driftlab.privacy.settings import PrivacySettings
from driftlab.simulation.seam import ClientContext, ClientUpdate, RoundContext
from driftlab.simulation.time.plan import AsynchronousPlan

BUILT_INS = tuple(registry.BUILT_IN)  # every built-in declares an asynchronous rule or a refusal naming the fix
# A refusal ends by saying what to change: one of these.
FIXES = ('aggregation = "uniform"', "remove [asynchronous]", "compression.ratio = 1", "remove [privacy]")


def _default(name: str):
    entry = registry.ALGORITHMS[name]
    return entry.from_config(entry.config_type(), make_server_optimizer("sgd"))


def _uniform(name: str):
    entry = registry.ALGORITHMS[name]
    fields = entry.config_type.model_fields
    config = entry.config_type(aggregation="uniform") if "aggregation" in fields else entry.config_type()
    return entry.from_config(config, make_server_optimizer("sgd"))


def test_the_built_ins_are_the_ones_checked_here():
    assert tuple(registry.ALGORITHMS)[: len(BUILT_INS)] == BUILT_INS


@pytest.mark.parametrize("build", [_default, _uniform])
@pytest.mark.parametrize("name", BUILT_INS)
def test_every_built_in_may_run_asynchronously_or_names_the_fix(name, build):
    algorithm = build(name)
    problem = algorithm.asynchronous_problem()
    if problem is None:
        assert algorithm.asynchronous and algorithm.release is not None
    else:
        assert not algorithm.asynchronous
        assert any(fix in problem for fix in FIXES), problem


@pytest.mark.parametrize("name", ["fedavg", "fedprox"])
def test_uniform_fedavg_and_fedprox_declare_fedbuffs_rule(name):
    assert _uniform(name).asynchronous_problem() is None
    assert _default(name).asynchronous_problem() == _refused(
        name, fedavg.FEDBUFF_WEIGHTED_REASON.text
    )  # "weighted" is their default


@pytest.mark.parametrize(
    ("module", "build", "reason"),
    [
        (scaffold, lambda: scaffold.build(make_server_optimizer("sgd")), "Δc_k"),
        (feddyn, lambda: feddyn.build(alpha=0.1), "Σ_S λ_k"),
        (adabest, lambda: adabest.build(aggregation="uniform"), "t − t'_k"),
        (
            efl,
            lambda: efl.build(make_server_optimizer("sgd"), elastic=0.0, incomplete="plain", aggregation="uniform"),
            "U =",
        ),
    ],
)
def test_drift_correcting_algorithms_refuse_with_a_reason_from_their_own_rule(module, build, reason):
    # Even in the options under which each has a release form (the form FedBuff moves stale changes with).
    algorithm = build()
    assert algorithm.release is not None
    assert algorithm.asynchronous_problem() == _refused(algorithm.name, module.ASYNCHRONOUS_REASON.text)
    assert reason in module.ASYNCHRONOUS_REASON.text
    assert (
        "remove [asynchronous]" in module.ASYNCHRONOUS_REASON.text
        and 'aggregation = "uniform"' in module.ASYNCHRONOUS_REASON.text
    )


def _refused(name: str, text: str) -> str:
    """The one refusal template (driftlab.features.capabilities.refusal): both keys, then the reason and its fix."""
    return f'[asynchronous] with algorithm.name = "{name}": {text}'


def _settings() -> PrivacySettings:
    return PrivacySettings(clip=1.0, noise_multiplier=0.0, seed=4, sampling_rate=1.0, expected_cohort=2.0, population=4)


def test_compression_refuses_even_what_it_wraps_that_could_run():
    compressed = with_compression(fedavg.build(make_server_optimizer("sgd"), aggregation="uniform"), 0.5, (4,))
    assert compressed.asynchronous_problem() == _refused("fedavg", error_feedback.ASYNCHRONOUS_REASON.text)


def test_compression_adds_the_wrapped_algorithms_own_refusal():
    compressed = with_compression(scaffold.build(make_server_optimizer("sgd")), 0.5, (4,))
    assert compressed.asynchronous_problem() == _refused(
        "scaffold", f"{error_feedback.ASYNCHRONOUS_REASON.text}; and {scaffold.ASYNCHRONOUS_REASON.text}"
    )


def test_privacy_refuses_and_names_every_layer_below():
    inner = fedavg.build(make_server_optimizer("sgd"), aggregation="uniform")
    assert mechanism.with_privacy(inner, _settings()).asynchronous_problem() == _refused(
        "fedavg", mechanism.ASYNCHRONOUS_REASON.text
    )
    problem = mechanism.with_privacy(with_compression(inner, 0.5, (4,)), _settings()).asynchronous_problem()
    assert problem == _refused(
        "fedavg", f"{mechanism.ASYNCHRONOUS_REASON.text}; and {error_feedback.ASYNCHRONOUS_REASON.text}"
    )
    assert "remove [privacy]" in problem and "compression.ratio = 1" in problem


def test_a_guarded_plugin_keeps_its_declaration():
    declared = dataclasses.replace(fedavg.build(make_server_optimizer("sgd"), aggregation="uniform"), name="mine")
    assert guarded(declared, "algorithm plugin 'mine'").asynchronous_problem() is None
    undeclared = dataclasses.replace(declared, asynchronous=False, lacks=())
    assert "declares no asynchronous rule" in guarded(undeclared, "algorithm plugin 'mine'").asynchronous_problem()


def _context(client_id: int, version: int) -> ClientContext:
    return ClientContext(
        client_id=client_id,
        round=version + 1,
        num_samples=10,
        mean_num_samples=10.0,
        num_registered=4,
        planned_steps=3,
        client_lr=0.1,
    )


@pytest.mark.parametrize("name", ["fedavg", "fedprox"])
def test_the_declared_rule_is_fedbuffs_server_step_on_a_hand_computed_buffer(name):
    """θ^v = (1, 2); client 0 started from θ^v (τ = 0, Δ = (2, 0)), client 1 from θ^{v−3} = (0, 0) (τ = 3, s = 1/2,
    Δ = (0, 4)); B = 2, SGD at η_g = 0.5:  θ^{v+1} = θ^v + η_g (1/B)(Δ_0 + Δ_1/2) = (1, 2) + 0.5 (1, 1) = (1.5, 2.5)."""
    algorithm = _uniform(name)
    plan = AsynchronousPlan(concurrency=4, buffer=2)
    old, now = algorithm.server_init(torch.zeros(2)), algorithm.server_init(torch.tensor([1.0, 2.0]))
    form, fold = algorithm.release, algorithm.fold()
    context = RoundContext(round=6, num_registered=4, num_selected=2, server_learning_rate=0.5, mean_denominator=2)
    sums = fold.start(now, context)
    for client_id, (server, version, final) in enumerate([(now, 5, [3.0, 2.0]), (old, 2, [0.0, 4.0])]):
        view = algorithm.broadcast(server)
        update = ClientUpdate(start_params=view.params, final_params=torch.tensor(final), steps_done=3)
        _, message = algorithm.client_finish(view, None, _context(client_id, version), update)
        staleness = 5 - version
        change = form.release(view, message) * plan.staleness_weight(staleness)
        sums = fold.add(sums, form.restore(algorithm.broadcast(now), None, change))
    server, _ = fold.finish(now, sums, context)
    assert torch.equal(server.params, torch.tensor([1.5, 2.5]))
