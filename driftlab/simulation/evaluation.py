"""Evaluation of a server model and the divergence tests (``driftlab.simulation.round.engine`` calls them after a round).

``evaluate``: train and test loss and accuracy of the evaluated model (``EvaluationPlan.model``); per-client test
accuracy; recall@5 for multi-label data; distance to the known minimiser of quadratic data.  ``dissimilarity``:
the (G, B)-dissimilarity B(θ)² and the gradient variance of FedProx's Definition 3 (Li et al. 2020).

Modes: every forward here goes through ``FlatModel.forward``/``batch_loss``, which run the module in evaluation mode
(no dropout; BatchNorm with its running statistics): the test, train-loss and validation passes, client and personal
models, and the dissimilarity, a measurement of the objective at θ.  Fine-tuning's own local steps
(``evaluation.finetune_steps``) train in training mode, as every local step does (``backends/modes.py``).

Divergence: a record with a non-finite number, an evaluated loss above ``EvaluationPlan.divergence_factor`` times
the initial model's (``reference_losses``), or a server-model norm above ``EvaluationPlan.norm_growth_factor`` times
the model's starting scale (``norm_growth``; the scale is ``setup.norm_scale``) is divergence.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from driftlab.simulation.backends.buffers import load_buffers, module_buffers, own_buffers_record
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import TrainingData
from driftlab.simulation.round.client import ClientData, ClientDataComputation
from driftlab.simulation.round.setup import Simulation
from driftlab.simulation.seam import NO_CORRECTION

DIVERGENCE_ADVICE = "lower client.lr (or server.lr), or set client.clip_norm"


LOSS_KEYS = ("train_loss", "test_loss")  # the evaluated losses the divergence test compares with the initial model's


def divergence(record: dict[str, Any], initial_losses: dict[str, float] | None, factor: float) -> str | None:
    """Why a round's record shows divergence, with what to try; None for a healthy round.

    A round diverged when any number it recorded is non-finite (losses, norms, accuracies,
    the algorithm's metrics), or when ``factor`` > 0 and an evaluated loss exceeds ``factor``
    times the initial model's.  A round-1 blow-up already is such a jump, so the reference
    is the model before round 1, not round 1's.  The test is skipped for a loss whose
    initial value is not positive (an objective such as the quadratic clients' can be negative).
    """
    non_finite = [f"{key}={value}" for key, value in record.items() if not _all_finite(value)]
    if non_finite:
        return f"non-finite values {', '.join(non_finite)}; {DIVERGENCE_ADVICE}"
    if not factor or not initial_losses:
        return None
    for key in LOSS_KEYS:
        initial, value = initial_losses.get(key), record.get(key)
        if value is not None and initial is not None and initial > 0 and value > factor * initial:
            return (
                f"{key} is {value:.4g}, {value / initial:.3g} times the initial model's {initial:.4g} "
                f"(more than evaluation.divergence_factor={factor:g}); {DIVERGENCE_ADVICE}, "
                "or raise evaluation.divergence_factor (0 = off) if such a loss is expected"
            )
    return None


def norm_growth(model_norm: float, scale: float, factor: float) -> str | None:
    """Why a round's server model norm shows divergence, with what to try; None for a healthy round (or ``factor`` 0).

    The norm is recorded every round, so this test runs in rounds without evaluation too.  It compares
    with the starting scale rather than with the previous round's norm: a diverging run may grow its
    norm tenfold a round and never a thousandfold in one (MNIST with η_l = 3: 12.6, 127, 1463, 30094),
    which a round-to-round test misses, while a healthy run's norm stays within a small multiple of
    its starting scale.
    """
    if not factor or not math.isfinite(model_norm) or model_norm <= factor * scale:
        return None
    return (
        f"model_norm is {model_norm:.4g}, {model_norm / scale:.3g} times the model's starting scale {scale:.4g} "
        f"(the larger of the initial model's norm and √(number of parameters)), more than evaluation.norm_growth_factor={factor:g}; "
        f"{DIVERGENCE_ADVICE}, or raise evaluation.norm_growth_factor (0 = off) if so large a model is expected"
    )


def round_divergence(sim: Simulation, record: dict[str, Any]) -> str | None:
    """Why the round whose record is ``record`` diverged (``divergence``, else ``norm_growth``), with what to try;
    None for a healthy round."""
    problem = divergence(record, sim.initial_losses, sim.evaluation.divergence_factor)
    if problem is None:
        problem = norm_growth(record["model_norm"], sim.norm_scale, sim.evaluation.norm_growth_factor)
    return problem


def _all_finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_all_finite(item) for item in value)
    if isinstance(value, dict):
        return all(_all_finite(item) for item in value.values())
    return True


def reference_losses(sim: Simulation) -> dict[str, float]:
    """The initial model's evaluated losses, the divergence test's reference; computed once per simulation.

    Evaluation draws no random numbers, so computing them changes no result.
    """
    if sim.initial_losses is None:
        rows = _global_test_rows(sim)
        with torch.no_grad():
            sim.initial_losses, correct = _mean_losses(sim, sim.initial_params, rows)
        if sim.model.is_classifier:
            sim.initial_accuracy = correct / len(rows)
    return sim.initial_losses


def prepare_reference(sim: Simulation, evaluate_after: bool) -> None:
    """The initial model's losses (``reference_losses``) ahead of a round whose evaluation (``evaluate_after``) the
    loss test compares with them (``evaluation.divergence_factor``); nothing for any other round."""
    if evaluate_after and sim.evaluation.divergence_factor:
        reference_losses(sim)


def _global_test_rows(sim: Simulation) -> torch.Tensor:
    return torch.arange(sim.data.global_test_size or len(sim.test_data.targets), device=sim.device)


def _mean_losses(
    sim: Simulation, params: torch.Tensor, test_rows: torch.Tensor, test_hits: torch.Tensor | None = None
) -> tuple[dict[str, float], int]:
    """Mean test loss over ``test_rows`` and mean train loss over the sampled clients' data, and the correct test predictions
    (per row into ``test_hits`` when given)."""
    batch = sim.evaluation.batch_size
    test_loss, test_correct = _loss_and_correct(sim.model, params, sim.test_data, test_rows, batch, test_hits)
    train_loss, _ = _loss_and_correct(sim.model, params, sim.training_data, sim.train_loss_rows, batch)
    return {"test_loss": test_loss / len(test_rows), "train_loss": train_loss / len(sim.train_loss_rows)}, test_correct


# What `evaluate` may add to a round's record; a resumed run whose evaluation schedule changed drops them
# from rounds the new schedule does not evaluate, so its metrics match a run made in one go.
EVALUATION_KEYS = (
    "test_loss",
    "train_loss",
    "test_accuracy",
    "client_test_accuracy_mean",
    "client_test_accuracy_std",
    "personal_test_accuracy_mean",
    "personal_test_accuracy_std",
    "test_recall_at_5",
    "distance_to_minimizer",
    "validation_loss",
    "validation_accuracy",
)


@torch.no_grad()
def evaluate(sim: Simulation, params: torch.Tensor) -> dict[str, float]:
    """Test accuracy and loss on the global test set; train loss over the data of ``evaluation.train_loss_clients``
    clients (a sample fixed by the seed; every client's when 0 or at least the number of clients).

    With per-client test splits, also the mean of the clients' local test
    accuracies (EFL's per-client accuracy).  For objectives with a known
    minimiser, the distance to it.
    """
    batch = sim.evaluation.batch_size
    test = sim.test_data
    test_rows = _global_test_rows(sim)
    per_client = sim.model.is_classifier and sim.client_test_rows is not None
    test_hits = torch.zeros(len(test_rows), dtype=torch.int64) if per_client else None
    metrics, test_correct = _mean_losses(sim, params, test_rows, test_hits)
    if sim.model.is_classifier:
        metrics["test_accuracy"] = test_correct / len(test_rows)
        if per_client:
            accuracies = _client_test_accuracies(sim, params, test_hits)
            if len(accuracies):
                metrics["client_test_accuracy_mean"] = float(np.mean(accuracies))
                if sim.evaluation.personal or sim.evaluation.client_spread:
                    metrics["client_test_accuracy_std"] = float(np.std(accuracies))
    if sim.validation_rows is not None and len(sim.validation_rows):
        # The clients' held-out training rows (data.validation_fraction): what tuned axes pick on, never the test set.
        loss, correct = _loss_and_correct(sim.model, params, sim.training_data, sim.validation_rows, batch)
        metrics["validation_loss"] = loss / len(sim.validation_rows)
        if sim.model.is_classifier:
            metrics["validation_accuracy"] = correct / len(sim.validation_rows)
    if sim.model.multi_label:
        metrics["test_recall_at_5"] = _recall_at_k(sim.model, params, test, test_rows, batch, k=5)
    if sim.data.known_minimizer is not None:
        minimizer = torch.as_tensor(sim.data.known_minimizer, dtype=params.dtype, device=params.device)
        metrics["distance_to_minimizer"] = float(torch.linalg.vector_norm(params - minimizer))
    return metrics


def personal_columns(sim: Simulation, server: Any, clients: Any, settings: Any, round_index: int) -> dict[str, float]:
    """The personalized evaluation's columns of an evaluated round (``evaluate_personal``); {} when it is off
    (``evaluation.personal``), the clients have no test splits, or ``clients`` is None (a deployment: the nodes hold
    the personal models)."""
    if not sim.evaluation.personal or sim.client_test_rows is None or clients is None:
        return {}
    return evaluate_personal(sim, server, clients, settings, round_index)


def evaluate_personal(sim: Simulation, server: Any, clients: Any, settings: Any, round_index: int) -> dict[str, float]:
    """Each client's own model on its own test split: ``personal_test_accuracy_mean`` and ``_std`` over the clients
    with a test split (EFL's "mean testing accuracy on all participants"; its best over rounds is BMTA).

    A client's own model is ``Personalization.model(view_k, state_k)`` (``seam.Personalization``), its state read
    from ``clients`` (this round's staged states included; ``client_state_init(θ⁰)`` for a client that has not
    trained), or, with ``evaluation.finetune_steps = s``, the server model fine-tuned for ``s`` local steps on the
    client's own data with the round's settings (``settings``, a ``ClientSettings``), its minibatches drawn from
    (seed, round, client id).  One client at a time, states streamed from the store in client-id order, so memory
    stays one model per client being evaluated, whatever the number of clients.
    """
    local = own_buffers_record(sim)
    if local is None:
        return _personal_accuracies(sim, server, clients, settings, round_index, None)
    server_buffers = module_buffers(sim.model.module)
    try:
        return _personal_accuracies(sim, server, clients, settings, round_index, local)
    finally:
        load_buffers(sim.model.module, server_buffers)  # the server's buffers back in the shared module


def _personal_accuracies(
    sim: Simulation, server: Any, clients: Any, settings: Any, round_index: int, local: Any
) -> dict[str, float]:
    """``evaluate_personal``'s columns; ``local`` (``personal.buffers.ClientBuffers`` or None) loads each client's
    own buffers into the shared module before its model is evaluated (FedBN: its BatchNorm statistics)."""
    algorithm = sim.algorithm
    shared = algorithm.broadcast(server)
    initial = algorithm.client_state_init
    stored = iter(clients.items(include_staged=True)) if clients is not None else iter(())
    pending = next(stored, None)
    accuracies = []
    for client_id, rows in enumerate(sim.client_test_rows):
        state = None
        if pending is not None and pending[0] == client_id:
            state, pending = pending[1], next(stored, None)
        if not len(rows):
            continue
        view = algorithm.view_for(server, client_id, shared, lambda: clients.items(include_staged=True))
        if sim.evaluation.finetune_steps:
            data = ClientData(sim.model, sim.training_data, sim.client_rows[client_id])
            computation = ClientDataComputation(data, settings.seed, round_index, client_id, settings)
            params, _ = computation.train(view.params, NO_CORRECTION, sim.evaluation.finetune_steps, "finetune")
        else:
            if state is None and initial is not None:
                state = initial(sim.initial_params)
            params = algorithm.personalization.model(view, state)
        if local is not None:
            load_buffers(sim.model.module, local.start_of(client_id))
        with torch.no_grad():
            _, correct = _loss_and_correct(sim.model, params, sim.test_data, rows, sim.evaluation.batch_size)
        accuracies.append(correct / len(rows))
    if not accuracies:
        return {}
    return {
        "personal_test_accuracy_mean": float(np.mean(accuracies)),
        "personal_test_accuracy_std": float(np.std(accuracies)),
    }


def _client_test_accuracies(
    sim: Simulation, params: torch.Tensor, global_hits: torch.Tensor | None = None
) -> list[float]:
    """Each client's accuracy on its own test rows (clients without any left out), in client order.

    One pass over all clients' test rows in evaluation batches, then a count per client: a forward
    pass per client would cost 100,000 small passes with 100,000 clients.  ``global_hits``, the
    correct predictions of the global test rows ``0..G-1``, are reused when every client's test
    rows lie among them (client test splits usually make up the global test set).
    """
    lengths = [len(rows) for rows in sim.client_test_rows]
    rows = sim.client_test_union
    if global_hits is not None and (len(rows) == 0 or int(rows.max()) < len(global_hits)):
        hits = global_hits[rows.cpu()]
    else:
        hits = torch.zeros(len(rows), dtype=torch.int64)
        _loss_and_correct(sim.model, params, sim.test_data, rows, sim.evaluation.batch_size, hits)
    owner = np.repeat(np.arange(len(lengths)), lengths)  # the client of each row
    correct = np.bincount(owner, weights=hits.numpy(), minlength=len(lengths))
    return [int(correct[k]) / n for k, n in enumerate(lengths) if n]


def _recall_at_k(
    model: FlatModel, params: torch.Tensor, data: TrainingData, rows: torch.Tensor, batch_size: int, k: int
) -> float:
    """Micro recall of the top-k labels: true labels among each example's k highest logits / all true labels
    (TFF's StackOverflow tag-prediction metric, ``Recall(top_k=5)``)."""
    hits, positives = 0.0, 0.0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        outputs = model.forward(params, data.batch(chunk))
        targets = data.targets[chunk]
        top = outputs.topk(min(k, outputs.shape[1]), dim=1).indices
        hits += float(targets.gather(1, top).sum())
        positives += float(targets.sum())
    return hits / positives if positives > 0 else 0.0


def _loss_and_correct(
    model: FlatModel,
    params: torch.Tensor,
    data: TrainingData,
    rows: torch.Tensor,
    batch_size: int,
    hits: torch.Tensor | None = None,
) -> tuple[float, int]:
    """Summed loss and correct predictions over ``rows``; with ``hits`` (int64, one per row) also which rows were correct."""
    loss_sum, correct = 0.0, 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        outputs = model.forward(params, data.batch(chunk))
        loss_sum += float(model.example_loss(outputs, data.targets[chunk]).sum())
        if model.is_classifier:
            right = outputs.argmax(dim=1) == data.targets[chunk]
            correct += int(right.sum())
            if hits is not None:
                hits[start : start + len(chunk)] = right.cpu()
    return loss_sum, correct


def dissimilarity_columns(
    sim: Simulation, params: torch.Tensor, registered: np.ndarray, round_index: int
) -> dict[str, float | None]:
    """``dissimilarity``'s columns in the rounds ``evaluation.dissimilarity_every`` names; {} in the others (and
    always when it is 0)."""
    every = sim.evaluation.dissimilarity_every
    if not every or round_index % every:
        return {}
    return dissimilarity(sim, params, registered)


def dissimilarity(
    sim: Simulation, params: torch.Tensor, registered: np.ndarray | None = None
) -> dict[str, float | None]:
    """FedProx Definition 2 at the server model, over all registered clients with ``p_k = n_k / n``:

        B(θ)² = E_k ‖∇F_k(θ)‖² / ‖∇f(θ)‖²,    variance = E_k ‖∇F_k(θ) − ∇f(θ)‖²,    ∇f = E_k ∇F_k.

    B(θ)² is None (null in metrics.jsonl) where ∇f(θ) = 0 and the ratio is undefined.
    """
    if registered is None:
        registered = sim.registered_at(1)
    loss_gradient = torch.func.grad(sim.model.batch_loss)
    weights = sim.client_sizes[registered] / sim.client_sizes[registered].sum()
    # One pass, no [N, P] table: E‖g_k − ḡ‖² = E‖g_k‖² − ‖ḡ‖² (clamped at 0 against rounding).
    global_gradient = torch.zeros_like(params)
    mean_squared_norm = 0.0
    for client_id, weight in zip(registered.tolist(), weights.tolist(), strict=True):
        rows = sim.client_rows[client_id]
        gradient = torch.zeros_like(params)
        for start in range(0, len(rows), sim.evaluation.batch_size):
            part = rows[start : start + sim.evaluation.batch_size]
            gradient += loss_gradient(params, sim.training_data.batch(part), sim.training_data.targets[part]) * (
                len(part) / len(rows)
            )
        global_gradient += weight * gradient
        mean_squared_norm += weight * float((gradient**2).sum())
    global_norm_squared = float((global_gradient**2).sum())
    return {
        "dissimilarity_b2": mean_squared_norm / global_norm_squared if global_norm_squared > 0 else None,
        "gradient_variance": max(0.0, mean_squared_norm - global_norm_squared),
    }
