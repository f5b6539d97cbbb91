"""What a deployment's server and nodes say to each other, and what both derive from the config.

The messages (``TrainRequest``, ``TrainReply``, ...) travel through
``driftlab.deploy.wire``; a ``Transport`` moves their bytes (``InProcessTransport``
in this process; ``driftlab.flower.apps`` over Flower).  The protocol is
described in ``driftlab.deploy.server``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from driftlab.data.federated import FederatedDataset
from driftlab.deploy import wire
from driftlab.errors import ConfigError
from driftlab.experiments.config import ExperimentConfig
from driftlab.experiments.run.assembly import build_model, configured_algorithm, load_data, resolve_device
from driftlab.features import drivers
from driftlab.features.capabilities import Conflict, algorithm_key, conflicts
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.precision import parameter_dtype
from driftlab.simulation.round.client import ClientSettings
from driftlab.simulation.seam import Algorithm, ClientContext

NODE = -1  # the client id in the envelope of a node's own messages (registration)
_SLACK_BYTES = 1 << 16  # a message may exceed twice its template's size by this much (headers, scalars)
RUN_ID = re.compile(r"[0-9a-f]{32}")  # uuid4().hex, made by the server on a fresh start, kept by a resume
MAX_NUM_SAMPLES = 1 << 40  # a registered count above this is refused (a node's claim, not a data set)


def run_fingerprint(config_fingerprint: str, run_id: str) -> str:
    """What a run's envelopes and node states are tied to: the same config run twice gets two run ids, so two of them."""
    return f"{config_fingerprint}/{run_id}"


# ---------------------------------------------------------------- messages (all travel through wire.encode)


@dataclass(frozen=True)
class RegistrationQuery:
    """Server -> node, before each round: which clients do you host?"""

    round: int  # the round about to be planned


@dataclass(frozen=True)
class Registration:
    """Node -> server: the node's clients, their training examples and the tokens that prove the node holds them."""

    num_samples: (
        torch.Tensor
    )  # int64 [num_clients]: client k's training examples on this node, -1 where it hosts no client k
    tokens: (
        torch.Tensor
    )  # uint8 [num_clients, TOKEN_BYTES]: client k's registration token (node_state.registration_token); 0 elsewhere


@dataclass(frozen=True)
class TrainRequest:
    """Server -> node, for one client: train this round."""

    view: Any  # algorithm.broadcast(server state)
    context: ClientContext
    settings: ClientSettings
    aggregated_round: int  # the last round whose reply from this client the server aggregated; 0: none


@dataclass(frozen=True)
class TrainReply:
    """Node -> server: the client's message (None: it sends nothing) and the local steps it did."""

    message: Any  # the algorithm's message in its wire form (a compressed message without its dense model part)
    steps_done: int


@dataclass(frozen=True)
class RoundOutcome:
    """Server -> node, for one client, once the round is recorded: commit or drop the state staged in this round."""

    aggregated: bool


@dataclass(frozen=True)
class Acknowledged:
    """Node -> server: the client's committed round after a ``RoundOutcome`` (0: none)."""

    committed_round: int


class RequestRefused(ValueError):
    """A node refuses a request (not for this run, not its client, a replay, a state it cannot continue from); the reason says why."""


class NoReply(Exception):
    """Raised by an ``InProcessTransport`` node handler: its reply misses the deadline (a late or lost reply)."""


# ---------------------------------------------------------------- transport


class Transport(Protocol):
    """Moves request bytes to nodes and reply bytes back; the only thing a Flower adapter implements."""

    def node_ids(self) -> list[int]:
        """The nodes connected now."""
        ...

    def exchange(self, requests: Sequence[tuple[int, bytes]], timeout: float) -> dict[int, bytes | str]:
        """Send every ``(node id, request)`` at once and wait at most ``timeout`` seconds.

        Returns the replies by position in ``requests``: bytes, or a str for an
        error reply (the node's handler failed; the str says why).  A position
        missing from the result got no reply in time; a late reply is never returned.
        """
        ...


@dataclass
class InProcessTransport:
    """Calls each node's handler (``DeploymentClient.handle``) directly, in request order.

    A handler raising ``NoReply`` simulates a reply that misses the deadline;
    any other exception becomes an error reply, as a Flower node's would.
    """

    nodes: dict[int, Callable[[bytes], bytes]]

    def node_ids(self) -> list[int]:
        return sorted(self.nodes)

    def exchange(self, requests: Sequence[tuple[int, bytes]], timeout: float) -> dict[int, bytes | str]:  # noqa: ARG002
        replies: dict[int, bytes | str] = {}
        for position, (node_id, request) in enumerate(requests):
            handler = self.nodes.get(node_id)
            if handler is None:
                continue
            try:
                replies[position] = handler(request)
            except NoReply:
                continue
            except Exception as error:  # noqa: BLE001  (an error reply, as a remote node's)
                replies[position] = f"{type(error).__name__}: {error}"
        return replies


# ---------------------------------------------------------------- what both sides derive from the config


def check_deployable(config: ExperimentConfig, algorithm: Algorithm) -> None:
    """ConfigError for a configuration a deployment cannot run (module docstring): the first of
    ``deployment_conflicts``, in the one refusal template (``driftlab.features.capabilities.refusal``)."""
    found = deployment_conflicts(config, algorithm)
    if found:
        raise ConfigError(found[0].message)


def deployment_conflicts(config: ExperimentConfig, algorithm: Algorithm) -> list[Conflict]:
    """What a deployment refuses in ``config`` with ``algorithm``: the features it excludes (simulated time, the
    personal evaluation, a mean of client models), then what it needs of the algorithm (one phase, one view; no
    membership hooks when the registered set changes), from ``driftlab.features.drivers``'s declarations."""
    present = drivers.present_features(config) | algorithm.capabilities
    found = conflicts(drivers.DEPLOYMENT, algorithm_key(algorithm.name), present, algorithm.lack_reasons)
    membership_changes = bool(config.availability.events) or config.availability.initially_registered is not None
    if membership_changes:
        found += conflicts(
            drivers.DEPLOYMENT_MEMBERSHIP, algorithm_key(algorithm.name), present, algorithm.lack_reasons
        )
    excluded = [conflict for conflict in found if conflict.second == drivers.DEPLOYMENT_KEY]
    return excluded + [conflict for conflict in found if conflict.second != drivers.DEPLOYMENT_KEY]


def check_config_deployable(config: ExperimentConfig) -> None:
    """``check_deployable`` from the config alone (no data set or model is built): for the server's start and the CLI."""
    check_deployable(config, configured_algorithm(config))


def size_limit(template: Any) -> int:
    """The most bytes a message of ``template``'s structure may take: twice the template's encoding, plus 64 KiB."""
    return 2 * len(wire.encode(template, run_fingerprint="", round=0, client_id=0)) + _SLACK_BYTES


def node_clients(num_clients: int, num_nodes: int, node_index: int) -> list[int]:
    """The client ids node ``node_index`` of ``num_nodes`` hosts when clients are dealt round-robin."""
    if not 0 <= node_index < num_nodes:
        raise ValueError(f"node index {node_index} is not in 0..{num_nodes - 1}")
    return list(range(node_index, num_clients, num_nodes))


def dataset_loader(dataset: FederatedDataset) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """``load(client_id) -> (inputs, targets)``: client ``client_id``'s training examples of ``dataset``."""

    def load(client_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.tensor(dataset.client_indices[client_id], dtype=torch.long)
        inputs = dataset.train_inputs[rows]
        if (
            dataset.input_normalisation is not None
        ):  # a node holds only its clients' rows: normalised once, as the simulator's batches
            inputs = dataset.input_normalisation(inputs)
        return inputs, dataset.train_targets[rows]

    return load


def deployment_model(config: ExperimentConfig, data: FederatedDataset | None = None) -> FlatModel:
    """The model the simulator builds for ``config`` (architecture and loss), on the config's device and precision.

    Its shape and classes come from the config's data set, loaded when ``data`` is not given.
    """
    data = data if data is not None else load_data(config)
    return build_model(config, data, None).to(resolve_device(config.device), parameter_dtype(config.precision))


__all__ = [
    "Acknowledged",
    "InProcessTransport",
    "NoReply",
    "Registration",
    "RegistrationQuery",
    "RequestRefused",
    "RoundOutcome",
    "TrainReply",
    "TrainRequest",
    "Transport",
    "check_config_deployable",
    "check_deployable",
    "dataset_loader",
    "deployment_model",
    "node_clients",
    "run_fingerprint",
    "size_limit",
]
