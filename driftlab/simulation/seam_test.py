"""The seam's server fold: built-ins fold, their server_update is the same fold, and a mismatch is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from driftlab.algorithms import fedavg, scaffold
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.seam import RoundContext, ServerFold, collecting_fold

CONTEXT = RoundContext(round=1, num_registered=4, num_selected=2, server_learning_rate=1.0)


def test_a_built_in_server_update_is_its_fold_over_the_list():
    algorithm = fedavg.build(make_server_optimizer("sgd"))
    server = algorithm.server_init(torch.zeros(3))
    messages = [
        fedavg.ClientMessage(torch.tensor([1.0, 2.0, 3.0]), 30, 1),
        fedavg.ClientMessage(torch.tensor([4.0, 5.0, 6.0]), 10, 1),
    ]
    fold = algorithm.fold()
    accumulator = fold.start(server, CONTEXT)
    for message in messages:
        accumulator = fold.add(accumulator, message)
    folded, _ = fold.finish(server, accumulator, CONTEXT)
    listed, _ = algorithm.server_update(server, messages, CONTEXT)
    assert torch.equal(folded.params, listed.params)
    assert torch.equal(listed.params, torch.tensor([7.0, 11.0, 15.0]) / 4)  # (30·θ_1 + 10·θ_2) / 40


def test_an_algorithm_with_only_server_update_is_folded_by_collecting():
    seen = []

    def server_update(server, messages, context):
        seen.append(list(messages))
        return server + sum(messages), {"count": len(messages)}

    fold = collecting_fold(server_update)
    accumulator = fold.start(0, CONTEXT)
    for message in (1, 2, 3):
        accumulator = fold.add(accumulator, message)
    assert fold.finish(10, accumulator, CONTEXT) == (16, {"count": 3}) and seen == [[1, 2, 3]]
    assert fold.start(0, CONTEXT) == []  # every round starts a new list


def test_replacing_server_update_alone_is_refused_with_the_fix():
    algorithm = scaffold.build(make_server_optimizer("sgd"))
    with pytest.raises(ValueError, match="server_update is not server_fold.server_update.*server_fold=None"):
        dataclasses.replace(algorithm, server_update=lambda server, messages, context: (server, {}))
    replaced = dataclasses.replace(
        algorithm, server_update=lambda server, messages, context: (server, {}), server_fold=None
    )
    assert isinstance(replaced.fold(), ServerFold) and replaced.server_fold is None


def test_the_plugin_note_names_a_plugin_and_nothing_for_a_built_in():
    from driftlab.simulation.seam import plugin_note

    built_in = fedavg.build(make_server_optimizer("sgd"))
    assert plugin_note(built_in) == ""
    plugin = dataclasses.replace(built_in, plugin="algorithm plugin 'toy' (/x/toy.py)")
    assert plugin_note(plugin) == (
        "; the algorithm is algorithm plugin 'toy' (/x/toy.py), whose functions compute the server model and the messages, "
        "so the plugin could be at fault rather than the learning rate"
    )


def test_the_old_names_of_the_release_form_still_build_and_read_an_algorithm():
    from driftlab.privacy import PrivacyForm as PackageAlias
    from driftlab.simulation.seam import Algorithm, PrivacyForm, ReleaseForm

    assert PrivacyForm is ReleaseForm and PackageAlias is ReleaseForm
    built = fedavg.build(make_server_optimizer("sgd"), "uniform")
    form = built.release
    fields = {field.name: getattr(built, field.name) for field in dataclasses.fields(Algorithm) if field.init}
    fields.pop("release")
    old = Algorithm(**fields, privacy=form)  # a plugin written before the rename
    assert old == built and old.release is form and old.privacy is form
    # replace's privacy= wins over the release it passes on (dropping the form drops it)
    dropped = dataclasses.replace(built, privacy=None)
    assert dropped.release is None and dropped.privacy is None and "release form" not in dropped.capabilities
    weighted = fedavg.build(make_server_optimizer("sgd"), "weighted")
    assert weighted.privacy_refusal == weighted.release_refusal == fedavg.WEIGHTED_REFUSAL
    assert built.release_refusal is None and "release form" in built.capabilities
