"""Compression with error feedback, as a combinator that wraps any algorithm.

EFL (Algorithm 1), docs/update-rules.md "EFL":

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

On a wire the upload is exactly what is counted: each ``CompressedPayload``
also carries ST(Δ_k) as a ``TernaryVector`` and names the message field it
stands for (the field that is θ_start + ST(Δ_k) or its change, found by its
value, whatever the algorithm); ``wire_form()`` empties that field and
``rebuilt(θ_start)`` recomputes it bit for bit; the compressed algorithm's
``codec`` (``compressed_codec``) does both for a deployment, which never names
the payload type.  The simulator's server reads the message itself.
Downloads still travel dense (their bits are counted as ST, as above).  A
message none of whose fields is θ_k or its change is sent whole and costs its
whole ``payload_bits``: nothing of it travels compressed.

Client-level DP (``driftlab.privacy``) wraps this combinator, in this order:
``with_privacy(with_compression(algorithm))``.  Privacy clips what the client
actually uploads, the compressed message, because the residual carries earlier
rounds' updates into each upload: a clip of θ_k − θ_start before compression
would bound nothing that is sent.  The compressed algorithm's ``ReleaseForm``
is the wrapped algorithm's, read through the payload (``compressed_release``):
it releases what the payload reveals, and clips a compressed message by
scaling its ternary μ (``TernaryVector.scaled``), so a clipped message still
travels compressed at the same bits.  What clipping removes is not fed back
into the client's residual (R_k keeps Δ_k − ST(Δ_k)): fed back, the residual
would carry the clipped-away part into later uploads, whose own clip bounds
them anyway, so it would only grow the residual without passing the bound.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from driftlab.compress.ternary import TernaryVector, compress_model
from driftlab.errors import ConfigError
from driftlab.features import drivers
from driftlab.features.capabilities import ASYNCHRONOUS_RULE, Reason, with_lack
from driftlab.features.wrapping import Wrapping
from driftlab.metrics.communication import BITS_PER_ENTRY, payload_bits
from driftlab.simulation.seam import (
    Algorithm,
    ClientContext,
    ClientUpdate,
    MessageCodec,
    Personalization,
    ReleaseForm,
    RoundContext,
    ServerFold,
)


@dataclass(frozen=True)
class CompressedServerState(Wrapping):
    residual: torch.Tensor  # R, the server's error-feedback residual
    broadcast_bits: int  # bits of the model part of the next broadcast


@dataclass(frozen=True)
class CompressedClientState:
    inner: Any
    residual: torch.Tensor  # R_k


@dataclass(frozen=True)
class CompressedClientView(Wrapping):
    """The wrapped algorithm's client view, whose wire size is ``bits`` (its model part ST-compressed)."""

    bits: int


# How a receiver rebuilds the wrapped message's model field from ST(Δ_k) (``CompressedPayload.model_form``).
# Why FedBuff refuses a compressed algorithm (its asynchronous rule's Lack), whatever the wrapped one declares.
ASYNCHRONOUS_REASON = Reason(
    why=(
        "a compressed upload's size is known only once its client has trained, and the asynchronous event order "
        "needs every arrival time at dispatch; the server's ST(Δ) broadcast also assumes every client applies "
        "every update, which a client in flight across several does not"
    ),
    fix=("set compression.ratio = 1"),
)


def asynchronous_reason(algorithm: Algorithm) -> Reason:
    """Why the compressed ``algorithm`` has no asynchronous rule: compression's reason, then the wrapped one's own."""
    return ASYNCHRONOUS_REASON.then(algorithm.refusal_reason(drivers.ASYNCHRONOUS))


MODEL_SENT_DENSE = 0  # the message carries its model field itself (no field of it is θ_k or its change)
MODEL_IS_FINAL = 1  # the field is θ_start + ST(Δ_k), the client's reconstructed final model
MODEL_IS_CHANGE = 2  # the field is (θ_start + ST(Δ_k)) − θ_start


@dataclass(frozen=True)
class CompressedPayload:
    """A message whose wire size is ``bits`` (payload_bits reads it), with its model part also in compressed form.

    ``payload`` is the wrapped algorithm's message as its client built it;
    ``model`` is ST(Δ_k) as it travels (``TernaryVector``) and ``model_field``
    the number of the message's field that is θ_start + ST(Δ_k) or its change
    (``model_form``).  On a wire (a deployment) the message goes as
    ``wire_form()``, that field emptied, so the bytes sent are the bits
    counted; the receiver calls ``rebuilt(θ_start)``, which recomputes the
    field with the client's own arithmetic, bit for bit.  A message none of
    whose fields is θ_k or its change travels whole (``model`` None).
    """

    payload: Any
    bits: int
    model: TernaryVector | None = None
    model_field: int = -1
    model_form: int = MODEL_SENT_DENSE

    def wire_form(self) -> "CompressedPayload":
        """What travels: the message without its model field, which ``model`` carries compressed."""
        if self.model_form == MODEL_SENT_DENSE:
            return self
        name = dataclasses.fields(self.payload)[self.model_field].name
        return dataclasses.replace(self, payload=dataclasses.replace(self.payload, **{name: None}))

    def rebuilt(self, start: torch.Tensor) -> "CompressedPayload":
        """The message received in ``wire_form``, its model field recomputed from ``model`` and θ_start = ``start``;
        ValueError for a form, field or compressed model that does not fit."""
        if self.model_form == MODEL_SENT_DENSE:
            if self.model is not None:
                raise ValueError("a message sent whole carries no compressed model")
            return self
        fields = dataclasses.fields(self.payload) if dataclasses.is_dataclass(self.payload) else ()
        if (
            self.model is None
            or self.model_form not in (MODEL_IS_FINAL, MODEL_IS_CHANGE)
            or not 0 <= self.model_field < len(fields)
        ):
            raise ValueError(
                f"model form {self.model_form} with field {self.model_field} and a compressed model {self.model is not None} do not fit the message"
            )
        name = fields[self.model_field].name
        if getattr(self.payload, name) is not None:
            raise ValueError(
                f"the message's field {name!r} is rebuilt from the compressed model, so it must arrive empty"
            )
        dense = self.model.to_dense().to(start.device)
        if dense.shape != start.shape or dense.dtype != start.dtype:
            raise ValueError(
                f"the compressed model is {dense.dtype} {tuple(dense.shape)}, the model is {start.dtype} {tuple(start.shape)}"
            )
        final = start + dense  # the client's own θ_start + ST(Δ_k)
        value = final if self.model_form == MODEL_IS_FINAL else final - start
        return dataclasses.replace(self, payload=dataclasses.replace(self.payload, **{name: value}))


def with_compression(algorithm: Algorithm, ratio: float, tensor_sizes: Sequence[int]) -> Algorithm:
    """``algorithm`` with ST-compressed, error-feedback uploads and downloads (module docstring)."""
    problem = algorithm.refusal(drivers.COMPRESSION)  # a first phase or a view per client
    if problem is not None:
        raise ConfigError(problem)
    sizes = tuple(int(size) for size in tensor_sizes)
    num_parameters = sum(sizes)
    model_bits = BITS_PER_ENTRY * num_parameters
    compress_model(torch.zeros(num_parameters), sizes, ratio)  # validates ratio and sizes before any work

    def server_init(initial_params: torch.Tensor) -> CompressedServerState:
        return CompressedServerState(
            algorithm.server_init(initial_params), torch.zeros_like(initial_params), model_bits
        )

    def client_state_init(initial_params: torch.Tensor) -> CompressedClientState:
        inner = algorithm.client_state_init(initial_params) if algorithm.client_state_init is not None else None
        return CompressedClientState(inner, torch.zeros_like(initial_params))

    def client_objective(view: CompressedClientView, client: CompressedClientState, context: ClientContext):
        return algorithm.client_objective(view.inner, client.inner, context)

    def client_finish(
        view: CompressedClientView, client: CompressedClientState, context: ClientContext, update: ClientUpdate
    ):
        delta = client.residual + (update.final_params - update.start_params)
        sent, bits = compress_model(delta, sizes, ratio)
        received = dataclasses.replace(
            update, final_params=update.start_params + sent, local_params=update.trained_params
        )
        inner_state, message = algorithm.client_finish(view.inner, client.inner, context, received)
        if message is None:
            return CompressedClientState(inner_state, client.residual), None
        wire_bits = payload_bits(message) - model_bits + bits
        return CompressedClientState(inner_state, delta - sent), compressed_message(
            message, wire_bits, sent, sizes, update.start_params, received.final_params
        )

    inner_fold = algorithm.fold()

    def aggregation_start(server: CompressedServerState, context: RoundContext) -> Any:
        return inner_fold.start(server.inner, context)

    def aggregation_add(accumulator: Any, message: CompressedPayload) -> Any:
        return inner_fold.add(accumulator, message.payload)

    def aggregation_finish(server: CompressedServerState, accumulator: Any, context: RoundContext):
        inner, metrics = inner_fold.finish(server.inner, accumulator, context)
        delta = server.residual + (inner.params - server.inner.params)
        sent, bits = compress_model(delta, sizes, ratio)
        inner = dataclasses.replace(inner, params=server.inner.params + sent)
        return CompressedServerState(inner, delta - sent, bits), metrics

    def broadcast(server: CompressedServerState) -> CompressedClientView:
        inner = algorithm.broadcast(server.inner)
        return CompressedClientView(inner, payload_bits(inner) - model_bits + server.broadcast_bits)

    def membership_hook(hook):
        if hook is None:
            return None
        return lambda server, client: dataclasses.replace(
            server, inner=hook(server.inner, client.inner if client is not None else None)
        )

    joined, left = membership_hook(algorithm.client_joined), membership_hook(algorithm.client_left)
    fold = ServerFold(aggregation_start, aggregation_add, aggregation_finish, finishes_empty=inner_fold.finishes_empty)
    _, upload_bits = compress_model(torch.zeros(num_parameters), sizes, ratio)  # ST's bits depend on the sizes only
    codec = compressed_codec(upload_bits - model_bits)
    release = compressed_release(algorithm.release) if algorithm.release is not None else None
    # Every field not named here (the name, the plugin, the release refusal, fields added later) is the wrapped one's.
    return dataclasses.replace(
        algorithm,
        server_init=server_init,
        client_objective=client_objective,
        client_finish=client_finish,
        server_update=fold.server_update,
        broadcast=broadcast,
        client_state_init=client_state_init,
        client_joined=joined,
        client_left=left,
        server_fold=fold,
        codec=codec,
        release=release,
        asynchronous=False,
        lacks=with_lack(
            algorithm.lacks, ASYNCHRONOUS_RULE, asynchronous_reason(algorithm)
        ),  # the wrapped release lack kept
        personalization=compressed_personalization(algorithm),
    )


def compressed_personalization(algorithm: Algorithm) -> Personalization | None:
    """The wrapped algorithm's personal models, read through the compressed view and client state."""
    inner = algorithm.personalization
    if inner is None:
        return None
    return Personalization(lambda view, client: inner.model(view.inner, client.inner), inner.description)


def compressed_release(form: ReleaseForm) -> ReleaseForm:
    """The ``ReleaseForm`` of a compressed algorithm whose wrapped algorithm has ``form`` (module docstring).

    ``release``: what the payload reveals, ``form.release(view.inner, m.payload)``.
    ``restore(view, None, v)``: a carrier, the wrapped form's carrier in a ``CompressedPayload`` of 0 bits (the
    server folds it itself; it is never sent).  ``restore(view, m, v)``: the payload restored and sent dense (its
    model field is no longer ternary: local noise), at the bits of its dense payload.
    ``scaled(view, m, s)``: for a message that carries ST(Δ_k), the message whose ternary is the same signs and
    positions with each μ times s (same bits), whose model field is rebuilt from it exactly as its receiver
    rebuilds it (``rebuilt(view.params)``), and whose other released fields are scaled by the wrapped form, so a
    clipped message still travels compressed and arrives equal to itself; for a message sent dense, the wrapped
    form's scale of its payload (its bits stay).  A negative factor (never a clip) restores the scaled vector dense.
    """

    def release(view: CompressedClientView, message: CompressedPayload) -> torch.Tensor:
        return form.release(view.inner, message.payload)

    def restore(
        view: CompressedClientView, message: CompressedPayload | None, vector: torch.Tensor
    ) -> CompressedPayload:
        if message is None:
            return CompressedPayload(form.restore(view.inner, None, vector), bits=0)
        payload = form.restore(view.inner, message.payload, vector)
        return CompressedPayload(payload, payload_bits(payload))

    def scaled(view: CompressedClientView, message: CompressedPayload, factor: float) -> CompressedPayload:
        if message.model is None:
            return dataclasses.replace(message, payload=form.scale(view.inner, message.payload, factor))
        if not (math.isfinite(factor) and factor >= 0):
            return restore(view, message, release(view, message) * factor)
        payload = form.scale(view.inner, message.payload, factor)  # the fields other than the model's
        name = dataclasses.fields(payload)[message.model_field].name
        emptied = dataclasses.replace(payload, **{name: None})
        sent = dataclasses.replace(message, payload=emptied, model=message.model.scaled(factor))
        return sent.rebuilt(view.params)  # the model field as the receiver computes it, bit for bit

    def size(view: CompressedClientView) -> int:
        return form.size(view.inner)

    return ReleaseForm(release, restore, scaled, size=None if form.size is None else size)


def compressed_codec(model_bits_saved: int) -> MessageCodec:
    """How a ``CompressedPayload`` travels (``MessageCodec``): as ``wire_form()``, its model field empty, and received as
    ``rebuilt(θ_start)``, its ``bits`` checked against the receiver's own count of what arrived (``client_finish``'s
    formula: the payload's bits plus ``model_bits_saved``, ST(Δ_k)'s bits less the dense model's; a message sent
    whole, its payload's bits), never the sender's."""

    def from_wire(sent: Any, start_params: torch.Tensor) -> CompressedPayload:
        if not isinstance(sent, CompressedPayload):
            arrived = type(sent).__name__
            raise ValueError(f"compressed message does not fit: a {arrived} arrived, a compressed message was expected")
        try:
            message = sent.rebuilt(start_params)
        except ValueError as error:
            raise ValueError(f"compressed message does not fit: {error}") from None
        # a message sent whole (no field of it is θ_k or its change, or it was restored dense) costs its whole payload
        expected = payload_bits(message.payload) + (model_bits_saved if message.model_form != MODEL_SENT_DENSE else 0)
        if type(message.bits) is not int or message.bits != expected:
            raise ValueError(f"the compressed message claims {message.bits!r} bits, what arrived costs {expected}")
        return message

    # bits: checked by from_wire; model: ST(Δ_k) itself, data (the field rebuilt from it is compared and measured)
    return MessageCodec(to_wire=CompressedPayload.wire_form, from_wire=from_wire, unplanned=("bits", "model"))


def compressed_message(
    message: Any, bits: int, sent: torch.Tensor, sizes: tuple[int, ...], start: torch.Tensor, final: torch.Tensor
) -> CompressedPayload:
    """``message`` and, when one of its fields is θ_k (``final``) or its change, that field's compressed form
    ST(Δ_k) (``sent``) at ``bits``; otherwise ``message`` alone, sent whole at its own ``payload_bits``.

    The field is found by what it holds, not by the algorithm's name: the
    first top-level field that *is* ``final``, else the first equal to
    ``final`` or to ``final − start`` (computed here as the server will).
    """
    fields = dataclasses.fields(message) if dataclasses.is_dataclass(message) else ()
    values = [getattr(message, field.name) for field in fields]
    found = next(((index, MODEL_IS_FINAL) for index, value in enumerate(values) if value is final), None)
    if found is None:
        change = final - start
        for index, value in enumerate(values):
            if isinstance(value, torch.Tensor) and value.shape == final.shape and value.dtype == final.dtype:
                if torch.equal(value, final):
                    found = (index, MODEL_IS_FINAL)
                    break
                if torch.equal(value, change):
                    found = (index, MODEL_IS_CHANGE)
                    break
    if found is None:
        return CompressedPayload(message, payload_bits(message))  # sent whole: nothing of it travels compressed
    index, form = found
    return CompressedPayload(message, bits, TernaryVector.from_dense(sent, sizes), index, form)
