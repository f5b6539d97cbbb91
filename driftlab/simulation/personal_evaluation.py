"""The personal evaluation (``evaluation.personal``, ``evaluation.finetune_steps``) as a feature entry.

Each client's own model (the algorithm's ``Personalization``, or the server model fine-tuned for
``finetune_steps`` on the client's data) is tested on that client's own test split beside the server model
(``driftlab.simulation.evaluation``).  Its keys live in ``[evaluation]``; the entry decides, once the simulation
is built, whether rounds evaluate personal models, and refuses a request that cannot be met before any round.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from driftlab.errors import ConfigError
from driftlab.features.capabilities import Requirements
from driftlab.features.entry import FeatureEntry, RunFacts


@dataclass(frozen=True)
class PersonalRequest:
    """What the config asks: ``evaluation.personal`` (None: when the algorithm has personal models) and
    ``evaluation.finetune_steps`` (0: none)."""

    personal: bool | None
    finetune_steps: int


def plan(evaluation: Any, facts: RunFacts) -> PersonalRequest:  # noqa: ARG001 - the request is the section's own
    return PersonalRequest(evaluation.personal, evaluation.finetune_steps or 0)


def personal_evaluation(request: PersonalRequest, sim: Any) -> bool:
    """Whether rounds evaluate each client's own model; ConfigError, before any round, for a request that cannot be
    met: no personal models and no fine-tuning, fine-tuning beside an algorithm's own personal models, no client test
    splits, an asynchronous run."""
    name = sim.algorithm.name
    own = sim.algorithm.personalization is not None
    if request.finetune_steps and own:
        raise ConfigError(
            f"evaluation.finetune_steps = {request.finetune_steps} fine-tunes the server model as each client's own "
            "model, "
            f"but algorithm {name!r} keeps its own personalized models ({sim.algorithm.personalization.description}); "
            "remove evaluation.finetune_steps (the personal column then evaluates the algorithm's models)"
        )
    if request.personal is False:
        if request.finetune_steps:
            raise ConfigError(
                "evaluation.finetune_steps is set but evaluation.personal = false turns the personal evaluation off; "
                "remove one"
            )
        return False
    capable = own or bool(request.finetune_steps)
    if request.personal and not capable:
        raise ConfigError(
            f"evaluation.personal = true, but algorithm {name!r} keeps no per-client models (every client predicts "
            "with the server model, which client_test_accuracy_mean already evaluates on each client's split); set "
            "evaluation.finetune_steps = s for FedAvg + local fine-tuning, or use apfl, ditto or fedamp, or remove "
            "evaluation.personal"
        )
    requested = bool(request.personal) or bool(request.finetune_steps)
    if sim.client_test_rows is None:
        if requested:
            raise ConfigError(
                "the personalized evaluation tests each client's own model on that client's own test split, and the "
                "clients have none: set data.client_test_fraction (for example 0.2), or remove evaluation.personal / "
                "evaluation.finetune_steps"
            )
        return False
    if sim.asynchronous is not None:
        if requested:
            raise ConfigError(
                "the personalized evaluation runs after synchronous rounds; an asynchronous run evaluates the server "
                "model only: remove evaluation.personal / evaluation.finetune_steps, or [asynchronous]"
            )
        return False
    return capable


def finish(sim: Any, request: PersonalRequest) -> None:
    """Turn the personal evaluation on in ``sim.evaluation`` when it is requested (or the algorithm's default)."""
    if personal_evaluation(request, sim):
        sim.evaluation = dataclasses.replace(sim.evaluation, personal=True, finetune_steps=request.finetune_steps)


FEATURE = FeatureEntry(
    name="personal",
    plan=plan,
    requirements=Requirements("evaluation.personal"),
    section_of=lambda config: config.evaluation,
    finish=finish,
)
