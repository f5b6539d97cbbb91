"""The Flower glue: a ``ServerApp`` and a ``ClientApp`` that run a driftlab config on Flower (the ``flower`` extra).

Everything an algorithm computes happens in ``driftlab.deploy``
(``DeploymentServer`` on the server, ``DeploymentClient`` on each node), which
exchanges opaque bytes; this module only carries those bytes over Flower, so
it is all that changes when Flower's API does (it is written for flwr 1.41).

``server_app(config)``
    the ServerApp: a ``DeploymentServer`` whose transport is the run's
    ``Grid``.  Each request is one Flower message holding the bytes as one
    uint8 ``Array``; replies are pulled until a deadline, and a reply after
    it is never used (the server treats its client as inactive).  The run
    directory comes from the run config's ``out-dir`` (or ``out_dir=``);
    ``resume = true`` continues it from its checkpoint; the timeouts of
    ``driftlab.deploy.server.Timeouts`` are the run config's ``register-timeout``,
    ``train-timeout``, ``commit-timeout`` and ``first-registration-timeout``
    (seconds); ``reply-bound`` is ``DeploymentServer.reply_bound`` (0: off).
``client_app(config, load)``
    the ClientApp: the bytes of each request go to the node's
    ``DeploymentClient`` and its reply bytes go back; an error becomes a
    Flower error reply (the server logs its reason).  The node config says
    which driftlab clients a node serves: ``client-ids`` (``"0,3,7"``), or
    ``partition-id`` and ``num-partitions`` (what the simulation engine sets:
    clients ``partition-id``, ``partition-id + num-partitions``, ...), and
    where their states live: ``state-dir`` (default ``state_dir=``, else
    ``~/.driftlab/flower-state``).  ``load(client_id) -> (inputs, targets)``
    reads a client's data on the node; without it the node loads the config's
    data set and serves each client's rows of it, exactly as the simulator
    partitions it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

try:
    from flwr.app import Array, ArrayRecord, Context, Error, Message, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
except ModuleNotFoundError as error:  # only a missing flwr; any other import problem is Flower's to report
    if not (error.name or "").startswith("flwr"):
        raise
    from driftlab.extras import install_hint

    raise ModuleNotFoundError(
        f"driftlab.flower.apps needs Flower, an optional extra of driftlab: {install_hint('flower')}"
    ) from None

import torch

from driftlab.deploy.messages import dataset_loader, deployment_model, node_clients
from driftlab.deploy.node import DeploymentClient
from driftlab.deploy.server import DEFAULT_REPLY_BOUND, DeploymentServer, Timeouts
from driftlab.errors import ConfigError

RECORD_KEY = "driftlab"  # the RecordDict entry holding the bytes of a request or reply
BLOB_KEY = "blob"
BLOB_STYPE = "driftlab-wire/1"
MESSAGE_TYPE = "train"  # every request kind travels as a train message: the bytes say what they are
HANDLER_ERROR_CODE = 100  # a Flower error code of our own: the node's DeploymentClient refused or failed
POLL_SECONDS = 0.2  # how often the server pulls replies while it waits for them
LIVENESS_SECONDS = 1.0  # how often it asks which nodes are still connected
DEFAULT_STATE_DIR = Path("~/.driftlab/flower-state")

Loader = Callable[[int], "tuple[torch.Tensor, torch.Tensor]"]


# ---------------------------------------------------------------- bytes in a Flower message


def blob_content(blob: bytes) -> RecordDict:
    """The RecordDict carrying ``blob``: one uint8 Array (chunked on the wire by Flower, never pickled)."""
    return RecordDict(
        {
            RECORD_KEY: ArrayRecord(
                {BLOB_KEY: Array(dtype="uint8", shape=(len(blob),), stype=BLOB_STYPE, data=bytes(blob))}
            )
        }
    )


def content_blob(content: RecordDict) -> bytes:
    """The bytes ``blob_content`` put in a message; ValueError when the content is not shaped that way."""
    try:
        array = content[RECORD_KEY][BLOB_KEY]
    except (KeyError, TypeError):
        raise ValueError(f"the message holds no {RECORD_KEY}/{BLOB_KEY} array (not a driftlab message)") from None
    if (
        not isinstance(array, Array)
        or array.dtype != "uint8"
        or array.stype != BLOB_STYPE
        or tuple(array.shape) != (len(array.data),)
    ):
        raise ValueError(f"the message's {RECORD_KEY}/{BLOB_KEY} is not a {BLOB_STYPE} uint8 array")
    return bytes(array.data)


def reply_value(reply: Message) -> bytes | str:
    """A reply's bytes, or the reason it carries none (a Flower error reply, or content that is not ours)."""
    if reply.has_error():
        return f"error reply from node {reply.metadata.src_node_id}: {reply.error.reason or f'Flower error code {reply.error.code}'}"
    if not reply.has_content():
        return f"empty reply from node {reply.metadata.src_node_id}"
    try:
        return content_blob(reply.content)
    except ValueError as error:
        return f"reply from node {reply.metadata.src_node_id}: {error}"


# ---------------------------------------------------------------- server


class GridTransport:
    """``driftlab.deploy.messages.Transport`` over a Flower ``Grid``: push every request at once, pull replies until the deadline."""

    def __init__(self, grid: Grid, poll_seconds: float = POLL_SECONDS) -> None:
        self.grid = grid
        self.poll_seconds = poll_seconds

    def node_ids(self) -> list[int]:
        # Nodes register asynchronously; the DeploymentServer polls this until its clients are served.
        return sorted(int(node) for node in self.grid.get_node_ids())

    def exchange(self, requests: Sequence[tuple[int, bytes]], timeout: float) -> dict[int, bytes | str]:
        if not requests:
            return {}
        deadline = time.monotonic() + timeout
        # ttl: the SuperLink drops a request nobody fetched by the deadline, so a node that comes back
        # later does not work on a round the server has already closed.
        ttl = max(float(timeout), 1.0)
        messages = [
            Message(blob_content(blob), dst_node_id=int(node), message_type=MESSAGE_TYPE, ttl=ttl)
            for node, blob in requests
        ]
        pushed = list(self.grid.push_messages(messages))
        index_of = {message_id: index for index, message_id in enumerate(pushed) if message_id}
        replies: dict[int, bytes | str] = {}
        next_liveness_check = time.monotonic() + LIVENESS_SECONDS
        while index_of and time.monotonic() < deadline:
            for reply in self.grid.pull_messages(list(index_of)):
                index = index_of.pop(reply.metadata.reply_to_message_id, None)
                if index is not None:
                    replies[index] = reply_value(reply)
            if index_of and time.monotonic() >= next_liveness_check:
                # A node the SuperLink no longer lists (stopped, or silent past Flower's heartbeat patience)
                # will not answer: its requests count as missing now rather than at the deadline.
                online = set(self.node_ids())
                index_of = {
                    message_id: index for message_id, index in index_of.items() if int(requests[index][0]) in online
                }
                next_liveness_check = time.monotonic() + LIVENESS_SECONDS
            if index_of:
                time.sleep(max(0.0, min(self.poll_seconds, deadline - time.monotonic())))
        return replies  # a request still pending had no reply before the deadline: it is left out, never returned later


def _timeouts(run_config: Mapping[str, Any], given: Timeouts | None) -> Timeouts:
    """``given`` (default ``Timeouts()``) with the run config's ``<field>-timeout`` keys applied (``train-timeout``, ...)."""
    timeouts = given if given is not None else Timeouts()
    changes = {}
    for field in dataclasses.fields(timeouts):
        key = field.name.replace("_", "-") + "-timeout"  # register-timeout, train-timeout, ...
        if key in run_config:
            value = run_config[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"run config {key} = {value!r}: give a positive number of seconds")
            changes[field.name] = float(value)
    return dataclasses.replace(timeouts, **changes)


def server_app(
    config: Any,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    timeouts: Timeouts | None = None,
    data: Any = None,
    log: Callable[[str], None] | None = None,
    reply_bound: float | None = DEFAULT_REPLY_BOUND,
) -> ServerApp:
    """The ServerApp running ``config`` (an ExperimentConfig, a config file, a preset name or a table; module docstring).

    The run config (``[tool.flwr.app.config]``, ``flwr run -c``) may set ``out-dir``,
    ``resume`` and the timeouts; they win over the arguments.  ``data`` is the
    server's copy of the data set for evaluation (default: the config's).
    """
    experiment = _experiment_config(config)
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_config = dict(context.run_config or {})
        directory = run_config.get("out-dir", out_dir)
        if not directory:
            raise ConfigError(
                "the ServerApp needs a run directory: set out-dir in [tool.flwr.app.config] (or flwr run -c 'out-dir=\"DIR\"')"
            )
        server = DeploymentServer(
            experiment,
            Path(str(directory)).expanduser(),
            GridTransport(grid),
            resume=_flag(run_config, "resume", resume),
            data=data,
            timeouts=_timeouts(run_config, timeouts),
            log=log or _print_line,
            reply_bound=_reply_bound(run_config, reply_bound),
        )
        result = server.run()
        (log or _print_line)(f"run complete: {len(result.records)} rounds in {directory}")

    return app


def _reply_bound(run_config: Mapping[str, Any], default: float | None) -> float | None:
    """The run config's ``reply-bound`` (0: no bound), else ``default``."""
    if "reply-bound" not in run_config:
        return default
    value = run_config["reply-bound"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value == 0 or 1 <= value < float("inf")):
        raise ConfigError(
            f"run config reply-bound = {value!r}: give a factor of at least 1 over the round's median reply (default "
            f"{DEFAULT_REPLY_BOUND:g}), or 0 for no bound"
        )
    return float(value) if value else None


def _flag(run_config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = run_config.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"run config {key} = {value!r}: give true or false")
    return value


def _print_line(text: str) -> None:
    # The ServerApp's stdout is what `flwr run --stream` (and a simulation) shows.
    print(f"driftlab: {text}", flush=True)


# ---------------------------------------------------------------- client


def node_client_ids(node_config: Mapping[str, Any], num_clients: int) -> list[int]:
    """The driftlab client ids a node serves, from its node config (module docstring); ConfigError naming the key."""
    if "client-ids" in node_config:
        value = node_config["client-ids"]
        words = str(value).replace(",", " ").split() if not isinstance(value, int) else [str(value)]
        if not words or not all(word.isdigit() for word in words):
            raise ConfigError(
                f'node config client-ids = {value!r}: give the node\'s driftlab client ids, e.g. client-ids="0,3,7"'
            )
        return sorted({int(word) for word in words})
    if "partition-id" in node_config:
        partition, partitions = node_config.get("partition-id"), node_config.get("num-partitions")
        if not isinstance(partition, int) or not isinstance(partitions, int) or not 0 <= partition < partitions:
            raise ConfigError(
                f"node config partition-id = {partition!r}, num-partitions = {partitions!r}: give 0 <= partition-id < num-partitions "
                '(integers), e.g. --node-config "partition-id=0 num-partitions=3"'
            )
        return list(node_clients(num_clients, partitions, partition))
    raise ConfigError(
        "the node config says which driftlab clients this node serves: --node-config \"client-ids='0,3,7'\" "
        'or --node-config "partition-id=0 num-partitions=3"'
    )


# The DeploymentClients of this process, by (ClientApp, node's clients, state directory): a node keeps one and
# reuses it (DeploymentClient asks for that).  Module level because Flower's simulation engine sends
# each message with a pickled copy of the ClientApp to a worker process; the copies share this process's entry.
_NODE_CLIENTS: dict[tuple[Any, ...], DeploymentClient] = {}
_NODE_CLIENTS_LOCK = threading.Lock()


@dataclasses.dataclass
class _NodeClients:
    """What a ClientApp needs to build its node's DeploymentClient (picklable: no client, no lock in it)."""

    config: Any
    load: Loader | None
    state_dir: str | Path | None
    model: Any
    token: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)  # this ClientApp, across pickled copies

    def for_node(self, node_config: Mapping[str, Any]) -> DeploymentClient:
        client_ids = node_client_ids(node_config, self.config.data.num_clients)
        state_dir = Path(str(node_config.get("state-dir") or self.state_dir or DEFAULT_STATE_DIR)).expanduser()
        key = (self.token, tuple(client_ids), str(state_dir))
        with _NODE_CLIENTS_LOCK:
            if key not in _NODE_CLIENTS:
                load, model = self.load, self.model
                if load is None:
                    # The config's data set: each client's rows, and the model's shape.
                    from driftlab.experiments.run.assembly import load_data

                    dataset = load_data(self.config)
                    load = dataset_loader(dataset)
                    model = model if model is not None else deployment_model(self.config, dataset)
                _NODE_CLIENTS[key] = DeploymentClient(self.config, client_ids, load, state_dir, model=model)
            return _NODE_CLIENTS[key]


def client_app(
    config: Any, load: Loader | None = None, *, state_dir: str | Path | None = None, model: Any = None
) -> ClientApp:
    """The ClientApp serving ``config``'s clients on a node (module docstring).

    ``load(client_id) -> (inputs, targets)`` reads a client's data on the node
    (default: the config's data set, partitioned as the simulator does);
    ``model`` is a ``FlatModel`` of the config's model (default: built from the config).
    """
    nodes = _NodeClients(_experiment_config(config), load, state_dir, model)
    app = ClientApp()

    @app.train()
    def handle(msg: Message, context: Context) -> Message:
        # run_client trains single-threaded itself, as the sequential backend does, so no thread setting here.
        try:
            reply = nodes.for_node(context.node_config).handle(content_blob(msg.content))
        except Exception as error:  # noqa: BLE001 - every failure goes back to the server as a reason, never kills the node
            return Message(
                error=Error(code=HANDLER_ERROR_CODE, reason=f"{type(error).__name__}: {error}"), reply_to=msg
            )
        return Message(blob_content(reply), reply_to=msg)

    return app


def _experiment_config(config: Any) -> Any:
    from driftlab.experiments.config import ExperimentConfig, load_config

    return config if isinstance(config, ExperimentConfig) else load_config(config)


# ---------------------------------------------------------------- the simulation engine


class _WithoutRunSimulationDeprecation(logging.Filter):
    """Drops Flower's (ANSI-coloured) notice that ``run_simulation`` is deprecated: it is the only in-process
    simulation engine Flower offers (flwr 1.41 and 1.42; why its replacement does not fit: the comment in
    ``simulate``), and a user of ``simulate`` has nothing to change."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).lstrip().startswith("DEPRECATED FEATURE") and "run_simulation" in str(record.args))


def simulate(
    config: Any,
    out_dir: str | Path,
    *,
    num_nodes: int,
    state_dir: str | Path,
    timeouts: Timeouts | None = None,
    log: Callable[[str], None] | None = None,
) -> None:
    """Run ``config`` under Flower's simulation engine (Ray) with ``num_nodes`` virtual SuperNodes, writing ``out_dir``.

    Node ``i`` serves the clients ``i, i + num_nodes, ...`` of the config's data set; their states live in ``state_dir``.
    """
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # silences Ray's token warning; a user's own setting wins
    from flwr.simulation import run_simulation

    experiment = _experiment_config(config)
    quiet = _WithoutRunSimulationDeprecation()
    logging.getLogger("flwr").addFilter(quiet)
    try:
        # Deprecated, yet the only way to run the simulation engine in this process with the apps built above. Its
        # replacement, `flwr run` (flwr 1.41-1.42, flwr/cli/run/run.py), takes a Flower App directory (a pyproject.toml
        # whose [tool.flwr.app.components] name the apps as "module:attribute", so they cannot close over `config`),
        # builds a FAB of it and submits it over HTTP to a SuperLink: for a local run `ensure_local_superlink`
        # (flwr/cli/local_superlink.py) spawns a detached `flower-superlink --simulation` process on 127.0.0.1 ports
        # 39091 and 39093 that outlives the command and keeps its state under $FLWR_HOME. That SuperLink then
        # starts `flwr-simulation` (`flwr.simulation.run_simulation_process`), a further process that pulls the FAB
        # through the Runtime API, installs it and imports the apps. The engine underneath, `_run_simulation`, is
        # private. So: no in-process, port-free replacement exists yet; move when Flower offers one.
        run_simulation(
            server_app=server_app(experiment, out_dir=out_dir, timeouts=timeouts, log=log),
            client_app=client_app(experiment, state_dir=state_dir),
            num_supernodes=int(num_nodes),
            backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": {"num_cpus": max(1, min(int(num_nodes), os.cpu_count() or 1)), "include_dashboard": False},
            },
        )
    finally:
        logging.getLogger("flwr").removeFilter(quiet)
