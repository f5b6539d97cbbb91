"""The deployment's server and nodes, in one process (InProcessTransport): parity with the simulator and every failure path."""

from __future__ import annotations

import hashlib
import json
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

import driftlab
from driftlab.deploy import wire
from driftlab.deploy.messages import (
    InProcessTransport,
    NoReply,
    Registration,
    RegistrationQuery,
    RoundOutcome,
    TrainRequest,
    check_config_deployable,
    dataset_loader,
    deployment_model,
    node_clients,
)
from driftlab.deploy.node import DeploymentClient
from driftlab.deploy.server import DeploymentServer, _check_planned, run_in_process
from driftlab.experiments.config import AsynchronousConfig, ConfigError, load_config
from driftlab.experiments.pinned_runs_test import TINY_RUN
from driftlab.experiments.report import make_report
from driftlab.experiments.run.assembly import load_data

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BASE = [
    *TINY_RUN,
    "backend=sequential",
    "keep_checkpoint=true",  # several tests extend a completed run, which continues from its checkpoint only when it keeps it
]
ALGORITHMS: dict[str, list[str]] = {
    "fedavg": ["algorithm.name=fedavg"],
    "fedadam": ["algorithm.name=fedavg", "server.optimizer=adam", "server.lr=0.03"],
    "fedavgm": ["algorithm.name=fedavg", "server.optimizer=momentum", "server.lr=0.5"],
    "fedadagrad": ["algorithm.name=fedavg", "server.optimizer=adagrad", "server.lr=0.03"],
    "fedyogi": ["algorithm.name=fedavg", "server.optimizer=yogi", "server.lr=0.03"],
    "fedprox": ["algorithm.name=fedprox", "algorithm.mu=0.1"],
    "scaffold": ["algorithm.name=scaffold"],
    "feddyn": ["algorithm.name=feddyn", "algorithm.alpha=0.01"],
    "adabest": ["algorithm.name=adabest", "algorithm.mu=0.02", "algorithm.beta=0.9"],
    "efl": ["algorithm.name=efl"],
    "fednova": ["algorithm.name=fednova", "algorithm.momentum=0.5"],
    "fedgate": ["algorithm.name=fedgate"],
    "vrlsgd": ["algorithm.name=vrlsgd"],
    "mimelite": ["algorithm.name=mimelite"],
    "mime": ["algorithm.name=mime", "algorithm.control_variate=previous"],  # the paper's in-round c cannot deploy
    "ditto": ["algorithm.name=ditto", "algorithm.lam=0.5", "evaluation.personal=false"],
    "apfl": ["algorithm.name=apfl", "evaluation.personal=false"],  # a deployment records no personal columns
    "nesterov-plugin": [
        "algorithm.name=nesterov_avg",
        f'plugins=["{EXAMPLES / "nesterov_plugin" / "nesterov_avg.py"}"]',
    ],
}
INCOMPLETE = "availability.incomplete_probability=0.5"
# each deployment again, compressed (ratio 0.2 but where named), and with incomplete clients where the algorithm has a
# rule for them
COMPRESSED = {
    "fedavg": ["compression.ratio=0.1"],
    "efl": ["compression.ratio=0.3", INCOMPLETE, "algorithm.incomplete=drop"],
    **{
        name: ["compression.ratio=0.2"]
        for name in ("feddyn", "adabest", "fedprox", "fedadam", "fedavgm", "nesterov-plugin")
    },
    **{
        name: ["compression.ratio=0.2", INCOMPLETE]
        for name in ("scaffold", "fednova", "fedgate", "vrlsgd", "mimelite", "mime", "ditto", "apfl")
    },
}
CASES = {name: overrides for name, overrides in ALGORITHMS.items()} | {
    f"{name}-compressed": [*ALGORITHMS[name], *extra] for name, extra in COMPRESSED.items()
}
STATEFUL = ("scaffold", "feddyn", "adabest", "efl", "fedgate", "vrlsgd")


def _config(*overrides: str, rounds: int = 5):
    return load_config(None, [*BASE, f"rounds={rounds}", *overrides])


def _metrics(records):
    return [{key: value for key, value in record.items() if key != "round_seconds"} for record in records]


class _Nodes:
    """Three nodes of DeploymentClients (clients dealt round-robin) on ``state_dir``; ``intercept`` wraps their handlers."""

    def __init__(self, config, state_dir, intercept=None, num_nodes=3):
        self.data = load_data(config)
        self.model = deployment_model(config, self.data)
        self.config, self.state_dir, self.num_nodes = config, state_dir, num_nodes
        self.intercept = intercept
        self.restart()

    def restart(self):
        """New DeploymentClient objects on the same state directory: restarted nodes."""
        load = dataset_loader(self.data)
        self.clients = {
            index: DeploymentClient(
                self.config,
                node_clients(self.data.num_clients, self.num_nodes, index),
                load,
                self.state_dir,
                self.model,
            )
            for index in range(self.num_nodes)
        }

    def handler(self, index):
        def handle(request):
            client = self.clients[index]
            return self.intercept(client, request) if self.intercept is not None else client.handle(request)

        return handle

    def transport(self):
        return InProcessTransport({index: self.handler(index) for index in range(self.num_nodes)})

    def node_of(self, client_id):
        return self.clients[client_id % self.num_nodes]


def _deploy(config, out, nodes, **server_options):
    server = DeploymentServer(config, out, nodes.transport(), log=lambda text: None, **server_options)
    return server.run(), server


def _is(request, kind, round_index=None):
    envelope = wire.read_envelope(request, max_bytes=1 << 30)
    return envelope.payload_type == wire.type_name(kind) and (round_index is None or envelope.round == round_index)


# ---------------------------------------------------------------- parity (issue test 1)


def _check_parity(tmp_path, name):
    config = _config(*CASES[name])
    simulated = driftlab.run(config, tmp_path / "simulated")
    deployed = run_in_process(config, tmp_path / "deployed", tmp_path / "node_state", num_nodes=3)
    assert torch.equal(deployed.final_params, simulated.final_params)
    assert _metrics(deployed.records) == _metrics(simulated.records)
    assert _metrics(run_directory_records(tmp_path / "deployed")) == _metrics(simulated.records)
    if name.split("-")[0] in STATEFUL:
        taken_part = Counter(client for record in deployed.records for client in record["reporting_clients"])
        assert max(taken_part.values()) >= 2, taken_part  # a stateful client continued from its state on the node


def run_directory_records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_scaffold_compressed_deployment_equals_the_sequential_simulator(tmp_path):
    _check_parity(tmp_path, "scaffold-compressed")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(CASES) - {"scaffold-compressed"}))
def test_every_algorithm_deployed_equals_the_sequential_simulator(tmp_path, name):
    _check_parity(tmp_path, name)


def _committed_and_checkpointed(tmp_path, case: str, suffix: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Deploy ``case`` and simulate it; once the two final server models are found equal, the nodes' committed state
    of every client whose simulator checkpoint has a key ending in ``suffix`` (at least 4 of them), keyed by that
    key, and the simulator's checkpoint."""
    config = _config(*CASES[case])
    simulated = driftlab.run(config, tmp_path / "simulated")
    nodes = _Nodes(config, tmp_path / "node_state")
    deployed, _ = _deploy(config, tmp_path / "deployed", nodes)
    assert torch.equal(deployed.final_params, simulated.final_params)
    checkpoint = load_safetensors((tmp_path / "simulated" / "checkpoint.safetensors").read_bytes())
    trained = [key for key in checkpoint if key.endswith(suffix)]
    assert len(trained) >= 4
    client_ids = {key: int(key.split("/")[1]) for key in trained}
    return {key: nodes.node_of(k).committed_state(k) for key, k in client_ids.items()}, checkpoint


@pytest.mark.slow
def test_ditto_personal_models_on_the_nodes_equal_the_simulators_bit_for_bit(tmp_path):
    # The personal pass runs in client_finish on the node; v_k never travels, so parity of the server model says nothing
    # about it: each node's committed v_k is compared with the simulator's checkpoint.
    committed, checkpoint = _committed_and_checkpointed(tmp_path, "ditto-compressed", "/inner/personal")
    for key, state in committed.items():
        assert torch.equal(state.inner.personal, checkpoint[key]), key


@pytest.mark.slow
def test_apfl_personal_models_and_alphas_on_the_nodes_equal_the_simulators_bit_for_bit(tmp_path):
    # APFL steps v_k and α_k in client_finish on the node, beside a replica of w; neither travels, so each node's
    # committed state is compared with the simulator's checkpoint.
    committed, checkpoint = _committed_and_checkpointed(tmp_path, "apfl", "/personal")
    for key, state in committed.items():
        alpha = checkpoint[key[: -len("personal")] + "alpha"]
        assert torch.equal(state.personal, checkpoint[key]) and state.alpha == float(alpha), key


def test_driftlab_report_reads_a_deployment_run_directory(tmp_path):
    config = _config(*ALGORITHMS["scaffold"], rounds=2)
    run_in_process(config, tmp_path / "runs" / "scaffold", tmp_path / "node_state")
    report = make_report([tmp_path / "runs"], tmp_path / "report", targets=[0.5], plots=False)
    assert [s.label for s in report.settings] == ["synthetic"]
    assert list(report.settings[0].methods) == ["SCAFFOLD"]


def test_the_same_config_run_twice_on_one_state_directory_equals_the_simulator_both_times(tmp_path):
    config = _config(*ALGORITHMS["scaffold"], rounds=3)
    simulated = driftlab.run(config)
    first = run_in_process(config, tmp_path / "first", tmp_path / "node_state")
    second = run_in_process(config, tmp_path / "second", tmp_path / "node_state")
    for deployed in (first, second):
        assert torch.equal(deployed.final_params, simulated.final_params)
        assert _metrics(deployed.records) == _metrics(simulated.records)
    run_ids = {
        json.loads((tmp_path / out / "deployment_rounds.json").read_text())["run_id"] for out in ("first", "second")
    }
    assert len(run_ids) == 2
    assert {path.name for path in (tmp_path / "node_state" / config.fingerprint()).iterdir()} == run_ids


def test_nodes_are_asked_to_register_again_only_when_the_connected_nodes_change(tmp_path):
    from driftlab.deploy.messages import RegistrationQuery

    config = _config(*ALGORITHMS["fedavg"], rounds=4)
    queries: list[int] = []
    nodes = _Nodes(config, tmp_path / "state")
    transport = nodes.transport()
    gone = {}

    def intercept(client, request):
        envelope = wire.read_envelope(request, max_bytes=1 << 30)
        if envelope.payload_type == wire.type_name(RegistrationQuery):
            queries.append(envelope.round)
        if _is(request, RoundOutcome, 2) and not gone:
            gone[2] = transport.nodes.pop(2)  # node 2 leaves after round 2
        return client.handle(request)

    nodes.intercept = intercept
    result = DeploymentServer(config, tmp_path / "out", transport, log=lambda text: None).run()
    assert len(result.records) == 4
    assert queries == [1, 1, 1, 3, 3]  # everyone before round 1; the two nodes left before round 3


def test_a_round_that_accepts_no_reply_logs_an_error(tmp_path):
    config = _config(*ALGORITHMS["fedavg"], rounds=2)

    def intercept(client, request):
        if _is(request, TrainRequest, 2):
            raise NoReply
        return client.handle(request)

    lines: list[str] = []
    server = DeploymentServer(
        config, tmp_path / "out", _Nodes(config, tmp_path / "state", intercept).transport(), log=lines.append
    )
    result = server.run()
    assert len(result.records) == 2
    assert [line for line in lines if "error: no reply of the" in line and line.startswith("round 2:")], lines


# ---------------------------------------------------------------- refusals


def test_feddyn_with_membership_events_is_refused_before_the_run_directory_is_touched(tmp_path):
    config = _config("algorithm.name=feddyn", "availability.initially_registered=4")
    with pytest.raises(ConfigError, match="client_joined/client_left") as caught:
        DeploymentServer(config, tmp_path / "out", InProcessTransport({})).run()
    assert "availability.initially_registered" in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_the_mean_of_every_clients_model_is_refused(tmp_path):
    config = _config("algorithm.name=feddyn", "evaluation.model=all_clients_mean")
    with pytest.raises(ConfigError, match='set evaluation.model = "server"'):
        DeploymentServer(config, tmp_path / "out", InProcessTransport({})).run()


def test_an_algorithm_with_a_view_per_client_is_refused_before_the_run_directory_is_touched(tmp_path):
    config = _config("algorithm.name=fedamp")  # FedAMP sends each client its own cloud model u_k
    with pytest.raises(ConfigError, match=r"Algorithm.client_view.*run it with driftlab run"):
        DeploymentServer(config, tmp_path / "out", InProcessTransport({})).run()
    assert not (tmp_path / "out").exists()


def test_a_model_with_running_statistics_is_refused_before_any_round(tmp_path, monkeypatch):
    """A node's reply carries the algorithm's message only: BatchNorm statistics its training moved would be lost."""
    from driftlab.deploy import server as deploy_server
    from driftlab.experiments.run import assembly

    def normed(input_shape, num_classes):
        return torch.nn.Sequential(
            torch.nn.Linear(input_shape[0], 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, num_classes)
        )

    monkeypatch.setattr(
        deploy_server,
        "build_simulation",
        lambda config, data=None: assembly.build_simulation(config, normed, data=data),
    )
    with pytest.raises(ConfigError, match=r"^a deployment with a model whose normalisation layers keep running stat"):
        DeploymentServer(_config(), tmp_path / "out", InProcessTransport({})).run()
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_simulated_time_is_refused_before_the_run_directory_is_touched(tmp_path):
    timed = _config("system.speed_median=50")
    with pytest.raises(ConfigError, match=r"a deployment runs in real time, and \[system\] simulates time") as caught:
        DeploymentServer(timed, tmp_path / "out", InProcessTransport({})).run()
    assert "remove [system], or run the config with driftlab run" in str(caught.value)
    assert not (tmp_path / "out").exists()
    # (built past the config's own checks, which ask [asynchronous] for a default sampling)
    asynchronous = timed.model_copy(update={"asynchronous": AsynchronousConfig(concurrency=4, buffer=2)})
    with pytest.raises(ConfigError, match=r"\[system\] and \[asynchronous\] simulate time"):
        check_config_deployable(asynchronous)


def test_membership_events_are_fine_for_an_algorithm_without_membership_hooks(tmp_path):
    config = _config("algorithm.name=scaffold", "availability.initially_registered=6", rounds=2)
    simulated = driftlab.run(config)
    deployed, _ = _deploy(config, tmp_path / "out", _Nodes(config, tmp_path / "state"))
    assert torch.equal(deployed.final_params, simulated.final_params)


def test_clients_that_never_register_stop_the_run_with_their_ids(tmp_path):
    config = _config("algorithm.name=fedavg", rounds=1)
    nodes = _Nodes(config, tmp_path / "state")
    transport = InProcessTransport({0: nodes.handler(0), 1: nodes.handler(1)})  # node 2 (clients 2, 5) never starts
    from driftlab.deploy.server import Timeouts

    server = DeploymentServer(
        config, tmp_path / "out", transport, timeouts=Timeouts(first_registration=0.0), log=lambda text: None
    )
    with pytest.raises(ConfigError, match=r"2 of the run's 8 clients did not register .*clients 2, 5"):
        server.run()


def test_a_node_with_another_config_is_named_with_its_reason_when_its_clients_never_register(tmp_path):
    config = _config("algorithm.name=fedavg", rounds=1)
    nodes = _Nodes(config, tmp_path / "state")
    other = _Nodes(
        config.model_copy(update={"client": config.client.model_copy(update={"lr": 0.07})}), tmp_path / "other_state"
    )
    transport = InProcessTransport({0: nodes.handler(0), 1: nodes.handler(1), 2: other.handler(2)})
    from driftlab.deploy.server import Timeouts

    lines: list[str] = []
    server = DeploymentServer(
        config, tmp_path / "out", transport, timeouts=Timeouts(first_registration=0.0), log=lines.append
    )
    with pytest.raises(
        ConfigError, match=r"clients 2, 5\).*node 2 did not register: RequestRefused: request of run"
    ) as caught:
        server.run()
    assert "this node serves run" in str(caught.value)
    assert any(line.startswith("round 1: node 2 did not register: RequestRefused") for line in lines), lines


def _claiming_node(counts: torch.Tensor):
    """A hostile node's handler: it registers the clients of ``counts`` (client id -> example count, -1: not claimed)
    with a made-up token and answers nothing else.  Returns it and the list of the other requests it was sent."""
    asked: list[bytes] = []

    def handler(request):
        envelope = wire.read_envelope(request, max_bytes=1 << 30)
        if envelope.payload_type != wire.type_name(RegistrationQuery):
            asked.append(request)
            raise RuntimeError("not my client")
        tokens = torch.full((len(counts), 16), 7, dtype=torch.uint8)
        return wire.encode(
            Registration(counts, tokens), run_fingerprint=envelope.run_fingerprint, round=envelope.round, client_id=-1
        )

    return handler, asked


def _run_with_a_node_joining_in_round_2(config, out, nodes, joining):
    """A deployment on ``nodes`` (3 of them) that node 5, answering with ``joining``, joins after round 1: its server,
    result and log lines."""
    transport = InProcessTransport({10 + index: nodes.handler(index) for index in range(3)})

    def joins_in_round_2(client, request):
        if _is(request, RoundOutcome, 1):
            transport.nodes[5] = joining
        return client.handle(request)

    nodes.intercept = joins_in_round_2
    lines: list[str] = []
    server = DeploymentServer(config, out, transport, log=lines.append)
    return server, server.run(), lines


def test_a_client_stays_with_its_node_when_another_claims_it_and_absurd_counts_are_refused(tmp_path):
    """Node 5 connects in round 2 and claims client 0 (hosted by node 10, without its token) and clients 1 and 3 with 0 and 2**62 examples."""
    config = _config(*ALGORITHMS["scaffold"], rounds=3)
    honest, _ = _deploy(config, tmp_path / "honest", _Nodes(config, tmp_path / "honest_state"))
    nodes = _Nodes(config, tmp_path / "state")
    sizes = [len(indices) for indices in nodes.data.client_indices]
    counts = torch.full((8,), -1, dtype=torch.int64)
    counts[0], counts[1], counts[3] = sizes[0], 0, 2**62
    hostile, asked_of_5 = _claiming_node(counts)
    server, result, lines = _run_with_a_node_joining_in_round_2(config, tmp_path / "out", nodes, hostile)
    assert not asked_of_5 and not server.rejections
    assert torch.equal(result.final_params, honest.final_params)
    assert (
        "round 2: node 5 claims clients 0 without their registration tokens; refused (each stays with the node holding its token)"
        in lines
    )
    assert f"round 2: node 5 claims clients 1 with 0, 3 with {2**62} examples (1..{2**40}); claims ignored" in lines
    saved = json.loads((tmp_path / "out" / "deployment_rounds.json").read_text())
    assert saved["num_samples"] == sizes
    # The server keeps each client's token digest, never the token; the node keeps the token in its state directory.
    token = (tmp_path / "state" / config.fingerprint() / saved["run_id"] / "client-0.token").read_bytes()
    assert saved["token_sha256"]["0"] == hashlib.sha256(token).hexdigest() and len(token) == 16


# ---------------------------------------------------------------- late replies, restarts (issue test 4)


def _late_in_round(round_index):
    """An interceptor: the first client asked to train in ``round_index`` trains (and stages) but its reply misses the deadline."""
    late: list[int] = []

    def intercept(client, request):
        reply = client.handle(request)
        if _is(request, TrainRequest, round_index) and not late:
            late.append(wire.read_envelope(request, max_bytes=1 << 30).client_id)
            raise NoReply
        return reply

    return intercept, late


def test_a_late_reply_is_not_aggregated_and_its_client_drops_the_staged_state(tmp_path):
    config = _config(*ALGORITHMS["scaffold"], rounds=3)
    intercept, late = _late_in_round(2)
    nodes = _Nodes(config, tmp_path / "state", intercept)
    result, server = _deploy(config, tmp_path / "out", nodes)
    (client_id,) = late
    assert [(r.round, r.client_id) for r in server.rejections] == [(2, client_id)]
    assert "no reply within" in server.rejections[0].reason
    assert client_id not in result.records[1]["reporting_clients"]
    node_state = nodes.node_of(client_id)._state(client_id)
    assert node_state.staged_round is None
    assert node_state.committed_round != 2
    assert not list(node_state.directory.glob(f"client-{client_id}.round-2.*"))


def test_a_restarted_node_and_a_resumed_server_end_bit_identical_to_an_uninterrupted_run(tmp_path):
    config = _config(*ALGORITHMS["scaffold"], "compression.ratio=0.2")
    uninterrupted, _ = _deploy(config, tmp_path / "whole", _Nodes(config, tmp_path / "whole_state"))
    nodes = _Nodes(config, tmp_path / "state")
    _deploy(config.model_copy(update={"rounds": 3}), tmp_path / "out", nodes)
    committed = {client_id: nodes.node_of(client_id).committed_state(client_id) for client_id in range(8)}
    nodes.restart()
    run_id = json.loads((tmp_path / "out" / "deployment_rounds.json").read_text())["run_id"]
    for client_id, state in committed.items():  # a restarted node restores every committed state
        restored = nodes.node_of(client_id).committed_state(client_id, run_id)
        assert torch.equal(restored.inner.control, state.inner.control) and torch.equal(
            restored.residual, state.residual
        )
    resumed, _ = _deploy(config, tmp_path / "out", nodes, resume=True)
    assert torch.equal(resumed.final_params, uninterrupted.final_params)
    assert _metrics(resumed.records) == _metrics(uninterrupted.records)


class _Killed(Exception):
    pass


@pytest.mark.parametrize("when", ["after the nodes trained", "before the commit notices"])
def test_a_server_killed_mid_round_resumes_bit_identical(tmp_path, when):
    """Killed after the nodes staged round 3's states (nothing recorded), or after round 3's checkpoint but before any node heard it."""
    config = _config(*ALGORITHMS["scaffold"], rounds=4)
    uninterrupted, _ = _deploy(config, tmp_path / "whole", _Nodes(config, tmp_path / "whole_state"))
    armed = [True]

    def intercept(client, request):
        if armed[0] and when == "before the commit notices" and _is(request, RoundOutcome, 3):
            armed[0] = False
            raise _Killed
        reply = client.handle(request)
        if armed[0] and when == "after the nodes trained" and _is(request, TrainRequest, 3):
            armed[0] = False
            raise _Killed
        return reply

    def kill(client, request):
        # KeyboardInterrupt is no Exception: it goes through the transport and stops the server process's run.
        try:
            return intercept(client, request)
        except _Killed:
            raise KeyboardInterrupt("server killed") from None

    nodes = _Nodes(config, tmp_path / "state", kill)
    with pytest.raises(KeyboardInterrupt):
        _deploy(config, tmp_path / "out", nodes)
    nodes.intercept = None
    nodes.restart()
    resumed, _ = _deploy(config, tmp_path / "out", nodes, resume=True)
    assert torch.equal(resumed.final_params, uninterrupted.final_params)
    assert _metrics(resumed.records) == _metrics(uninterrupted.records)


# ---------------------------------------------------------------- a node that stops (issue test 3, in process)


@pytest.mark.parametrize("algorithm", ["scaffold", "feddyn"])
def test_a_node_that_stops_replying_leaves_the_run_going_and_the_invariants_intact(tmp_path, algorithm):
    config = _config(*ALGORITHMS[algorithm], rounds=5)

    def intercept(client, request):
        if 0 in client.client_ids and wire.read_envelope(request, max_bytes=1 << 30).round >= 3:
            raise NoReply  # node 0 (clients 0, 3, 6) is gone from round 3 on
        return client.handle(request)

    nodes = _Nodes(config, tmp_path / "state", intercept)
    result, server = _deploy(config, tmp_path / "out", nodes)
    assert len(result.records) == 5
    gone = {r.client_id for r in server.rejections}
    assert gone and gone <= {0, 3, 6} and all(r.round >= 3 for r in server.rejections)
    assert all(not set(record["reporting_clients"]) & {0, 3, 6} for record in result.records[2:])
    states = [nodes.node_of(client_id).committed_state(client_id) for client_id in range(8)]
    if algorithm == "scaffold":
        mean_control = torch.stack([state.control for state in states]).mean(0)
        torch.testing.assert_close(server.server_state.control, mean_control, rtol=0, atol=1e-12)
    else:
        dual_sum = torch.stack([state.dual for state in states]).sum(0)
        torch.testing.assert_close(server.server_state.dual_sum, dual_sum, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- malformed replies (issue test 5)


def _split(blob):
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(json.loads(blob[8 : 8 + length])["__metadata__"]["driftlab"])
    return load_safetensors(blob), header


def _join(tensors, header):
    return save_safetensors(tensors, metadata={"driftlab": json.dumps(header)})


def _tamper(kind, blob):
    tensors, header = _split(blob)
    key = "payload/message/control_delta"
    if kind == "wrong shape":
        tensors[key] = tensors[key][:-1].clone()
        header["tree"]["fields"]["message"]["fields"]["control_delta"]["shape"] = list(tensors[key].shape)
    elif kind in ("NaN", "Inf"):
        tensors[key] = tensors[key].clone()
        tensors[key][3] = float("nan") if kind == "NaN" else float("inf")
    elif kind == "wrong dtype":
        tensors[key] = tensors[key].float()
        header["tree"]["fields"]["message"]["fields"]["control_delta"]["dtype"] = "float32"
    elif kind == "missing key":
        del tensors[key]
        del header["tree"]["fields"]["message"]["fields"]["control_delta"]
    elif kind == "oversize":
        tensors["padding"] = torch.zeros(1 << 20, dtype=torch.uint8)
    elif kind == "wrong client id":
        header["client_id"] += 1
    elif kind == "replay of an older round":
        header["round"] -= 1
    elif kind == "forged upload bits":
        header["tree"]["fields"]["message"]["fields"]["bits"]["value"] = -3 * 10**30
    return _join(tensors, header)


MALFORMED = {
    "wrong shape": "control_delta: shape [577], expected [578]",
    "missing key": "missing key 'control_delta'",
    "NaN": "non-finite value",
    "Inf": "non-finite value",
    "wrong dtype": "dtype float32, expected float64",
    "oversize": "exceeds the limit",
    "wrong client id": "it was expected from client",
    "replay of an older round": "replay of round 2: round 3 is in progress",
    "forged upload bits": "the compressed message claims -3000000000000000000000000000000 bits, what arrived costs",
}
COMPRESSED_KINDS = {"forged upload bits"}  # tampered in a compressed run (the others in a plain one)


def _malformed_config(kind):
    return _config(*ALGORITHMS["scaffold"], *(["compression.ratio=0.2"] if kind in COMPRESSED_KINDS else []), rounds=4)


def _bad_reply_in_round_3(make_bad):
    victims: list[int] = []

    def intercept(client, request):
        reply = client.handle(request)
        if _is(request, TrainRequest, 3) and not victims:
            victims.append(wire.read_envelope(request, max_bytes=1 << 30).client_id)
            return make_bad(reply)
        return reply

    return intercept, victims


@pytest.fixture(scope="module")
def inactive_reference(tmp_path_factory):
    """``reference(kind)``: the run of ``kind``'s config where the first client asked in round 3 simply never answers."""
    references = {}

    def reference(kind):
        compressed = kind in COMPRESSED_KINDS
        if compressed not in references:
            tmp_path = tmp_path_factory.mktemp("reference")
            config = _malformed_config(kind)
            intercept, victims = _late_in_round(3)
            result, _ = _deploy(config, tmp_path / "out", _Nodes(config, tmp_path / "state", intercept))
            references[compressed] = result, victims[0]
        return references[compressed]

    return reference


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_reply_is_dropped_with_its_reason_and_the_run_is_unaffected(tmp_path, kind, inactive_reference):
    config = _malformed_config(kind)
    intercept, victims = _bad_reply_in_round_3(lambda reply: _tamper(kind, reply))
    nodes = _Nodes(config, tmp_path / "state", intercept)
    result, server = _deploy(config, tmp_path / "out", nodes)
    reference, reference_victim = inactive_reference(kind)
    assert victims == [reference_victim]
    assert [(r.round, r.client_id) for r in server.rejections] == [(3, victims[0])]
    assert MALFORMED[kind] in server.rejections[0].reason, server.rejections[0].reason
    assert torch.equal(result.final_params, reference.final_params)
    assert _metrics(result.records) == _metrics(reference.records)
    assert nodes.node_of(victims[0])._state(victims[0]).staged_round is None  # the node dropped what it staged


def test_an_error_reply_makes_its_client_inactive(tmp_path):
    config = _config(*ALGORITHMS["fedavg"], rounds=2)

    def intercept(client, request):
        if _is(request, TrainRequest, 2) and 1 in client.client_ids:
            raise OSError("disk full")
        return client.handle(request)

    result, server = _deploy(config, tmp_path / "out", _Nodes(config, tmp_path / "state", intercept))
    assert server.rejections and all("error reply: OSError: disk full" in r.reason for r in server.rejections)
    assert len(result.records) == 2


# ---------------------------------------------------------------- the node refuses what is not for it


def test_a_node_refuses_requests_of_another_run_client_or_a_replayed_round(tmp_path):
    config = _config(*ALGORITHMS["scaffold"], rounds=2)
    nodes = _Nodes(config, tmp_path / "state")
    _deploy(config, tmp_path / "out", nodes)
    client = nodes.clients[0]
    other = wire.encode(RoundOutcome(True), run_fingerprint="another-run", round=3, client_id=0)
    with pytest.raises(Exception, match="this node serves run"):
        client.handle(other)
    not_hosted = wire.encode(RoundOutcome(True), run_fingerprint=client.run_fingerprint, round=3, client_id=1)
    with pytest.raises(Exception, match="client 1 is not hosted on this node"):
        client.handle(not_hosted)
    with pytest.raises(Exception, match="unreadable request"):
        client.handle(b"\x00" * 16)


# ---------------------------------------------------------------- compressed uploads on the wire


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_compressed_uploads_cost_on_the_wire_the_bits_the_metrics_count(tmp_path, algorithm):
    config = load_config(
        None,
        [
            *[o for o in BASE if not o.startswith("precision")],
            "precision=float32",
            "rounds=2",
            *ALGORITHMS[algorithm],
            "compression.ratio=0.1",
        ],
    )
    sent: dict[tuple[int, int], int] = {}

    def intercept(client, request):
        reply = client.handle(request)
        if _is(request, TrainRequest):
            envelope = wire.read_envelope(request, max_bytes=1 << 30)
            sent[(envelope.round, envelope.client_id)] = wire.payload_bytes(reply)
        return reply

    result, _ = _deploy(config, tmp_path / "out", _Nodes(config, tmp_path / "state", intercept))
    for record in result.records:
        on_wire = sum(8 * sent[(record["round"], client_id)] for client_id in record["reporting_clients"])
        # Tensor bytes only (the header holds scalars and structure); each message rounds its bit stream up to a byte.
        assert record["upload_bits"] <= on_wire < record["upload_bits"] + 8 * len(record["reporting_clients"])


def test_a_replayed_train_request_is_refused_and_leaves_the_staged_state_alone(tmp_path):
    config = _config(*ALGORITHMS["scaffold"], rounds=3)
    requests: dict[tuple[int, int], bytes] = {}

    def intercept(client, request):
        if _is(request, TrainRequest):
            envelope = wire.read_envelope(request, max_bytes=1 << 30)
            requests[(envelope.round, envelope.client_id)] = request
        if _is(request, RoundOutcome, 3):
            raise NoReply  # round 3's outcome is lost: its states stay staged
        return client.handle(request)

    nodes = _Nodes(config, tmp_path / "state", intercept)
    result, _ = _deploy(config, tmp_path / "out", nodes)
    earlier = {asked for round_index, asked in requests if round_index < 3}
    client_id = next(asked for asked in result.records[2]["reporting_clients"] if asked in earlier)
    older = max(round_index for round_index, asked in requests if asked == client_id and round_index < 3)
    node = nodes.node_of(client_id)
    with pytest.raises(Exception, match=f"replay: a request for round {older}"):
        node.handle(requests[(older, client_id)])
    assert node._state(client_id).staged_round == 3  # still waiting for the server's word


# ---------------------------------------------------------------- the run's life: the simulator's (experiments.run.lifecycle)


def test_a_deployment_logs_every_round_to_its_trackers_once(tmp_path):
    pytest.importorskip("tensorboard")
    from driftlab.experiments.run.trackers_test import _assert_same_series, _expected, _tensorboard_series

    config = _config(*ALGORITHMS["fedavg"], 'log=["tensorboard"]', rounds=3)
    _deploy(config, tmp_path / "out", _Nodes(config, tmp_path / "state"))
    assert [step for step, _ in _tensorboard_series(tmp_path / "out")["model_norm"]] == [1, 2, 3]
    _assert_same_series(_tensorboard_series(tmp_path / "out"), _expected(tmp_path / "out"))


def _diverging(*extra: str):
    # The loss climbs from round 1 on (client.lr far too large) but every reply stays finite, so the nodes' messages
    # are aggregated and the evaluated loss crosses divergence_factor x the initial model's in a later round.
    return _config(*ALGORITHMS["fedavg"], *DIVERGING, *extra, rounds=6)


DIVERGING = ["client.lr=0.5", "evaluation.divergence_factor=3", "checkpoint_every=100"]


def test_a_diverging_deployment_stops_as_the_simulator_does_naming_the_last_checkpoint(tmp_path):
    config = _diverging()
    with pytest.raises(FloatingPointError) as simulated:
        driftlab.run(config, tmp_path / "run")
    with pytest.raises(FloatingPointError) as deployed:
        _deploy(config, tmp_path / "deployed", _Nodes(config, tmp_path / "state"))
    message = str(deployed.value)
    assert message == str(simulated.value).replace(str(tmp_path / "run"), str(tmp_path / "deployed"))
    info = json.loads((tmp_path / "deployed" / "run.json").read_text())
    diverged_in = int(message.split("diverged in round ")[1].split(":")[0])
    assert diverged_in >= 2 and (info["status"], info["rounds_done"]) == ("diverged", diverged_in - 1)
    assert (
        f"The checkpoint of round {diverged_in - 1}, the last healthy round, is kept in {tmp_path / 'deployed'}"
        in message
    )
    assert len(run_directory_records(tmp_path / "deployed")) == diverged_in - 1  # the diverged round is not recorded


def test_a_completed_deployment_drops_its_checkpoint_unless_keep_checkpoint(tmp_path):
    for keep in (False, True):
        config = _config(*ALGORITHMS["scaffold"], f"keep_checkpoint={str(keep).lower()}", rounds=2)
        out = tmp_path / f"keep-{keep}"
        _deploy(config, out, _Nodes(config, tmp_path / f"state-{keep}"))
        assert json.loads((out / "run.json").read_text())["status"] == "complete"
        assert (out / "final_model.safetensors").exists() and (out / "checkpoint.safetensors").exists() == keep


def test_a_signal_while_a_deployment_round_commits_waits_until_the_round_is_committed(tmp_path, monkeypatch):
    import signal

    from driftlab.deploy import server as server_module

    config = _config(*ALGORITHMS["scaffold"], rounds=4)
    real_write = server_module.DeploymentServer._write_accepted
    interrupted: list[int] = []

    def ctrl_c_while_writing(self, out):
        if 2 in self._accepted and not interrupted:
            interrupted.append(2)
            signal.raise_signal(signal.SIGINT)  # held until the commit is done
        real_write(self, out)

    monkeypatch.setattr(server_module.DeploymentServer, "_write_accepted", ctrl_c_while_writing)
    out = tmp_path / "out"
    # Ctrl-C as a terminal delivers it: a test run started in the background inherits SIGINT ignored, and the
    # deferral rightly keeps whatever handling the process had.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            _deploy(config, out, _Nodes(config, tmp_path / "state"))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert interrupted == [2]
    assert str(caught.value).startswith(
        f"round 2 is checkpointed in {out}; continue with the deployment's server on {out} again"
    )
    info = json.loads((out / "run.json").read_text())
    assert (info["status"], info["rounds_done"]) == ("interrupted", 2)
    assert [record["round"] for record in run_directory_records(out)] == [1, 2]
    assert "2" in json.loads((out / "deployment_rounds.json").read_text())["accepted"]  # the commit ran to its end


def test_a_reply_tuple_of_another_length_than_planned_is_rejected_not_cut_short():
    # compared item by item, a shorter tuple would skip the planned items it lacks and a longer one smuggle extra ones
    planned = (torch.zeros(2), 3)
    wrong = (
        ((torch.zeros(2),), "a tuple of length 1"),
        ((torch.zeros(2), 3, 4), "a tuple of length 3"),
        ([torch.zeros(2), 3], "a list"),
    )
    for received, sent in wrong:
        with pytest.raises(
            wire.MessageRejected, match=f"^message/state is {sent}, the server planned a tuple of length 2$"
        ):
            _check_planned(received, planned, "message/state", {})
    distances: dict[str, float] = {}
    _check_planned((torch.ones(2), 3), planned, "message/state", distances)
    assert distances == {"message/state/0": pytest.approx(2**0.5)}


# ---------------------------------------------------------------- rounds that select nobody (poisson sampling)


class _NoEmptyExchange(InProcessTransport):
    """A transport that would wait its whole timeout on an empty exchange: the server must not ask it for one."""

    def exchange(self, requests, timeout):
        assert requests, "the server asked the nodes an empty exchange (a real transport could wait out its timeout)"
        return super().exchange(requests, timeout)


def test_a_deployment_round_that_selects_nobody_asks_no_node_and_equals_the_simulator(tmp_path):
    # seed 0, 8 clients, q = 0.1: rounds 1 and 5 select nobody (the first round before any client trained)
    config = _config(*ALGORITHMS["scaffold"], "sampling.mode=poisson", "sampling.participation=0.1", rounds=6)
    simulated = driftlab.run(config)
    assert [r["round"] for r in simulated.records if r["num_selected"] == 0] == [1, 5]
    asked: list[int] = []

    def intercept(client, request):
        if _is(request, TrainRequest):
            asked.append(wire.read_envelope(request, max_bytes=1 << 30).round)
        return client.handle(request)

    nodes = _Nodes(config, tmp_path / "state", intercept)
    transport = _NoEmptyExchange(nodes.transport().nodes)
    lines: list[str] = []
    result = DeploymentServer(
        config.model_copy(update={"rounds": 5}), tmp_path / "out", transport, log=lines.append
    ).run()
    assert 1 not in asked and 5 not in asked and len(result.records) == 5
    assert not [line for line in lines if "error" in line], lines  # nobody to ask is no failure
    resumed = DeploymentServer(
        config, tmp_path / "out", transport, resume=True, log=lines.append
    ).run()  # resumes after round 5
    assert torch.equal(resumed.final_params, simulated.final_params)
    assert _metrics(resumed.records) == _metrics(simulated.records)
    assert _metrics(run_directory_records(tmp_path / "out")) == _metrics(simulated.records)


# ---------------------------------------------------------------- client-level DP ([privacy]) deployed


PRIVATE_CASES = {
    # SCAFFOLD with clip 1, z 1 and poisson sampling: clipped on the nodes, bounded again and noised at the server
    "central": [
        *ALGORITHMS["scaffold"],
        "sampling.mode=poisson",
        "privacy.clip=1",
        "privacy.noise_multiplier=1",
        "privacy.delta=1e-3",
    ],
    # adaptive clipping: the clip travels with the broadcast and each client's bit with its message
    "adaptive": [
        "algorithm.name=fedavg",
        "algorithm.aggregation=uniform",
        "sampling.participation=1",
        "privacy.clip=0.1",
        "privacy.noise_multiplier=0.5",
        "privacy.adaptive=true",
        "privacy.count_noise=1",
    ],
}


@pytest.mark.parametrize("overrides", PRIVATE_CASES.values(), ids=PRIVATE_CASES)
def test_a_private_deployment_equals_the_simulator_bit_for_bit(tmp_path, overrides):
    config = _config(*overrides, rounds=4)
    simulated = driftlab.run(config, tmp_path / "simulated")
    deployed = run_in_process(config, tmp_path / "deployed", tmp_path / "node_state", num_nodes=3)
    assert torch.equal(deployed.final_params, simulated.final_params)
    assert _metrics(deployed.records) == _metrics(simulated.records)
    assert all(record["privacy_noise_std"] > 0 for record in deployed.records)
    assert any(record["privacy_clipped_fraction"] > 0 for record in deployed.records)
