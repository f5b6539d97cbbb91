"""The Flower apps on a loopback deployment (a SuperLink and SuperNodes on 127.0.0.1) and on the simulation engine.

Every Flower process is started in its own session (process group) and stopped by that group in a
``finally``, within a timeout, whatever the test's outcome.  Telemetry, update checks and per-run
dependency installation are off, FLWR_HOME is the test's own: nothing reaches the network.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("flwr")

import torch

from driftlab import cli
from driftlab.experiments.config import load_config
from driftlab.extras import install_hint

TINY = """\
seed = 0
rounds = 3
keep_checkpoint = true  # the test reads the checkpoint of the completed run

[data]
name = "synthetic"
num_clients = 6

[model]
name = "mlr"

[algorithm]
name = "scaffold"

[client]
lr = 0.05
batch_size = 10
steps = 5

[sampling]
participation = 0.5
"""

NUM_NODES = 3
STOP_SECONDS = 10.0
# flwr 1.41's SuperNode starts a new ClientApp process for every message and polls every 3 s: a 3-round run
# takes 60-90 s on 2 busy cores.
RUN_SECONDS = 240


# ---------------------------------------------------------------- the process harness


def free_port() -> int:
    """A port nobody listens on now (bound to port 0, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def flower_environment(home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_AUTH_MODE": "disabled",
        # the SuperLink and SuperNodes start flower-superexec by name: the one beside this Python
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }


def start(command: list[str], environment: dict[str, str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
    with open(log, "wb") as output:
        return subprocess.Popen(
            command, env=environment, stdout=output, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
        )


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process's group, SIGKILL after STOP_SECONDS, then SIGKILL to whatever of the group is left."""
    if process.poll() is None:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait(STOP_SECONDS)
    _signal_group(process, signal.SIGKILL)  # children that outlived their parent (flower-superexec, app processes)


def _signal_group(process: subprocess.Popen, number: int) -> None:
    try:
        os.killpg(process.pid, number)
    except (ProcessLookupError, PermissionError):
        pass


def wait_for_port(port: int, process: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(
                f"the SuperLink exited with {process.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"the SuperLink did not listen on 127.0.0.1:{port} within {timeout:g} s")


@contextmanager
def loopback(tmp_path: Path, num_nodes: int = NUM_NODES) -> Iterator[dict]:
    """A SuperLink and ``num_nodes`` SuperNodes (node i: partition-id=i, state-dir tmp_path/node-i); stopped on exit."""
    home = tmp_path / "flwr-home"
    home.mkdir()
    link_port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n'
    )
    environment = flower_environment(home)
    processes: list[subprocess.Popen] = []
    nodes: list[subprocess.Popen] = []
    try:
        link_log = tmp_path / "superlink.log"
        link = start(
            ["flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(link_port)], environment, link_log
        )
        processes.append(link)
        wait_for_port(link_port, link, link_log)
        for index in range(num_nodes):
            node_config = f"partition-id={index} num-partitions={num_nodes} state-dir='{tmp_path / f'node-{index}'}'"
            command = ["flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{link_port}", "--host", "127.0.0.1"]
            command += ["--port", str(free_port()), "--node-config", node_config]
            node = start(command, environment, tmp_path / f"supernode-{index}.log")
            processes.append(node)
            nodes.append(node)
        yield {"environment": environment, "nodes": nodes, "processes": processes}
    finally:
        for process in reversed(processes):
            stop(process)


def flower_logs(tmp_path: Path) -> str:
    return "\n".join(
        f"--- {log.name}\n{log.read_text(errors='replace')[-2500:]}" for log in sorted(tmp_path.glob("*.log"))
    )


def new_project(tmp_path: Path) -> tuple[Path, Path]:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    project = tmp_path / "project"
    assert cli.main(["flower", "new", str(project), "--config", str(config)]) == 0
    return config, project


def flwr_run(project: Path, environment: dict[str, str], log: Path, run_config: str) -> subprocess.Popen:
    return start(["flwr", "run", str(project), "loopback", "--stream", "--run-config", run_config], environment, log)


def simulator_model(config: Path) -> torch.Tensor:
    import driftlab

    return driftlab.run(load_config(config, ['backend="sequential"'])).final_params


def final_model(run_dir: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final_model.safetensors"))["params"]


def run_to_the_end(tmp_path: Path, project: Path) -> list[dict]:
    """The records of ``project`` run by `flwr run` on a loopback federation, which must finish within RUN_SECONDS."""
    with loopback(tmp_path) as flower:
        timeouts = "train-timeout=60 register-timeout=30 commit-timeout=2"
        runner = flwr_run(project, flower["environment"], tmp_path / "flwr-run.log", timeouts)
        flower["processes"].append(runner)
        try:
            runner.wait(RUN_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.fail(f"flwr run did not finish within {RUN_SECONDS} s\n{flower_logs(tmp_path)}")
    assert runner.returncode == 0, flower_logs(tmp_path)
    assert (project / "run" / "final_model.safetensors").exists(), flower_logs(tmp_path)
    return [json.loads(line) for line in (project / "run" / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- tests


@pytest.mark.slow
def test_loopback_deployment_of_scaffold_equals_the_simulator(tmp_path):
    config, project = new_project(tmp_path)
    run_dir = project / "run"
    records = run_to_the_end(tmp_path, project)
    assert [record["round"] for record in records] == [1, 2, 3]
    assert torch.equal(final_model(run_dir), simulator_model(config))
    report = tmp_path / "report"
    assert cli.main(["report", str(run_dir), "--out", str(report), "--no-plots"]) == 0
    assert (report / "report.md").exists()


@pytest.mark.slow
def test_loopback_deployment_of_private_scaffold_equals_the_simulator(tmp_path):
    # [privacy] on Flower: clip 1, z 1, poisson sampling (a round may ask nobody), ε accounted: the simulator's run
    config = tmp_path / "private.toml"
    config.write_text(TINY + 'mode = "poisson"\n\n[privacy]\nclip = 1.0\nnoise_multiplier = 1.0\ndelta = 0.001\n')
    project = tmp_path / "project"
    assert cli.main(["flower", "new", str(project), "--config", str(config)]) == 0
    run_dir = project / "run"
    records = run_to_the_end(tmp_path, project)
    import driftlab

    simulated = driftlab.run(load_config(config, ['backend="sequential"']))
    assert torch.equal(final_model(run_dir), simulated.final_params)
    keys = ("privacy_epsilon", "privacy_noise_std", "privacy_clipped_fraction", "reporting_clients", "test_loss")
    assert [[r[k] for k in keys] for r in records] == [[r[k] for k in keys] for r in simulated.records]


@pytest.mark.slow
def test_a_node_killed_mid_run_leaves_fewer_reporters_and_scaffold_invariant(tmp_path):
    from driftlab.deploy import messages
    from driftlab.deploy.node_state import NodeClientState
    from driftlab.deploy.server import ROUNDS_FILE
    from driftlab.experiments.run.assembly import build_algorithm
    from driftlab.simulation.state.checkpoint import load_checkpoint

    config_path, project = new_project(tmp_path)
    config = load_config(config_path)
    run_dir = project / "run"
    killed = 2
    with loopback(tmp_path) as flower:
        log = tmp_path / "flwr-run.log"
        runner = flwr_run(project, flower["environment"], log, "train-timeout=30 register-timeout=30 commit-timeout=2")
        flower["processes"].append(runner)
        deadline = time.monotonic() + RUN_SECONDS
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            if time.monotonic() > deadline or runner.poll() is not None:
                pytest.fail(f"round 1 did not finish\n{flower_logs(tmp_path)}")
            time.sleep(0.2)
        # SIGTERM to the node's process group: the SuperNode deactivates, so the server stops waiting for it at once
        # (after a SIGKILL the SuperLink notices only after Flower's heartbeat patience; the reply deadlines still apply).
        stop(flower["nodes"][killed])
        try:
            runner.wait(RUN_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"flwr run did not finish within {RUN_SECONDS} s after a node was killed\n{flower_logs(tmp_path)}"
            )
    assert runner.returncode == 0, flower_logs(tmp_path)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [record["round"] for record in records] == [1, 2, 3]
    lost = set(messages.node_clients(config.data.num_clients, NUM_NODES, killed))
    # After the kill the node's clients never report; the others still do.
    for record in records[1:]:
        assert not lost & set(record["reporting_clients"]), record
        assert record["num_reporting"] >= 1
    assert sum(record["num_reporting"] for record in records[1:]) < sum(
        record["num_selected"] for record in records[1:]
    )

    # SCAFFOLD's server control is the mean over all clients of the controls the nodes keep.
    model = messages.deployment_model(config)
    algorithm = build_algorithm(config, model)
    initial = model.initial_parameters()
    server_template = algorithm.server_init(initial)
    checkpoint = load_checkpoint(
        run_dir / "checkpoint.safetensors", server_template, None, config.fingerprint(), torch.device("cpu")
    )
    assert checkpoint.round == 3
    server = checkpoint.server_state
    rounds = json.loads((run_dir / ROUNDS_FILE).read_text())
    accepted = {int(k): v for k, v in rounds["accepted"].items()}
    run_id = rounds["run_id"]
    controls = []
    for client_id in range(config.data.num_clients):
        node = client_id % NUM_NODES
        state = NodeClientState(
            tmp_path / f"node-{node}" / config.fingerprint() / run_id,
            client_id,
            messages.run_fingerprint(config.fingerprint(), run_id),
            algorithm.client_state_init(initial),
            lambda: algorithm.client_state_init(initial),
        )
        last = max((round_index for round_index, clients in accepted.items() if client_id in clients), default=None)
        if last is not None and state.committed_round != last:
            state.commit(
                last
            )  # the aggregated reply's state, staged when the notice could not reach the node: what it commits next
        assert state.committed_round == last
        controls.append(state.load().control)
    mean = torch.stack(controls).mean(0)
    torch.testing.assert_close(server.control, mean, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- the glue, without Flower processes


def test_bytes_travel_as_one_uint8_array_and_anything_else_is_refused():
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    from driftlab.flower import apps

    blob = bytes(range(256)) * 3
    content = apps.blob_content(blob)
    array = content[apps.RECORD_KEY][apps.BLOB_KEY]
    assert (array.dtype, tuple(array.shape), array.stype) == ("uint8", (len(blob),), "driftlab-wire/1")
    assert apps.content_blob(content) == blob
    with pytest.raises(ValueError, match="holds no driftlab/blob array"):
        apps.content_blob(RecordDict({"other": ConfigRecord({"blob": b"x"})}))
    wrong = RecordDict(
        {
            apps.RECORD_KEY: ArrayRecord(
                {apps.BLOB_KEY: Array(dtype="float32", shape=(1,), stype="numpy.ndarray", data=b"\0" * 4)}
            )
        }
    )
    with pytest.raises(ValueError, match="is not a driftlab-wire/1 uint8 array"):
        apps.content_blob(wrong)


def test_node_config_names_the_clients_of_a_node():
    from driftlab.errors import ConfigError
    from driftlab.flower.apps import node_client_ids

    assert node_client_ids({"client-ids": "3,0, 7"}, 10) == [0, 3, 7]
    assert node_client_ids({"client-ids": 4}, 10) == [4]
    assert node_client_ids({"partition-id": 1, "num-partitions": 3}, 8) == [1, 4, 7]
    assert node_client_ids({"client-ids": "2", "partition-id": 0, "num-partitions": 3}, 8) == [2]  # explicit ids win
    with pytest.raises(ConfigError, match="client-ids = 'a,b'"):
        node_client_ids({"client-ids": "a,b"}, 10)
    with pytest.raises(ConfigError, match="0 <= partition-id < num-partitions"):
        node_client_ids({"partition-id": 3, "num-partitions": 3}, 10)
    with pytest.raises(ConfigError, match='--node-config "partition-id=0 num-partitions=3"'):
        node_client_ids({}, 10)


def test_run_config_sets_the_timeouts_and_refuses_what_is_not_seconds():
    from driftlab.deploy import server
    from driftlab.errors import ConfigError
    from driftlab.flower import apps

    timeouts = apps._timeouts({"train-timeout": 12, "register-timeout": 3.5, "out-dir": "x"}, None)
    assert (timeouts.train, timeouts.register, timeouts.commit) == (12.0, 3.5, server.Timeouts().commit)
    with pytest.raises(ConfigError, match="run config commit-timeout = 'soon': give a positive number of seconds"):
        apps._timeouts({"commit-timeout": "soon"}, None)


def test_run_config_sets_the_reply_bound_zero_turns_it_off_and_nonsense_is_refused():
    from driftlab.errors import ConfigError
    from driftlab.flower import apps

    assert apps._reply_bound({}, 100.0) == 100.0
    assert apps._reply_bound({"reply-bound": 20}, 100.0) == 20.0
    assert apps._reply_bound({"reply-bound": 0}, 100.0) is None
    for value in (0.5, -3, "big", True, float("inf")):
        with pytest.raises(
            ConfigError,
            match=r"run config reply-bound = .*: give a factor of at least 1 over the round's median reply \(default 1000\), or 0 for no bound",
        ):
            apps._reply_bound({"reply-bound": value}, 100.0)
    with pytest.raises(ConfigError, match="run config resume = 'yes': give true or false"):
        apps._flag({"resume": "yes"}, "resume", False)


class _Reply:
    def __init__(self, to: str, node: int, blob: bytes | None = None, error: str | None = None) -> None:
        from types import SimpleNamespace

        from driftlab.flower import apps

        self.metadata = SimpleNamespace(reply_to_message_id=to, src_node_id=node)
        self.content = apps.blob_content(blob) if blob is not None else None
        self.error = SimpleNamespace(code=0, reason=error) if error is not None else None

    def has_error(self) -> bool:
        return self.error is not None

    def has_content(self) -> bool:
        return self.content is not None


class _FakeGrid:
    """A Grid whose nodes answer by script: {node: (seconds after the push, reply or None)}; node 9 leaves at once."""

    def __init__(self, script, nodes) -> None:
        self.script, self.nodes, self.pushed_at, self.ids = script, list(nodes), None, {}

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        self.pushed_at = time.monotonic()
        self.ids = {f"m{index}": message for index, message in enumerate(messages)}
        if 9 in self.nodes:
            self.nodes.remove(9)
        return [
            None if message.dst_node_id == 8 else message_id for message_id, message in self.ids.items()
        ]  # node 8: push failed

    def pull_messages(self, message_ids):
        elapsed = time.monotonic() - self.pushed_at
        out = []
        for message_id in message_ids:
            node = self.ids[message_id].dst_node_id
            after, kind = self.script.get(node, (None, None))
            if after is not None and elapsed >= after:
                out.append(
                    _Reply(message_id, node, error="boom") if kind == "error" else _Reply(message_id, node, blob=kind)
                )
        return out


def test_grid_transport_matches_replies_and_leaves_out_late_failed_and_departed_ones(monkeypatch):
    from types import SimpleNamespace

    from driftlab.flower import apps

    monkeypatch.setattr(
        apps,
        "Message",
        lambda content, dst_node_id, message_type, ttl: SimpleNamespace(dst_node_id=dst_node_id, ttl=ttl),
    )
    monkeypatch.setattr(apps, "LIVENESS_SECONDS", 0.2)
    script = {1: (0.0, b"one"), 2: (0.3, b"two"), 3: (0.0, "error"), 4: (60.0, b"late")}
    grid = _FakeGrid(script, nodes=[1, 2, 3, 4, 8, 9])
    transport = apps.GridTransport(grid, poll_seconds=0.05)
    assert transport.node_ids() == [1, 2, 3, 4, 8, 9]
    requests = [(2, b"a"), (1, b"b"), (3, b"c"), (4, b"d"), (8, b"e"), (9, b"f")]
    started = time.monotonic()
    replies = transport.exchange(requests, timeout=1.0)
    took = time.monotonic() - started
    assert replies == {0: b"two", 1: b"one", 2: "error reply from node 3: boom"}  # 4 late, 8 never pushed, 9 gone
    assert 0.95 <= took < 2.0  # the late reply is waited for until the deadline, never after
    grid = _FakeGrid({1: (0.0, b"one")}, nodes=[1, 9])
    started = time.monotonic()
    assert apps.GridTransport(grid, poll_seconds=0.05).exchange([(1, b"x"), (9, b"y")], timeout=30) == {0: b"one"}
    assert time.monotonic() - started < 2.0  # a departed node is not waited for until the deadline


def test_importing_the_apps_without_flower_says_how_to_install_it(tmp_path):
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class _NoFlower:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'flwr' or name.startswith('flwr.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _NoFlower())\n"
    )
    code = (
        "import driftlab.flower, driftlab.flower.project\n"
        "try:\n    import driftlab.flower.apps\nexcept ModuleNotFoundError as error:\n    print(error)\n"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environment)
    assert result.returncode == 0, result.stderr
    assert (
        f"driftlab.flower.apps needs Flower, an optional extra of driftlab: {install_hint('flower')}" in result.stdout
    )
    command = "import sys\nfrom driftlab import cli\nsys.exit(cli.main(['flower', 'check', 'synthetic-fedavg', '--rounds', '1']))\n"
    result = subprocess.run(
        [sys.executable, "-c", command], capture_output=True, text=True, timeout=120, env=environment
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"driftlab: error: `driftlab flower` needs Flower, an optional extra of driftlab: {install_hint('flower')}"
    )


def test_the_simulation_hides_only_flowers_run_simulation_deprecation_notice():
    pytest.importorskip("flwr")
    import logging

    from flwr.common.logger import warn_deprecated_feature

    from driftlab.flower.apps import _WithoutRunSimulationDeprecation

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("flwr")
    handler, quiet = Keep(), _WithoutRunSimulationDeprecation()
    logger.addHandler(handler)
    logger.addFilter(quiet)
    try:
        warn_deprecated_feature(
            "The `run_simulation` function is deprecated and will be removed in a future version of Flower."
        )
        warn_deprecated_feature("Passing `enable_tf_gpu_growth=True` is deprecated.")
    finally:
        logger.removeFilter(quiet)
        logger.removeHandler(handler)
    assert len(records) == 1 and "enable_tf_gpu_growth" in records[0]
