"""A deployment of a driftlab run: the server half and the node half, over any transport that moves bytes.

This package knows nothing of Flower (``driftlab.flower.apps`` adapts it to a
Flower ServerApp and ClientApp); it runs the simulator's own functions on
both sides, so a deployment computes what the simulator computes, and the
server runs the simulator's run lifecycle (``driftlab.experiments.run.lifecycle``),
so its run directory, trackers, signals, divergence and ``keep_checkpoint``
behave as ``driftlab run``'s:

server (``DeploymentServer``)
    asks the connected nodes which clients they host and their sample
    counts (again whenever the set of connected nodes changes, so a restarted
    node registers again by answering), plans the
    round with the engine's ``plan_round`` (sampling, availability,
    contexts), sends every active client its ``TrainRequest`` (the client
    view, its ``ClientContext``, the round's ``ClientSettings``), decodes each
    reply against the message the algorithm would produce (``wire.decode``),
    aggregates the valid ones in sample order with ``finish_round``, writes
    the run directory as ``driftlab run`` does (config.json, metrics.jsonl and
    .csv, a checkpoint every round, final model, run.json) and tells each
    node to commit or drop the client state it staged.
node (``DeploymentClient``)
    answers those requests for its clients: ``run_client`` from the client's
    committed state (``node_state.NodeClientState``), the new state staged
    until the server's word.

A reply that is missing, late, an error, or rejected by ``wire.decode``
(wrong shape, dtype, key, client, round; NaN or infinity; too large; a
compressed message whose claimed bits are not what arrived) makes its
client inactive this round, with the reason logged; the run goes on.

What the server planned, a reply cannot change.  The server computes the
message the client would send had its model not moved (``planned_message``:
the algorithm's own ``client_finish`` on the round's context and the reply's
local steps) and refuses a reply whose scalars differ from it: the sample
count n_k (the registered one), the multiplicity (the sampling's), an
incomplete client's completed fraction.  The local steps must be the steps
asked for (1 to those with the γ-inexact solver, the only early stop).  So
the aggregation weights the algorithms read from a message (FedAvg's
``client_weight(num_samples, multiplicity)``) are the server's own.

Every reply is bounded before it is folded.  All replies of a round arrive
before any is aggregated, so each tensor of each reply is measured first:
its distance from the same tensor of ``planned_message`` (for a final model,
‖θ_k − θ^{t−1}‖; a compressed model is measured after it is rebuilt, so
ternary scales are bounded too), and a reply farther than ``reply_bound``
(default 1000; the Flower run config's ``reply-bound``, 0 for none) times
that tensor's scale is refused (``out_of_bounds``): its client is inactive
this round, as for a malformed reply.  A tensor's scale is the largest lower
median of its distances in the run's rounds so far, this one included (kept
in ROUNDS_FILE), taken over the nodes that answered (each node once, at the
lower median of its clients') and only in a round that two nodes or more
answered: one node cannot set or raise it, not even alone in a round while
the others are late.  The run ends as diverged only when the aggregate is
(``finish_round``'s checks).  The median is robust while honest nodes are
more than half of a round's; a tensor whose scale is 0 is not bounded (nor
any before a round answered by two nodes: a deployment of one node is not
bounded).  An honest client whose update is 1000 times that scale would be
dropped too: raise ``reply-bound`` for such runs.

The node trusts its own config, not the server: a request whose round
settings (learning rate, precision, batch size, clipping, seed, ...),
planned steps, available steps (1..planned), multiplicity or client count
differ from what the node's config gives is refused with both values
(``RequestRefused``; the server logs it and the client is inactive).

Registration and who holds a client.  A node registers with each client's
sample count and a registration token, a 16-byte secret the node makes for
the client in its state directory the first time (``node_state
.registration_token``), written before it is ever sent.  The server pins
the count (a count outside 1..2**40 is refused) and the token's SHA-256 at
the client's first registration and keeps both in ROUNDS_FILE (the digest
only, so a results folder proves nothing); from then on the client goes
only to a node that sends the same token (the node hosting it stays its
host while it still claims it), so a node cannot take over a client another
node registered, before or after restarts of either side.  A node
restarted on the same state directory keeps its clients.  What tokens
cannot prevent (trust on first use): the server cannot know who really
holds a client's data, so on a fresh start a node that claims a client
before its real host registers gets it (and the real host's claim is
refused for the run); a client claimed by two nodes in the same first
registration goes to neither (logged as an error; the start fails naming
both if it stays contested), so a hostile node present at the start can
delay it but takes nothing claimed at the same time.  Binding clients to
machines needs authenticated nodes (Flower's SuperNode authentication,
``flower-superlink --enable-supernode-auth``) and TLS.  Why a node failed to
register is logged, and named in the error when clients never register.

Integrity on the wire.  ``wire.decode`` checks structure, shapes, dtypes
and finiteness, not authenticity: a flipped bit inside a tensor's bytes
decodes as another valid value (the bounds above catch only large changes),
and tokens travel in the clear.  Integrity and secrecy depend on the
transport: run Flower with TLS (never ``--insecure`` off one machine).

Runs.  A fresh start makes a run id (``uuid4().hex``); envelopes and node
states are tied to ``<config fingerprint>/<run id>`` (``run_fingerprint``), and
a node keeps each run's client states in ``state_dir/<config
fingerprint>/<run id>/``, so the same config run twice on one state
directory starts each run from fresh client states; a resume keeps the id.

Commit protocol.  After a round's record and checkpoint are on disk the
server sends each client it asked a ``RoundOutcome`` (aggregated or not).
The notice can be lost, so every ``TrainRequest`` also carries the last
round whose reply from that client the server aggregated: the node first
commits a staged state of exactly that round and drops any other, so node
and server never disagree about a client's state (SCAFFOLD's ``c`` stays the
mean of the ``c_k``, FedDyn's sum the sum of the ``λ_k``).  The server
keeps the run id, the registered sample counts and, per round, the clients
whose replies it accepted in ``deployment_rounds.json`` in the run
directory, written before the checkpoint, so a restarted server resumes
with the same knowledge.

Refused at start (``check_deployable``): membership changes (``availability.events``,
``initially_registered``) with an algorithm that updates the server state as
clients join or leave (FedDyn's ``Σ λ_k``: the server would need every
client's state), and evaluation models built from client models
(``all_clients_mean``, ``reporting_mean``), which the server never receives;
simulated time (``[system]``, ``[asynchronous]``): a deployment runs in real time.

Transport: ``Transport.exchange(requests, timeout)`` sends (node id, bytes)
requests and returns the replies that arrived in time (see ``Transport``);
``InProcessTransport`` calls node handlers directly (tests, ``run_in_process``).

The server evaluates as the simulator does, on the config's data set (test
split and the clients' training data for ``train_loss``), so it needs that
data set; nodes need only their own clients' examples (``load``) and the
model (``deployment_model`` builds it from the config's data set; pass your
own ``FlatModel`` where a node has no copy of it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from driftlab.data.federated import FederatedDataset
from driftlab.deploy import wire
from driftlab.deploy.messages import (
    MAX_NUM_SAMPLES,
    NODE,
    InProcessTransport,
    Registration,
    RegistrationQuery,
    RoundOutcome,
    TrainReply,
    TrainRequest,
    Transport,
    check_config_deployable,
    check_deployable,
    dataset_loader,
    deployment_model,
    node_clients,
    run_fingerprint,
    size_limit,
)
from driftlab.deploy.node import DeploymentClient
from driftlab.deploy.node_state import TOKEN_BYTES
from driftlab.deploy.reply_checks import (
    DEFAULT_REPLY_BOUND,
    _check_planned,
    out_of_bounds,
    planned_message,
    reply_template,
)
from driftlab.deploy.rounds_file import ROUNDS_FILE, read_rounds, write_rounds
from driftlab.errors import ConfigError
from driftlab.experiments.config import ExperimentConfig, load_config
from driftlab.experiments.run import run_directory
from driftlab.experiments.run.assembly import build_simulation, features_run_info, load_data
from driftlab.experiments.run.lifecycle import RunResult, run_rounds
from driftlab.experiments.run.trackers import check_trackers_installed
from driftlab.simulation.backends.buffers import refuse_running_statistics
from driftlab.simulation.round.engine import finish_round, plan_round
from driftlab.simulation.round.setup import Simulation, SimulationState
from driftlab.simulation.seam import ClientContext
from driftlab.simulation.state.state_store import InMemoryClientStore

LOGGER = logging.getLogger("driftlab.deploy")


# ---------------------------------------------------------------- the server


@dataclass(frozen=True)
class Timeouts:
    """Seconds the server waits for replies."""

    register: float = 30.0  # each round's registration query
    train: float = 600.0  # a round's training replies
    commit: float = 10.0  # acknowledgements of the round's outcome (best effort)
    first_registration: float = 120.0  # before the first round: until every client of the run has registered


@dataclass(frozen=True)
class Rejection:
    round: int
    client_id: int
    reason: str


@dataclass
class DeploymentServer:
    """The server of a deployment (module docstring): ``run()`` runs the remaining rounds and returns the RunResult.

    ``out_dir`` becomes a run directory like ``driftlab run``'s (claimed and
    locked the same way; ``resume`` continues from its checkpoint).  ``data``
    is the run's data set for evaluation (the config's is loaded when None).
    Every rejected, late, missing or error reply is logged (``log``, default
    the "driftlab.deploy" logger) and kept in ``rejections``.  The run's life
    (resume, checkpoints, trackers, signals, divergence, ``keep_checkpoint``)
    is ``driftlab.experiments.run.lifecycle``'s, as for ``driftlab run``.
    """

    config: ExperimentConfig
    out_dir: str | Path
    transport: Transport
    resume: bool = False
    data: FederatedDataset | None = None
    timeouts: Timeouts = Timeouts()
    log: Callable[[str], None] | None = None
    max_reply_bytes: int | None = None  # None: twice the size of the algorithm's message, plus 64 KiB
    reply_bound: float | None = DEFAULT_REPLY_BOUND  # out_of_bounds's factor over the round's median; None: no bound
    rejections: list[Rejection] = field(default_factory=list)
    server_state: Any = None  # the algorithm's server state after the last round run (None before)

    def run(self) -> RunResult:
        config = self.config if isinstance(self.config, ExperimentConfig) else load_config(self.config)
        check_config_deployable(config)  # before the run directory is touched
        if config.log:
            check_trackers_installed(config.log)  # before any work, as driftlab run
        out = run_directory.output_directory(self.out_dir)
        lock = run_directory.claim_run_directory(out, config, self.resume)
        try:
            return self._run_in(out, config)
        finally:
            lock.close()

    # ------------------------------------------------------------------ the run

    def _run_in(self, out: Path, config: ExperimentConfig) -> RunResult:
        # Only your own data goes in as data= (build_simulation's rule); a named data set is loaded from the config.
        sim, state = build_simulation(config, data=self.data if config.data.name == "custom" else None)
        check_deployable(config, sim.algorithm)
        try:
            refuse_running_statistics(
                sim.model.module,
                "a deployment",
                "a node's reply carries the algorithm's message only, not the running statistics its training moved",
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None
        # The client states live on the nodes: the server's store stays empty.
        state = SimulationState(0, state.server, InMemoryClientStore(None), None)
        rounds = _ServerRounds(self, out, config, sim)
        run_info = {"deployment": True, **features_run_info(config, sim)}
        result = run_rounds(rounds, out, config, sim, state, resume=self.resume, run_info=run_info)
        self.server_state = rounds.state.server
        return result

    def _start(self, out: Path, sim: Simulation, state: SimulationState) -> None:
        """What the server knows of the run's nodes and clients, from ROUNDS_FILE on a resume (a new run id otherwise)."""
        self._hosts: dict[int, int] = {}
        self._registered_nodes: list[int] | None = None  # the connected nodes at the last registration
        self._refusals: dict[int, str] = {}  # per node, why its last registration failed
        self._accepted, self._run_id, self._sizes, self._tokens, self._scales = read_rounds(
            out, state.round, sim.data.num_clients
        )
        self._contested: dict[int, list[int]] = {}  # clients claimed by several nodes at their first registration
        self._out = out
        self._write_accepted(out)  # the run id before any node hears it

    def _round(
        self, config: ExperimentConfig, sim: Simulation, state: SimulationState, fingerprint: str, evaluate_after: bool
    ) -> tuple[SimulationState, dict, _StagedRound]:
        """Round ``state.round + 1`` with the nodes, up to its record: the new state, the record and what ``commit`` keeps."""
        t = state.round + 1
        # Registering costs a round trip to every node: only when the connected nodes changed, a host is gone, or a
        # node failed to register last time (a restarted Flower node connects under a new node id).
        connected = sorted(self.transport.node_ids())
        if (
            connected != self._registered_nodes
            or self._refusals
            or any(node not in connected for node in self._hosts.values())
        ):
            self._register(sim, fingerprint, t, self.timeouts.register)
        work = plan_round(sim, state)
        settings = dataclasses.replace(
            work.settings, precision=config.precision
        )  # the nodes train at the config's precision
        asked: list[ClientContext] = []
        requests: list[tuple[int, bytes]] = []
        for context in work.contexts:
            node = self._hosts.get(context.client_id)
            if node is None:
                self._reject(t, context.client_id, "not registered on any connected node")
                continue
            request = TrainRequest(work.view, context, settings, self._last_accepted(context.client_id, t))
            asked.append(context)
            requests.append(
                (node, wire.encode(request, run_fingerprint=fingerprint, round=t, client_id=context.client_id))
            )
        # A round that asks nobody (poisson sampling selected no client, or none is hosted) waits for nothing.
        replies = self.transport.exchange(requests, self.timeouts.train) if requests else {}
        messages: dict[int, Any] = {}
        steps_done: dict[int, int] = {}
        distances: dict[int, dict[str, float]] = {}
        node_of = {
            context.client_id: node for context, (node, _) in zip(asked, requests, strict=True)
        }  # who answered for it
        for position, context in enumerate(asked):
            try:
                reply, distances[context.client_id] = self._accept(
                    replies.get(position), config, sim, work, context, fingerprint
                )
            except wire.MessageRejected as error:
                self._reject(t, context.client_id, error.reason)
                continue
            messages[context.client_id] = reply.message
            steps_done[context.client_id] = reply.steps_done
        # Every reply of the round has arrived before any is folded, so each is bounded by the round's median first.
        rejected, scales = out_of_bounds(
            {client: distances[client] for client in steps_done}, self.reply_bound, self._scales, node_of
        )
        for client_id, reason in rejected.items():
            self._reject(t, client_id, reason)
            del messages[client_id], steps_done[client_id]
        accepted = [context for context in work.contexts if context.client_id in steps_done]
        if work.contexts and not accepted:
            (self.log or LOGGER.error)(
                f"round {t}: error: no reply of the {len(work.contexts)} clients asked was accepted; the model stays as it was"
            )
        # Clients whose replies were not accepted are inactive this round, as if the availability model had said so.
        work = dataclasses.replace(
            work, contexts=tuple(accepted), num_inactive=work.num_inactive + len(work.contexts) - len(accepted)
        )
        server, record = finish_round(sim, work, messages, steps_done, evaluate_after=evaluate_after)
        notices = [
            (
                node,
                wire.encode(
                    RoundOutcome(context.client_id in steps_done),
                    run_fingerprint=fingerprint,
                    round=t,
                    client_id=context.client_id,
                ),
            )
            for node, context in zip((request[0] for request in requests), asked, strict=True)
        ]
        staged = _StagedRound(t, [context.client_id for context in accepted], scales, notices)
        return SimulationState(t, server, state.clients, None), record, staged

    def _commit(self, staged: _StagedRound) -> None:
        """The round's accepted clients and reply scales, kept in ROUNDS_FILE (before the checkpoint that holds the round)."""
        self._accepted[staged.round] = staged.accepted
        self._scales = staged.scales
        self._write_accepted(self._out)

    def _notify(self, staged: _StagedRound) -> None:
        """Tell each client asked whether its reply was aggregated, once the round's checkpoint is on disk."""
        if staged.notices:
            self.transport.exchange(
                staged.notices, self.timeouts.commit
            )  # best effort: the next TrainRequest says it again

    def _accept(
        self,
        reply: bytes | str | None,
        config: ExperimentConfig,
        sim: Any,
        work: Any,
        context: ClientContext,
        fingerprint: str,
    ) -> tuple[TrainReply, dict[str, float]]:
        """The client's reply, decoded and checked, its message as the client built it, and how far each of the message's
        tensors is from a client's that did not move (``planned_message``); MessageRejected with the reason otherwise."""
        if reply is None:
            raise wire.MessageRejected(f"no reply within {self.timeouts.train:g} s (late, lost, or the node is down)")
        if isinstance(reply, str):
            raise wire.MessageRejected(f"error reply: {reply}")
        template = reply_template(sim.algorithm, work.view, context)
        limit = self.max_reply_bytes or size_limit(template)
        expected = dict(run_fingerprint=fingerprint, round=work.round, client_id=context.client_id, max_bytes=limit)
        try:
            decoded = wire.decode(reply, template, **expected)
        except wire.MessageRejected as first:
            try:  # an algorithm may send nothing (EFL dropping a straggler's work)
                decoded = wire.decode(reply, TrainReply(None, 0), **expected)
            except wire.MessageRejected:
                raise first from None
        bound = context.planned_steps if context.available_steps is None else context.available_steps
        # Local training stops early only with the γ-inexact solver, and then after at least one step.
        least = 1 if config.client.inexact_gamma is not None else bound
        if not least <= decoded.steps_done <= bound:
            asked = f"exactly {bound}" if least == bound else f"1 to {bound}"
            raise wire.MessageRejected(f"reports {decoded.steps_done} local steps, the client was asked for {asked}")
        codec = sim.algorithm.codec
        message = None
        if decoded.message is not None:
            try:  # the message as its client built it (a compressed one rebuilt, its claimed bits checked)
                message = codec.from_wire(decoded.message, work.view.params)
            except ValueError as error:
                raise wire.MessageRejected(str(error)) from None
        distances: dict[str, float] | None = {}
        if message is not None:
            try:
                planned = planned_message(sim.algorithm, work.view, context, decoded.steps_done)
            except Exception:  # noqa: BLE001  (a plugin that cannot finish a client that did not move: scalars only)
                planned, distances = (
                    planned_message(sim.algorithm, work.view, context, decoded.steps_done, moved=True),
                    None,
                )
            _check_planned(message, planned, "message", distances if distances is not None else {}, codec.unplanned)
        return TrainReply(message, decoded.steps_done), distances or {}

    def _reject(self, round_index: int, client_id: int, reason: str) -> None:
        self.rejections.append(Rejection(round_index, client_id, reason))
        text = f"round {round_index}: client {client_id} inactive: {reason}"
        (self.log or LOGGER.warning)(text)

    # ------------------------------------------------------------------ registration

    def _await_registration(self, sim: Any, fingerprint: str, round_index: int) -> None:
        """Query the nodes until every client of the run has registered; ConfigError after ``timeouts.first_registration``."""
        deadline = time.monotonic() + self.timeouts.first_registration
        while True:
            self._register(
                sim, fingerprint, round_index, min(self.timeouts.register, max(0.1, deadline - time.monotonic()))
            )
            missing = [client_id for client_id in range(len(self._sizes)) if client_id not in self._hosts]
            if not missing:
                return
            if time.monotonic() >= deadline:
                shown = ", ".join(str(client_id) for client_id in missing[:10]) + (", ..." if len(missing) > 10 else "")
                reasons = "".join(
                    f"; node {node} did not register: {reason}" for node, reason in sorted(self._refusals.items())
                )
                reasons += "".join(
                    f"; client {client_id} is claimed by nodes {', '.join(map(str, nodes))} (one of them does not hold it: stop the "
                    "node whose client ids are wrong)"
                    for client_id, nodes in sorted(self._contested.items())[:10]
                )
                raise ConfigError(
                    f"{len(missing)} of the run's {len(self._sizes)} clients did not register within {self.timeouts.first_registration:g} s "
                    f"(clients {shown}); start the nodes that host them (each node lists its client ids), or wait longer "
                    f"(Timeouts.first_registration){reasons}"
                )
            time.sleep(0.5)

    def _register(self, sim: Any, fingerprint: str, round_index: int, timeout: float) -> None:
        """Ask every connected node for its clients (module docstring: a client's host and its frozen sample count)."""
        warn = self.log or LOGGER.warning
        nodes = sorted(self.transport.node_ids())
        query = wire.encode(
            RegistrationQuery(round_index), run_fingerprint=fingerprint, round=round_index, client_id=NODE
        )
        replies = self.transport.exchange([(node, query) for node in nodes], timeout)
        self._refusals = {node: reason for node, reason in self._refusals.items() if node in nodes}
        template = Registration(
            torch.zeros(len(self._sizes), dtype=torch.int64),
            torch.zeros((len(self._sizes), TOKEN_BYTES), dtype=torch.uint8),
        )
        claims: dict[int, list[tuple[int, int, str]]] = {}  # client -> [(node, count, token digest)]
        for position, node in enumerate(nodes):
            reply = replies.get(position)
            if not isinstance(reply, bytes):
                reason = f"no reply within {timeout:g} s" if reply is None else str(reply)
                self._refusals[node] = reason
                warn(f"round {round_index}: node {node} did not register: {reason}")
                continue
            try:
                registration = wire.decode(
                    reply,
                    template,
                    run_fingerprint=fingerprint,
                    round=round_index,
                    client_id=NODE,
                    max_bytes=size_limit(template),
                )
            except wire.MessageRejected as error:
                self._refusals[node] = f"registration rejected: {error.reason}"
                warn(f"round {round_index}: node {node} did not register: registration rejected: {error.reason}")
                continue
            self._refusals.pop(node, None)
            counts = registration.num_samples.tolist()
            absurd: list[str] = []
            for client_id, count in enumerate(counts):
                if count < 0:
                    continue
                if not 1 <= count <= MAX_NUM_SAMPLES:
                    absurd.append(f"{client_id} with {count}")
                    continue
                digest = hashlib.sha256(registration.tokens[client_id].numpy().tobytes()).hexdigest()
                claims.setdefault(client_id, []).append((node, count, digest))
            if absurd:
                warn(
                    f"round {round_index}: node {node} claims clients {_listed(absurd)} examples (1..{MAX_NUM_SAMPLES}); claims ignored"
                )
        pinned_before = len(self._tokens)
        owners, refused, contested = self._owners(claims)
        for node, clients in sorted(refused.items()):
            warn(
                f"round {round_index}: node {node} claims clients {_listed(clients)} without their registration tokens; "
                "refused (each stays with the node holding its token)"
            )
        for client_id, (node, count) in owners.items():
            if self._sizes[client_id] < 0:
                self._sizes[client_id] = count  # frozen at the first registration (kept in ROUNDS_FILE)
            elif count != self._sizes[client_id]:
                warn(
                    f"round {round_index}: node {node} reports {count} examples for client {client_id}, registered with "
                    f"{int(self._sizes[client_id])}; the registered count stands"
                )
        self._contested = contested
        for client_id, claimants in sorted(contested.items()):
            warn(
                f"round {round_index}: error: client {client_id} is claimed by nodes {', '.join(map(str, claimants))} at its first "
                "registration; it is registered to none of them until only one claims it"
            )
        owners = {client_id: node for client_id, (node, _) in owners.items()}
        self._hosts = {client_id: owners[client_id] for client_id in sorted(owners)}
        self._registered_nodes = nodes
        if len(self._tokens) != pinned_before:
            self._write_accepted(self._out)  # a token is pinned on disk before its client trains
        # The sampling and the clients' contexts use the registered sample counts.
        if (self._sizes >= 0).all():
            sim.client_sizes = self._sizes.copy()

    def _owners(
        self, claims: dict[int, list[tuple[int, int, str]]]
    ) -> tuple[dict[int, tuple[int, int]], dict[int, list[int]], dict[int, list[int]]]:
        """Who hosts each claimed client (node, count); the clients each node claimed without their token; contested clients.

        A client with a pinned token goes to a node sending that token (the
        node hosting it now while it still does); a client without one (its
        first registration) to its only claimant, whose token is pinned then;
        claimed by several nodes at once, it is contested and goes to none.
        """
        owners: dict[int, tuple[int, int]] = {}
        refused: dict[int, list[int]] = {}
        contested: dict[int, list[int]] = {}
        for client_id, claimants in sorted(claims.items()):
            pinned = self._tokens.get(client_id)
            if pinned is None:
                if len(claimants) > 1:
                    contested[client_id] = [node for node, _, _ in claimants]
                    continue
                node, count, digest = claimants[0]
                self._tokens[client_id] = digest
                owners[client_id] = (node, count)
                continue
            valid = {node: count for node, count, digest in claimants if digest == pinned}
            for node, _, digest in claimants:
                if digest != pinned:
                    refused.setdefault(node, []).append(client_id)
            if valid:
                host = self._hosts.get(client_id)
                node = host if host in valid else min(valid)
                owners[client_id] = (node, valid[node])
        return owners, refused, contested

    # ------------------------------------------------------------------ accepted replies, per round

    def _last_accepted(self, client_id: int, before: int) -> int:
        rounds = [
            round_index
            for round_index, clients in self._accepted.items()
            if round_index < before and client_id in clients
        ]
        return max(rounds, default=0)

    def _write_accepted(self, out: Path) -> None:
        write_rounds(out, self._run_id, self._sizes, self._tokens, self._scales, self._accepted)


@dataclass(frozen=True)
class _StagedRound:
    """A round the server ran but has not committed: its accepted clients, reply scales and the nodes' notices."""

    round: int
    accepted: list[int]
    scales: dict[str, float]
    notices: list[tuple[int, bytes]]


class _ServerRounds:
    """The deployment's rounds as a ``lifecycle.RoundDriver``: registration before the first, each round exchanged
    with the nodes and committed to ROUNDS_FILE, the nodes told each round's outcome after its checkpoint."""

    # A node commits a round's client state when told the round is aggregated, which must never precede the
    # checkpoint that holds the round: so a checkpoint every round, whatever checkpoint_every says.
    checkpoints_every_round = True

    def __init__(self, server: DeploymentServer, out: Path, config: ExperimentConfig, sim: Simulation) -> None:
        self.server, self.out, self.config, self.sim = server, out, config, sim
        self.state: SimulationState | None = None  # the last committed state
        self.fingerprint = ""
        self._staged: _StagedRound | None = None

    def prepare(self, state: SimulationState) -> None:
        self.server._start(self.out, self.sim, state)
        self.fingerprint = run_fingerprint(self.config.fingerprint(), self.server._run_id)
        self.state = state

    def before_rounds(self, state: SimulationState) -> None:
        self.server._await_registration(self.sim, self.fingerprint, state.round + 1)

    def run_round(self, state: SimulationState, evaluate_after: bool) -> tuple[SimulationState, dict[str, Any]]:
        finished, record, self._staged = self.server._round(
            self.config, self.sim, state, self.fingerprint, evaluate_after
        )
        return finished, record

    def commit(self, state: SimulationState) -> None:
        self.server._commit(self._staged)
        self.state = state

    def discard(self, state: SimulationState) -> None:  # noqa: ARG002 - the RoundDriver protocol's signature
        """Forget the stopped round: its nodes drop what they staged when a request names the last aggregated round."""
        self._staged = None

    def round_done(self, state: SimulationState) -> None:  # noqa: ARG002 - the RoundDriver protocol's signature
        staged, self._staged = self._staged, None
        self.server._notify(staged)

    def how_to_continue(self, out: Path) -> str:
        return (
            f"the deployment's server on {out} again with resume=True (a Flower app: `flwr run . FEDERATION -c 'resume=true'` "
            "in its project directory)"
        )


def _listed(items: Sequence[Any], shown: int = 10) -> str:
    """``items`` joined by commas, the first ``shown`` of them (a node may claim 100,000 clients in one message)."""
    return ", ".join(str(item) for item in items[:shown]) + (
        f", ... ({len(items)} in all)" if len(items) > shown else ""
    )


def run_in_process(
    config: ExperimentConfig | dict | str | Path,
    out_dir: str | Path,
    state_dir: str | Path,
    *,
    num_nodes: int = 3,
    resume: bool = False,
    data: FederatedDataset | None = None,
) -> RunResult:
    """A whole deployment in this process: ``num_nodes`` DeploymentClients (clients dealt round-robin) serving the config's data set,
    behind an InProcessTransport, and the DeploymentServer writing ``out_dir``."""
    config = config if isinstance(config, ExperimentConfig) else load_config(config)
    data = data if data is not None else load_data(config)
    model = deployment_model(config, data)
    load = dataset_loader(data)
    nodes = {
        index: DeploymentClient(config, node_clients(data.num_clients, num_nodes, index), load, state_dir, model).handle
        for index in range(num_nodes)
    }
    return DeploymentServer(config, out_dir, InProcessTransport(nodes), resume=resume, data=data).run()


__all__ = [
    "DEFAULT_REPLY_BOUND",
    "DeploymentServer",
    "ROUNDS_FILE",
    "Rejection",
    "Timeouts",
    "out_of_bounds",
    "planned_message",
    "reply_template",
    "run_in_process",
]
