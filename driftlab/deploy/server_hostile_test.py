"""Hostile nodes and a hostile server, in one process: every case ends with the honest run minus the hostile node's clients.

A reply that lies about what the server planned (sample counts, multiplicities,
steps), carries finite garbage, or a request asking a node for work its config
does not plan, makes the clients concerned inactive for the rounds concerned:
the run equals a deployment where that node simply did not answer in those
rounds (``_silent``), bit for bit, and the reason is logged.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from driftlab.deploy import wire
from driftlab.deploy.messages import (
    InProcessTransport,
    NoReply,
    RoundOutcome,
    TrainRequest,
)
from driftlab.deploy.server import DeploymentServer, Timeouts, out_of_bounds
from driftlab.deploy.server_test import (
    ALGORITHMS,
    _claiming_node,
    _config,
    _deploy,
    _is,
    _join,
    _metrics,
    _Nodes,
    _run_with_a_node_joining_in_round_2,
    _split,
)
from driftlab.experiments.config import ConfigError

NUM_NODES = 4  # clients 0 and 4 are node 0's: at most 2 of a round's 4 replies, so the round's median stays honest
HOSTILE = 0  # the hostile node's index
ROUNDS = (2, 3)  # the rounds it misbehaves in, of 4
FEDAVG = [*ALGORITHMS["fedavg"]]
COMPRESSED_FEDAVG = [*ALGORITHMS["fedavg"], "compression.ratio=0.1"]


def _hostile(make_bad):
    """An interceptor: node HOSTILE's train replies in ROUNDS go through ``make_bad(reply)``; the clients it spoiled."""
    spoiled: list[tuple[int, int]] = []

    def intercept(client, request):
        if client.client_ids[0] % NUM_NODES != HOSTILE or not any(_is(request, TrainRequest, t) for t in ROUNDS):
            return client.handle(request)
        envelope = wire.read_envelope(request, max_bytes=1 << 30)
        spoiled.append((envelope.round, envelope.client_id))
        return make_bad(client, request)

    return intercept, spoiled


def _silent(client, request):
    raise NoReply


def _reply_edit(edit):
    """``make_bad`` for _hostile: the honest reply with ``edit(tensors, header fields of the message)`` applied."""

    def make_bad(client, request):
        tensors, header = _split(client.handle(request))
        edit(tensors, header["tree"]["fields"]["message"]["fields"])
        return _join(tensors, header)

    return make_bad


def _request_edit(edit):
    """``make_bad`` for _hostile: what the node answers to the request with ``edit(header fields of the request)`` applied."""

    def make_bad(client, request):
        tensors, header = _split(request)
        edit(header["tree"]["fields"])
        return client.handle(_join(tensors, header))

    return make_bad


def _set(*path_and_value):
    *path, value = path_and_value

    def edit(fields):
        for key in path[:-1]:
            fields = fields[key]["fields"]
        fields[path[-1]]["value"] = value

    return edit


def _scaled(key, make):
    def edit(tensors, fields):
        tensors[key] = make(tensors[key])

    return edit


def _steps(value):
    def make_bad(client, request):
        tensors, header = _split(client.handle(request))
        header["tree"]["fields"]["steps_done"]["value"] = value
        return _join(tensors, header)

    return make_bad


def _planned(key, value):
    return _reply_edit(lambda tensors, fields: fields.__getitem__(key).__setitem__("value", value))


# name: (config overrides, make_bad, the reason every spoiled client is rejected with)
CASES = {
    "num_samples 10**12": (
        FEDAVG,
        _planned("num_samples", 10**12),
        "message/num_samples is 1000000000000, the server planned",
    ),
    "num_samples -1000": (FEDAVG, _planned("num_samples", -1000), "message/num_samples is -1000, the server planned"),
    "num_samples 10**400": (FEDAVG, _planned("num_samples", 10**400), "(401 characters), the server planned"),
    "multiplicity 0": (FEDAVG, _planned("multiplicity", 0), "message/multiplicity is 0, the server planned 1"),
    "multiplicity 1000": (FEDAVG, _planned("multiplicity", 1000), "message/multiplicity is 1000, the server planned 1"),
    "steps_done 0": (FEDAVG, _steps(0), "reports 0 local steps, the client was asked for exactly"),
    "parameters x1e6": (
        FEDAVG,
        _reply_edit(_scaled("payload/message/params", lambda t: t * 1e6)),
        "out of bounds: message/params is",
    ),
    "parameters 3e38": (
        FEDAVG,
        _reply_edit(_scaled("payload/message/params", lambda t: torch.full_like(t, 3e38))),
        "out of bounds: message/params is",
    ),
    "ternary scales 1e30": (
        COMPRESSED_FEDAVG,
        _reply_edit(_scaled("payload/message/model/scales", lambda t: torch.full_like(t, 1e30))),
        "out of bounds: message/payload/params is",
    ),
    "asks for 10**6 steps": (
        FEDAVG,
        _request_edit(_set("context", "available_steps", 10**6)),
        "the server makes 1000000 local steps available, the plan is 1..",
    ),
    "asks for 10**9 steps": (
        FEDAVG,
        _request_edit(_set("context", "available_steps", 10**9)),
        "the server makes 1000000000 local steps available",
    ),
    "asks for 10**6 planned steps": (
        FEDAVG,
        _request_edit(_set("context", "planned_steps", 10**6)),
        "the server plans 1000000 local steps for client",
    ),
    "asks for precision bogus": (FEDAVG, _request_edit(_set("settings", "precision", "bogus")), "precision='bogus'"),
    "asks for client_lr 1e300": (
        FEDAVG,
        _request_edit(_set("context", "client_lr", (1e300).hex())),
        "the server asks for client learning rate 1e+300 in round",
    ),
    "asks for a local client_lr 1e300": (
        FEDAVG,
        _request_edit(_set("settings", "local", "client_lr", (1e300).hex())),
        "client_lr=1e+300",
    ),
}


@pytest.fixture(scope="module")
def silent_reference(tmp_path_factory):
    """``reference(overrides)``: the run where node HOSTILE does not answer in ROUNDS, and the clients it was asked for."""
    references = {}

    def reference(overrides):
        key = tuple(overrides)
        if key not in references:
            tmp_path = tmp_path_factory.mktemp("silent")
            config = _config(*overrides, rounds=4)
            intercept, silenced = _hostile(_silent)
            result, _ = _deploy(
                config, tmp_path / "out", _Nodes(config, tmp_path / "state", intercept, num_nodes=NUM_NODES)
            )
            references[key] = result, silenced
        return references[key]

    return reference


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_node_loses_its_clients_for_the_rounds_it_misbehaves_and_nothing_else(
    tmp_path, case, silent_reference
):
    overrides, make_bad, reason = CASES[case]
    config = _config(*overrides, rounds=4)
    intercept, spoiled = _hostile(make_bad)
    result, server = _deploy(
        config, tmp_path / "out", _Nodes(config, tmp_path / "state", intercept, num_nodes=NUM_NODES)
    )
    reference, silenced = silent_reference(overrides)
    assert spoiled == silenced and spoiled, spoiled  # the same clients asked in the same rounds
    assert [(rejection.round, rejection.client_id) for rejection in server.rejections] == spoiled
    assert all(reason in rejection.reason for rejection in server.rejections), server.rejections[0].reason
    assert torch.equal(result.final_params, reference.final_params)
    assert _metrics(result.records) == _metrics(reference.records)


def test_num_samples_10_to_the_12_is_refused_and_the_run_equals_the_node_being_silent(tmp_path, silent_reference):
    """The quick tier's case of the slow table above: without the check, this node would dominate every round."""
    test_a_hostile_node_loses_its_clients_for_the_rounds_it_misbehaves_and_nothing_else(
        tmp_path, "num_samples 10**12", silent_reference
    )


def test_a_node_refusing_a_request_says_what_its_config_plans(tmp_path):
    """The refused request's reason names the value asked for and the node's own (steps; the settings as a whole)."""
    config = _config(*FEDAVG, rounds=4)
    intercept, _ = _hostile(_request_edit(_set("settings", "precision", "bogus")))
    _, server = _deploy(config, tmp_path / "out", _Nodes(config, tmp_path / "state", intercept, num_nodes=NUM_NODES))
    reason = server.rejections[0].reason
    assert reason.startswith("error reply: RequestRefused: the server asks for the round settings ClientSettings("), (
        reason
    )
    assert "precision='bogus'), this node's config gives ClientSettings(" in reason
    assert reason.endswith("precision='float64') (same config on server and node?)"), reason


# ---------------------------------------------------------------- registration: tokens pin clients to their nodes


def test_a_node_claiming_every_client_after_the_first_registration_gets_none(tmp_path):
    config = _config(*ALGORITHMS["scaffold"], rounds=3)
    honest, _ = _deploy(config, tmp_path / "honest", _Nodes(config, tmp_path / "honest_state"))
    nodes = _Nodes(config, tmp_path / "state")
    hostile, asked = _claiming_node(torch.tensor([len(indices) for indices in nodes.data.client_indices]))
    server, result, lines = _run_with_a_node_joining_in_round_2(config, tmp_path / "out", nodes, hostile)
    assert not asked and not server.rejections
    assert torch.equal(result.final_params, honest.final_params)
    assert (
        "round 2: node 5 claims clients 0, 1, 2, 3, 4, 5, 6, 7 without their registration tokens; refused" in lines[0]
    )


def test_a_node_claiming_every_client_at_the_first_registration_takes_none_and_the_start_names_the_contest(tmp_path):
    """On a fresh start nothing proves who holds a client: clients claimed twice go to neither node, and the start fails
    naming them (a node registering alone before the real hosts would get them: the documented limit of the tokens)."""
    config = _config(*ALGORITHMS["fedavg"], rounds=2)
    nodes = _Nodes(config, tmp_path / "state")
    hostile, asked = _claiming_node(torch.tensor([len(indices) for indices in nodes.data.client_indices]))
    transport = InProcessTransport({**{10 + index: nodes.handler(index) for index in range(3)}, 5: hostile})
    lines: list[str] = []
    server = DeploymentServer(
        config, tmp_path / "out", transport, log=lines.append, timeouts=Timeouts(first_registration=0.2)
    )
    with pytest.raises(ConfigError) as error:
        server.run()
    assert "8 of the run's 8 clients did not register" in str(error.value)
    assert (
        "client 0 is claimed by nodes 5, 10 (one of them does not hold it: stop the node whose client ids are wrong)"
        in str(error.value)
    )
    assert (
        "round 1: error: client 7 is claimed by nodes 5, 11 at its first registration; it is registered to none of them until only one claims it"
        in lines
    )
    assert not asked
    info = json.loads((tmp_path / "out" / "run.json").read_text())
    assert info["status"] == "failed" and "client 0 is claimed by nodes 5, 10" in info["message"]


def test_a_restarted_node_with_its_state_directory_keeps_its_clients(tmp_path):
    """The token lives in the node's state directory: a restarted node (a new node id, same directory) proves its clients again."""
    config = _config(*ALGORITHMS["scaffold"], rounds=3)
    honest, _ = _deploy(config, tmp_path / "honest", _Nodes(config, tmp_path / "honest_state"))
    nodes = _Nodes(config, tmp_path / "state")
    transport = InProcessTransport({10 + index: nodes.handler(index) for index in range(3)})

    def restarts_after_round_1(client, request):
        if _is(request, RoundOutcome, 1) and 10 in transport.nodes:
            reply = client.handle(request)
            if client is nodes.clients[0] and not any(node == 20 for node in transport.nodes):
                nodes.restart()
                transport.nodes[20] = transport.nodes.pop(10)
            return reply
        return client.handle(request)

    nodes.intercept = restarts_after_round_1
    lines: list[str] = []
    server = DeploymentServer(config, tmp_path / "out", transport, log=lines.append)
    result = server.run()
    assert sorted(transport.nodes) == [11, 12, 20]
    assert not server.rejections and not [line for line in lines if "token" in line], lines
    assert torch.equal(result.final_params, honest.final_params)


# ---------------------------------------------------------------- the round's bound, by hand


def test_the_bound_is_a_multiple_of_the_largest_lower_median_of_the_run():
    replies = {1: {"m": 1.0, "c": 5.0}, 2: {"m": 2.0, "c": 5.0}, 3: {"m": 300.0, "c": 5.0}}
    rejected, scales = out_of_bounds(replies, 100.0)
    assert list(rejected) == [3] and scales == {"c": 5.0, "m": 2.0}  # lower median 2.0: 300 > 200
    assert rejected[3].startswith(
        "out of bounds: m is 300 from where a client that did not move sends it, more than 100 x its scale 2 "
    )
    assert out_of_bounds(replies, 200.0)[0] == {}  # 300 <= 400
    assert list(out_of_bounds({1: {"m": 1.0}, 2: {"m": 150.0}}, 100.0)[0]) == [
        2
    ]  # of two, the larger cannot set its own bound
    assert out_of_bounds({1: {"m": 0.0}, 2: {"m": 0.0}, 3: {"m": 7.0}}, 100.0)[0] == {}  # a scale of 0 bounds nothing
    assert list(out_of_bounds({1: {"m": 1.0}, 2: {"m": 1.0}, 3: {"m": math.inf}}, 100.0)[0]) == [3]
    # An earlier round's larger median stays the scale: 150 is within 100 x 2, though 150 x this round's median 1.
    rejected, scales = out_of_bounds({1: {"m": 1.0}, 2: {"m": 1.0}, 3: {"m": 150.0}}, 100.0, {"m": 2.0})
    assert rejected == {} and scales == {"m": 2.0}
    assert out_of_bounds(replies, None) == ({}, {"c": 5.0, "m": 2.0})  # no bound, but the scales are still kept


def test_the_scale_is_a_median_over_nodes_and_needs_two_of_them():
    # Node 7 hosts three of the round's four clients: counted once, at 90; the lower median of nodes 7 and 8 is 1.
    nodes = {1: 7, 2: 7, 3: 7, 4: 8}
    rejected, scales = out_of_bounds(
        {1: {"m": 90.0}, 2: {"m": 90.0}, 3: {"m": 200.0}, 4: {"m": 1.0}}, 100.0, None, nodes
    )
    assert scales == {"m": 1.0} and list(rejected) == [3]  # 200 > 100 x 1; 90 is within it
    # One node alone teaches nothing: the earlier scale bounds it (50 and 99 within 100 x 1, 150 not) and stays.
    alone = {1: 7, 2: 7, 3: 7}
    rejected, scales = out_of_bounds({1: {"m": 50.0}, 2: {"m": 99.0}, 3: {"m": 150.0}}, 100.0, {"m": 1.0}, alone)
    assert scales == {"m": 1.0} and list(rejected) == [3]
    assert out_of_bounds({1: {"m": 5.0}}, 100.0) == ({}, {})  # one reply: no scale yet, so nothing bounded


def test_an_algorithm_that_cannot_finish_a_client_that_did_not_move_still_has_its_scalars_checked(
    tmp_path, monkeypatch
):
    """A plugin may divide by its update's norm: the server then checks the planned scalars on a made-up move and
    bounds nothing (no reference to measure from); an honest run still equals the simulator."""
    import driftlab
    from driftlab.deploy import server as deployment

    real = deployment.planned_message

    def fails_unmoved(algorithm, view, context, steps_done, moved=False):
        if not moved:
            raise ZeroDivisionError("update norm 0")
        return real(algorithm, view, context, steps_done, moved=True)

    monkeypatch.setattr(deployment, "planned_message", fails_unmoved)
    config = _config(*FEDAVG, rounds=2)
    result, server = _deploy(config, tmp_path / "out", _Nodes(config, tmp_path / "state", num_nodes=NUM_NODES))
    assert not server.rejections
    assert torch.equal(result.final_params, driftlab.run(config).final_params)
    intercept, spoiled = _hostile(_planned("num_samples", 10**12))
    _, server = _deploy(
        _config(*FEDAVG, rounds=3),
        tmp_path / "hostile",
        _Nodes(_config(*FEDAVG, rounds=3), tmp_path / "s2", intercept, num_nodes=NUM_NODES),
    )
    assert [(rejection.round, rejection.client_id) for rejection in server.rejections] == spoiled and spoiled


def test_a_tensor_without_a_finite_reference_is_not_measured():
    from driftlab.deploy.server import _check_planned

    distances = {}
    _check_planned(
        (torch.ones(3), torch.ones(2)), (torch.full((3,), float("nan")), torch.zeros(2)), "message", distances
    )
    assert distances == {"message/1": pytest.approx(2**0.5)}
    with pytest.raises(wire.MessageRejected, match="message/0 is 7, the server planned 3 "):
        _check_planned((7, torch.ones(2)), (3, torch.zeros(2)), "message", {})
    with pytest.raises(wire.MessageRejected, match="message/0 is True, the server planned 1 "):
        _check_planned((True, None), (1, None), "message", {})  # a bool is not the int planned


def test_a_resumed_server_keeps_the_pinned_tokens(tmp_path):
    """After a server restart the pins come from deployment_rounds.json: a node claiming every client at the resume,
    before the real hosts are back, gets none of them (a fresh start would have contested them)."""
    config = _config(*ALGORITHMS["scaffold"], rounds=4)
    honest, _ = _deploy(config, tmp_path / "honest", _Nodes(config, tmp_path / "honest_state"))
    nodes = _Nodes(config, tmp_path / "state")
    _deploy(config.model_copy(update={"rounds": 2}), tmp_path / "out", nodes)
    nodes.restart()
    hostile, asked = _claiming_node(torch.tensor([len(indices) for indices in nodes.data.client_indices]))
    transport = InProcessTransport({5: hostile})
    calls = []

    def hosts_return_after_the_first_query(request):
        calls.append(request)
        if len(calls) == 2:  # the real hosts connect while the server waits for its clients
            transport.nodes.update({20 + index: nodes.handler(index) for index in range(3)})
        return hostile(request)

    transport.nodes[5] = hosts_return_after_the_first_query
    lines: list[str] = []
    server = DeploymentServer(config, tmp_path / "out", transport, resume=True, log=lines.append)
    resumed = server.run()
    assert not asked and not server.rejections
    assert (
        "round 3: node 5 claims clients 0, 1, 2, 3, 4, 5, 6, 7 without their registration tokens; refused" in lines[0]
    )
    assert torch.equal(resumed.final_params, honest.final_params)


# ---------------------------------------------------------------- one node alone cannot raise the bound


def _alone_in_round_2_then_far_in_round_3(make_round_3):
    """An interceptor: in round 2 only node HOSTILE answers (the others are late), its clients' models moved 50 times as
    far as they moved; in round 3 its replies go through ``make_round_3(client, request, round 2's smallest distance)``.
    The clients it answered for in round 3."""
    spoiled: list[int] = []
    moved: list[float] = []  # its round 2 distances: the most the old rule would take as the scale

    def intercept(client, request):
        hostile = client.client_ids[0] % NUM_NODES == HOSTILE
        if _is(request, TrainRequest, 2):
            if not hostile:
                raise NoReply  # late
            reply, distance = _moved(client, request, times=50.0)
            moved.append(distance)
            return reply
        if hostile and _is(request, TrainRequest, 3):
            spoiled.append(wire.read_envelope(request, max_bytes=1 << 30).client_id)
            return make_round_3(client, request, min(moved))
        return client.handle(request)

    return intercept, spoiled


def _moved(client, request, times=None, distance=None):
    """The honest reply with the model moved along its update from the round's global model θ: ``times`` as far, or
    to ``distance`` from θ; and how far from θ it is."""
    start = _split(request)[0]["payload/view/params"]
    tensors, header = _split(client.handle(request))
    update = tensors["payload/message/params"] - start
    update = update * (times if times is not None else distance / float(torch.linalg.vector_norm(update)))
    tensors["payload/message/params"] = start + update
    return _join(tensors, header), float(torch.linalg.vector_norm(update))


def test_a_node_alone_in_a_round_cannot_raise_the_bound_for_a_later_round(tmp_path):
    # The scale was learnt from any round's median: node 0, alone in round 2, made its own 50x move the scale, and in
    # round 3 a move 900 times that (about 10,000 times the others') was within 1000 x the scale: aggregated, and the
    # run diverged, blaming the learning rate. Now only a round two nodes or more answer teaches the scale, each node
    # counted once: round 3's bound is 1000 x the honest nodes' scale, and node 0's round 3 replies are refused.
    config = _config(*FEDAVG, "sampling.participation=1", rounds=4)

    def far(client, request, round_2_distance):
        return _moved(client, request, distance=900 * round_2_distance)[0]

    intercept, spoiled = _alone_in_round_2_then_far_in_round_3(far)
    result, server = _deploy(
        config, tmp_path / "out", _Nodes(config, tmp_path / "state", intercept, num_nodes=NUM_NODES)
    )
    assert spoiled == [0, 4]  # node 0's clients, asked in round 3
    round_3 = [(rejection.client_id, rejection.reason) for rejection in server.rejections if rejection.round == 3]
    assert [client for client, _ in round_3] == spoiled, server.rejections
    assert all(reason.startswith("out of bounds: message/params is ") for _, reason in round_3), round_3
    # the run is the one where node 0 did not answer in round 3, bit for bit
    silent, silenced = _alone_in_round_2_then_far_in_round_3(lambda client, request, _: _silent(client, request))
    reference, _ = _deploy(
        config, tmp_path / "silent", _Nodes(config, tmp_path / "silent_state", silent, num_nodes=NUM_NODES)
    )
    assert silenced == spoiled
    assert torch.equal(result.final_params, reference.final_params)
    assert _metrics(result.records) == _metrics(reference.records)
