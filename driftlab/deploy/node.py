"""The node half of a deployment: ``DeploymentClient`` answers the server's requests for the clients it hosts.

It runs the simulator's own client code (``run_client``) from each client's
committed state (``node_state.NodeClientState``) and trusts its own config, not
the server: a request whose round settings, planned steps, available steps,
multiplicity or client count differ from what the node's config gives is
refused (``RequestRefused``).  The protocol is described in ``driftlab.deploy.server``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from driftlab.deploy import wire
from driftlab.deploy.messages import (
    MAX_NUM_SAMPLES,
    NODE,
    RUN_ID,
    Acknowledged,
    Registration,
    RegistrationQuery,
    RequestRefused,
    RoundOutcome,
    TrainReply,
    TrainRequest,
    check_deployable,
    deployment_model,
    run_fingerprint,
    size_limit,
)
from driftlab.deploy.node_state import TOKEN_BYTES, NodeClientState, registration_token
from driftlab.errors import ConfigError
from driftlab.experiments.config import ExperimentConfig
from driftlab.experiments.run.assembly import build_algorithm, resolve_device, round_plan
from driftlab.simulation.backends.augmentation import flip_crop_from_keys
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import TrainingData
from driftlab.simulation.backends.precision import parameter_dtype
from driftlab.simulation.round.client import ClientData, ClientRound, ClientSettings, run_client
from driftlab.simulation.round.engine import client_settings
from driftlab.simulation.seam import ClientContext


class DeploymentClient:
    """The clients ``client_ids`` of one node, answering the server's requests (``handle``).

    ``load(client_id) -> (inputs, targets)`` gives a client's training
    examples (tensors, one row per example; converted here to the run's
    device and precision as the simulator converts its data); it is called
    once per client, at registration.  ``state_dir`` keeps the clients'
    states (``state_dir/<config fingerprint>/<run id>/client-<id>.safetensors``, the
    run id taken from the server's requests); a new
    ``DeploymentClient`` on the same directory continues from the committed
    states.  ``model`` is the run's model (architecture and loss; its
    weights do not matter, the server sends them); None builds it from the
    config (``deployment_model``).
    """

    def __init__(
        self,
        config: ExperimentConfig,
        client_ids: Sequence[int],
        load: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        state_dir: str | Path,
        model: FlatModel | None = None,
    ) -> None:
        self.config = config
        self.fingerprint = config.fingerprint()
        self.client_ids = tuple(sorted({int(client_id) for client_id in client_ids}))
        bad = [client_id for client_id in self.client_ids if not 0 <= client_id < config.data.num_clients]
        if bad:
            raise ConfigError(
                f"client ids {bad} are not clients of this run: data.num_clients = {config.data.num_clients}"
            )
        self.model = model if model is not None else deployment_model(config)
        self.algorithm = build_algorithm(config, self.model)
        check_deployable(config, self.algorithm)
        self.device = resolve_device(config.device)
        self.dtype = parameter_dtype(config.precision)
        self.initial_params = self.model.initial_parameters().to(self.device, self.dtype)
        self.state_dir = Path(state_dir) / self.fingerprint  # one subdirectory per run id (``run_fingerprint``)
        self.run_id: str | None = None  # the run the last request came from; the server makes one per fresh start
        self._load = load
        self._data: dict[int, ClientData] = {}
        self._states: dict[tuple[str, int], NodeClientState] = {}
        self._view = self.algorithm.broadcast(self.algorithm.server_init(self.initial_params))
        # The round plan of the simulator for this config: its planned_steps are what the server may ask of this node.
        self._plan = round_plan(config)
        self.max_request_bytes = size_limit(_train_request_template(self._view, self._settings(1), 0, 1))

    # ------------------------------------------------------------------ requests

    def handle(self, request: bytes) -> bytes:
        """The reply to one request of the server; RequestRefused (or a CheckpointError for an unusable state file) otherwise."""
        try:
            envelope = wire.read_envelope(request, max_bytes=self.max_request_bytes)
        except wire.MessageRejected as error:
            raise RequestRefused(f"unreadable request: {error.reason}") from None
        config_fingerprint, _, run_id = str(envelope.run_fingerprint).partition("/")
        if config_fingerprint != self.fingerprint:
            raise RequestRefused(
                f"request of run {envelope.run_fingerprint!r}; this node serves run {self.fingerprint!r} (same config on server and node?)"
            )
        if not RUN_ID.fullmatch(run_id):
            raise RequestRefused(
                f"request of run {envelope.run_fingerprint!r} without a run id (32 hex digits after the config's fingerprint)"
            )
        self.run_id = run_id
        if type(envelope.round) is not int or envelope.round < 1:
            raise RequestRefused(f"request for round {envelope.round!r}")
        kinds = {
            wire.type_name(RegistrationQuery): self._register,
            wire.type_name(TrainRequest): self._train,
            wire.type_name(RoundOutcome): self._outcome,
        }
        answer = kinds.get(envelope.payload_type)
        if answer is None:
            raise RequestRefused(f"unknown request type {envelope.payload_type!r}")
        return answer(request, envelope.round, envelope.client_id)

    @property
    def run_fingerprint(self) -> str:
        """What the current run's envelopes carry: the config's fingerprint and the server's run id."""
        return run_fingerprint(self.fingerprint, self.run_id or "")

    def _decode(self, request: bytes, template: Any, round_index: int, client_id: int) -> Any:
        try:
            return wire.decode(
                request,
                template,
                run_fingerprint=self.run_fingerprint,
                round=round_index,
                client_id=client_id,
                max_bytes=self.max_request_bytes,
            )
        except wire.MessageRejected as error:
            raise RequestRefused(f"malformed request: {error.reason}") from None

    # every handler in `kinds` (above) is called as handler(request, round_index, client_id); registration is the node's own
    def _register(self, request: bytes, round_index: int, client_id: Any) -> bytes:  # noqa: ARG002
        self._decode(request, RegistrationQuery(0), round_index, NODE)
        counts = torch.full((self.config.data.num_clients,), -1, dtype=torch.int64)
        tokens = torch.zeros((self.config.data.num_clients, TOKEN_BYTES), dtype=torch.uint8)
        for hosted in self.client_ids:
            counts[hosted] = self._client_data(hosted).num_samples
            tokens[hosted] = torch.frombuffer(
                bytearray(registration_token(self.state_dir / str(self.run_id), hosted)), dtype=torch.uint8
            )
        return wire.encode(
            Registration(counts, tokens), run_fingerprint=self.run_fingerprint, round=round_index, client_id=NODE
        )

    def _train(self, request: bytes, round_index: int, client_id: Any) -> bytes:
        client_id = self._hosted(client_id)
        template = _train_request_template(self._view, self._settings(round_index), client_id, round_index)
        asked = self._decode(request, template, round_index, client_id)
        if asked.context.client_id != client_id or asked.context.round != round_index:
            raise RequestRefused(
                f"the request's context is for client {asked.context.client_id}, round {asked.context.round}"
            )
        data = self._client_data(client_id)
        if asked.context.num_samples != data.num_samples:
            raise RequestRefused(
                f"the server counts {asked.context.num_samples} examples for client {client_id}, the node holds {data.num_samples}"
            )
        self._check_asked(asked, round_index, data.num_samples)
        node_state = self._state(client_id)
        state = None
        if node_state is not None:
            # A replayed request must not touch the states: refused before anything is committed or dropped.  The same
            # round again is no replay when its state is only staged: a restarted server runs that round anew.
            committed, staged = node_state.committed_round or 0, node_state.staged_round
            if (
                round_index <= committed
                or (staged is not None and round_index < staged)
                or asked.aggregated_round >= round_index
            ):
                raise RequestRefused(
                    f"replay: a request for round {round_index} (last aggregated round {asked.aggregated_round}), but client {client_id} "
                    f"has committed round {committed}" + (f" and staged round {staged}" if staged is not None else "")
                )
            self._settle(node_state, asked.aggregated_round)
            state = node_state.load()
        new_state, message, steps_done = run_client(
            ClientRound(self.algorithm, asked.view, state, asked.context, data, asked.settings)
        )
        if node_state is not None:
            node_state.stage(round_index, new_state)
        sent = self.algorithm.codec.to_wire(message) if message is not None else None
        return wire.encode(
            TrainReply(sent, steps_done), run_fingerprint=self.run_fingerprint, round=round_index, client_id=client_id
        )

    def _check_asked(self, asked: TrainRequest, round_index: int, num_samples: int) -> None:
        """RequestRefused for work this node's config does not give: the node trains only what its own config plans.

        A server (or whoever speaks for it) asking for 10**9 steps, an unknown
        precision or another learning rate would otherwise make the node
        allocate, compute or train whatever it is told.
        """
        settings = self._settings(round_index)
        if asked.settings != settings:
            raise RequestRefused(
                f"the server asks for the round settings {asked.settings}, this node's config gives {settings} "
                "(same config on server and node?)"
            )
        context = asked.context
        lr = settings.local.client_lr
        if context.client_lr != lr:
            raise RequestRefused(
                f"the server asks for client learning rate {context.client_lr!r} in round {round_index}, this node's config gives {lr!r}"
            )
        planned = self._plan.planned_steps(num_samples, round_index)
        if context.planned_steps != planned:
            raise RequestRefused(
                f"the server plans {context.planned_steps} local steps for client {context.client_id} in round {round_index}, "
                f"this node's config plans {planned}"
            )
        if context.available_steps is not None and not 1 <= context.available_steps <= planned:
            raise RequestRefused(
                f"the server makes {context.available_steps} local steps available, the plan is 1..{planned}"
            )
        clients = self.config.data.num_clients
        if not 1 <= context.multiplicity <= clients or not 1 <= context.num_registered <= clients:
            raise RequestRefused(
                f"multiplicity {context.multiplicity} and {context.num_registered} registered clients: this run has {clients} clients"
            )
        if not (math.isfinite(context.mean_num_samples) and 0 < context.mean_num_samples <= MAX_NUM_SAMPLES):
            raise RequestRefused(
                f"mean number of examples {context.mean_num_samples!r}: expected a count in (0, {MAX_NUM_SAMPLES}]"
            )

    def _settings(self, round_index: int) -> ClientSettings:
        """The round's settings as ``plan_round`` makes them from this node's config, at the config's precision (the
        server sends its clients the config's precision too)."""
        return client_settings(self._plan, round_index, self.config.precision)

    def _settle(self, node_state: NodeClientState, aggregated_round: int) -> int:
        """Commit the staged state the server aggregated, drop any other; the committed round, checked against the server's."""
        staged = node_state.staged_round
        if staged is not None:
            if staged == aggregated_round:
                node_state.commit(staged)
            else:
                node_state.drop(staged)
        committed = node_state.committed_round or 0
        if committed != aggregated_round:
            raise RequestRefused(
                f"client {node_state.client_id}'s committed state is of round {committed}, but the server last aggregated its reply "
                f"of round {aggregated_round}: this node's state directory {node_state.directory} is not the one the client trained "
                "with (lost or replaced); the client stays inactive rather than break the algorithm's invariants"
            )
        return committed

    def _outcome(self, request: bytes, round_index: int, client_id: Any) -> bytes:
        client_id = self._hosted(client_id)
        outcome = self._decode(request, RoundOutcome(False), round_index, client_id)
        node_state = self._state(client_id)
        committed = 0
        if node_state is not None:
            if node_state.staged_round == round_index:
                if outcome.aggregated:
                    node_state.commit(round_index)
                else:
                    node_state.drop(round_index)
            committed = node_state.committed_round or 0
        return wire.encode(
            Acknowledged(committed), run_fingerprint=self.run_fingerprint, round=round_index, client_id=client_id
        )

    # ------------------------------------------------------------------ clients

    def _hosted(self, client_id: Any) -> int:
        if type(client_id) is not int or client_id not in self.client_ids:
            raise RequestRefused(f"client {client_id!r} is not hosted on this node (it hosts {list(self.client_ids)})")
        return client_id

    def _client_data(self, client_id: int) -> ClientData:
        if client_id not in self._data:
            inputs, targets = self._load(client_id)
            inputs, targets = torch.as_tensor(inputs), torch.as_tensor(targets)
            if len(inputs) != len(targets):
                raise ValueError(f"load({client_id}) gave {len(inputs)} inputs but {len(targets)} targets")
            inputs = inputs.to(self.device, self.dtype if inputs.is_floating_point() else inputs.dtype)
            targets = targets.to(self.device, self.dtype if targets.is_floating_point() else targets.dtype)
            augment = flip_crop_from_keys if self.config.data.augment else None
            rows = torch.arange(len(inputs), device=self.device)
            self._data[client_id] = ClientData(self.model, TrainingData(inputs, targets, augment), rows)
        return self._data[client_id]

    def _state(self, client_id: int, run_id: str | None = None) -> NodeClientState | None:
        """Client ``client_id``'s state in run ``run_id`` (default: the current run): each run of a config keeps its own directory."""
        init = self.algorithm.client_state_init
        if init is None:
            return None
        run_id = run_id or self.run_id
        if run_id is None:
            raise RequestRefused("no request of the server has named its run yet")
        key = (run_id, client_id)
        if key not in self._states:
            initial = self.initial_params
            self._states[key] = NodeClientState(
                self.state_dir / run_id,
                client_id,
                run_fingerprint(self.fingerprint, run_id),
                init(initial),
                lambda: init(initial),
            )
        return self._states[key]

    def committed_state(self, client_id: int, run_id: str | None = None) -> Any:
        """Client ``client_id``'s committed state in run ``run_id`` (default: the current run; the run id is in the server's
        ROUNDS_FILE); its initial state when none is committed, None for a stateless algorithm."""
        node_state = self._state(self._hosted(client_id), run_id)
        return node_state.load() if node_state is not None else None


def _train_request_template(view: Any, settings: ClientSettings, client_id: int, round_index: int) -> TrainRequest:
    """A ``TrainRequest`` of the structure the server sends (``wire.decode`` reads only its types and shapes): the
    request's values are checked against the node's own plan afterwards (``DeploymentClient._check_asked``)."""
    context = ClientContext(client_id, round_index, 1, 1.0, 1, 1, settings.local.client_lr, 1, 1)
    return TrainRequest(view, context, settings, 0)


__all__ = ["DeploymentClient"]
