"""Compression with error feedback, as a combinator that wraps any algorithm.

EFL (../shared/papers/002_*, Algorithm 1), algorithms.md "EFL":

    client k:  Δ_k = R_k + (θ_k − θ_start);   send ST(Δ_k);   R_k ← Δ_k − ST(Δ_k)
    server:    Δ = R + (θ_new − θ);          broadcast ST(Δ); R ← Δ − ST(Δ);   θ ← θ + ST(Δ)

``with_compression(algorithm, ratio, tensor_sizes)`` applies this around any
algorithm of the seam: its clients' final models are replaced by what the
server can reconstruct, ``θ_start + ST(Δ_k)``, before the algorithm's own
``client_finish`` sees them (so a client's own state stays consistent with what
the server received), and the server model after the algorithm's
``server_update`` is replaced by ``θ + ST(Δ)``: the global model is the one
every client holds.  (EFL's Algorithm 1 adds the uncompressed Δ to the server
copy while carrying the residual forward, counting it twice; with q = 1 both
readings agree.)

Residuals are per client (persistent, checkpointed with the client state) and
at the server.  A client whose algorithm drops its message keeps its residual.

Bits: the model-sized part of each upload (the algorithm's one vector derived
from θ_k) costs the ST bits instead of 32 per entry; other tensors in the
message (SCAFFOLD's Δc, EFL's u and v) stay uncompressed.  The broadcast model
costs the ST bits of the server's last ``ST(Δ)`` (a full model in round 1),
once per selected client: this assumes every client applies every round's
broadcast (a multicast, as EFL's clients update ``ω^k ← ω^k + ST(Δ^G)``); a
client that missed rounds would need the sum of the broadcasts it missed,
which is not ternary and is not counted here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from driftlab.compress.ternary import compress_model
from driftlab.metrics.communication import BITS_PER_ENTRY, payload_bits
from driftlab.simulation.seam import Algorithm, ClientContext, ClientUpdate, RoundContext


@dataclass(frozen=True)
class CompressedServerState:
    inner: Any
    residual: torch.Tensor  # R, the server's error-feedback residual
    broadcast_bits: int  # bits of the model part of the next broadcast

    @property
    def params(self) -> torch.Tensor:
        return self.inner.params


@dataclass(frozen=True)
class CompressedClientState:
    inner: Any
    residual: torch.Tensor  # R_k


@dataclass(frozen=True)
class CompressedPayload:
    """A message or broadcast whose wire size is ``bits`` (payload_bits reads it)."""

    payload: Any
    bits: int


def with_compression(algorithm: Algorithm, ratio: float, tensor_sizes: Sequence[int]) -> Algorithm:
    """``algorithm`` with ST-compressed, error-feedback uploads and downloads (module docstring)."""
    sizes = tuple(int(size) for size in tensor_sizes)
    num_parameters = sum(sizes)
    model_bits = BITS_PER_ENTRY * num_parameters
    compress_model(torch.zeros(num_parameters), sizes, ratio)  # validates ratio and sizes before any work

    def server_init(initial_params: torch.Tensor) -> CompressedServerState:
        return CompressedServerState(algorithm.server_init(initial_params), torch.zeros_like(initial_params), model_bits)

    def client_state_init(initial_params: torch.Tensor) -> CompressedClientState:
        inner = algorithm.client_state_init(initial_params) if algorithm.client_state_init is not None else None
        return CompressedClientState(inner, torch.zeros_like(initial_params))

    def client_objective(server: CompressedServerState, client: CompressedClientState, context: ClientContext):
        return algorithm.client_objective(server.inner, client.inner, context)

    def client_finish(server: CompressedServerState, client: CompressedClientState, context: ClientContext, update: ClientUpdate):
        delta = client.residual + (update.final_params - update.start_params)
        sent, bits = compress_model(delta, sizes, ratio)
        received = dataclasses.replace(update, final_params=update.start_params + sent, local_params=update.trained_params)
        inner_state, message = algorithm.client_finish(server.inner, client.inner, context, received)
        if message is None:
            return CompressedClientState(inner_state, client.residual), None
        wire_bits = payload_bits(message) - model_bits + bits
        return CompressedClientState(inner_state, delta - sent), CompressedPayload(message, wire_bits)

    def server_update(server: CompressedServerState, messages: Sequence[CompressedPayload], context: RoundContext):
        inner, metrics = algorithm.server_update(server.inner, [m.payload for m in messages], context)
        delta = server.residual + (inner.params - server.inner.params)
        sent, bits = compress_model(delta, sizes, ratio)
        inner = dataclasses.replace(inner, params=server.inner.params + sent)
        return CompressedServerState(inner, delta - sent, bits), metrics

    def broadcast(server: CompressedServerState) -> CompressedPayload:
        inner = algorithm.broadcast(server.inner)
        return CompressedPayload(inner, payload_bits(inner) - model_bits + server.broadcast_bits)

    def membership_hook(hook):
        if hook is None:
            return None
        return lambda server, client: dataclasses.replace(server, inner=hook(server.inner, client.inner if client is not None else None))

    return Algorithm(
        name=algorithm.name,
        client_joined=membership_hook(algorithm.client_joined),
        client_left=membership_hook(algorithm.client_left),
        server_init=server_init,
        client_objective=client_objective,
        client_finish=client_finish,
        server_update=server_update,
        broadcast=broadcast,
        client_state_init=client_state_init,
    )
