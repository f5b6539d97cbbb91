"""What each driver and each algorithm-facing feature needs of an algorithm, as data (``capabilities.Requirements``).

A need's reason is the generic one, used when the algorithm attaches none of its own to the missing capability
(``seam.Algorithm.lacks``).  ``capabilities.conflicts`` turns these and an algorithm's capabilities into refusals.
The synchronous simulator needs nothing: every algorithm runs there.
"""

from __future__ import annotations

from typing import Any

from driftlab.features.capabilities import (
    ASYNCHRONOUS_RULE,
    NO_MEMBERSHIP_HOOKS,
    ONE_PHASE,
    RELEASE_FORM,
    SHARED_VIEW,
    Reason,
    Requirements,
)

SIMULATOR = Requirements("driftlab run")

# FedBuff (driftlab.simulation.asynchronous): clients start whenever one is idle, from the one shared model, and their
# stale changes are moved onto the current model through the release form (Nguyen et al. 2022).
ASYNCHRONOUS = Requirements(
    "[asynchronous]",
    needs=(
        (
            ONE_PHASE,
            Reason(
                "it computes a statistic of the round's clients before they train (Algorithm.prelude), and FedBuff's "
                "clients start whenever one is idle",
                "run it synchronously (remove [asynchronous])",
                "; ",
            ),
        ),
        (
            SHARED_VIEW,
            Reason(
                "it sends each client a view of its own (Algorithm.client_view), and FedBuff's staleness rule moves "
                "one shared model's changes",
                "run it synchronously (remove [asynchronous])",
                "; ",
            ),
        ),
        (
            ASYNCHRONOUS_RULE,
            Reason(
                "it declares no asynchronous rule (Algorithm.asynchronous)",
                'run it synchronously (remove [asynchronous]), or use fedavg or fedprox with aggregation = "uniform"',
                "; ",
            ),
        ),
        (
            NO_MEMBERSHIP_HOOKS,
            Reason(
                "it updates its server state as clients join or leave (client_joined, client_left), which the "
                "asynchronous engine does not call",
                "run it synchronously (remove [asynchronous])",
                "; ",
            ),
        ),
    ),
)

# Why an algorithm that declares an asynchronous rule still lacks one: the rule moves changes through the form.
RULE_WITHOUT_FORM = Reason(
    "it declares an asynchronous rule but gives no ReleaseForm, through which a stale client's change is moved onto "
    "the current model",
    "give Algorithm(release=ReleaseForm(...))",
    "; ",
)

# Client-level DP (driftlab.privacy): a form to clip and noise, in the round's one upload, from the one broadcast.
PRIVACY = Requirements(
    "[privacy]",
    needs=(
        (
            ONE_PHASE,
            Reason(
                "it uploads a vector per client before local training (its round's first phase, Algorithm.prelude), "
                "which client-level DP would have to clip and noise too, and does not",
                'remove [privacy], or for Mime set algorithm.control_variate = "previous" (one phase, whose messages '
                "are "
                "clipped and noised)",
                "; ",
            ),
        ),
        (
            RELEASE_FORM,
            Reason(
                "it gives no release form (seam.ReleaseForm: the vector its message reveals), so its sensitivity "
                "cannot be bounded",
                "give Algorithm(release=ReleaseForm(release, restore)) (docs/design.md, Client-level differential "
                "privacy)",
                "; ",
            ),
        ),
        (
            SHARED_VIEW,
            Reason(
                "it sends each client a view of its own (Algorithm.client_view), and client-level DP clips and noises "
                "changes measured from the one broadcast model",
                "remove [privacy], or use an algorithm whose clients all receive the broadcast",
            ),
        ),
    ),
)

# Compression (driftlab.compress): error feedback on the round's one upload and one broadcast model.
COMPRESSION = Requirements(
    "compression.ratio < 1",
    needs=(
        (
            ONE_PHASE,
            Reason(
                "it uploads a vector per client before local training (Algorithm.prelude), which compression would "
                "leave uncompressed",
                'set compression.ratio = 1, or for Mime algorithm.control_variate = "previous" (one phase, compressed '
                "like "
                "MimeLite)",
                "; ",
            ),
        ),
        (
            SHARED_VIEW,
            Reason(
                "it sends each client a view of its own (Algorithm.client_view), and compression's downlink residual "
                "is one per server, for one broadcast model",
                "set compression.ratio = 1",
            ),
        ),
    ),
)

# The simulated clock ([system]) times one download, local training and one upload per client.
SIMULATED_TIME = Requirements(
    "[system]",
    needs=(
        (
            ONE_PHASE,
            Reason(
                "it has a first phase in every round (Algorithm.prelude), which the simulated clock does not time (one "
                "download, training and one upload per client)",
                'remove [system], or for Mime set algorithm.control_variate = "previous" (one phase)',
            ),
        ),
    ),
)

# A deployment (driftlab.deploy, and Flower through it): real time, one request and one reply per client and round,
# client states and test splits on the nodes, only the algorithm's messages on the wire.
DEPLOYMENT_KEY = "a deployment"
DEPLOYMENT = Requirements(
    DEPLOYMENT_KEY,
    needs=(
        (
            ONE_PHASE,
            Reason(
                "it has a first phase in every round (Algorithm.prelude: each client uploads a vector before it "
                "trains), and a deployment exchanges one request and one reply per client and round",
                'run it with driftlab run, or for Mime set algorithm.control_variate = "previous" (one phase)',
            ),
        ),
        (
            SHARED_VIEW,
            Reason(
                "it sends each client a view of its own (Algorithm.client_view: FedAMP's cloud model u_k), and a "
                "deployment's server broadcasts one view per round to every node",
                "run it with driftlab run, or choose an algorithm that broadcasts one model",
            ),
        ),
    ),
    excludes=(
        (
            "[system]",
            Reason(
                "a deployment runs in real time, and {features} simulate{s} time, which only the simulator has",
                "remove {features}, or run the config with driftlab run",
            ),
        ),
        (
            "[asynchronous]",
            Reason(
                "a deployment runs in real time, and {features} simulate{s} time, which only the simulator has",
                "remove {features}, or run the config with driftlab run",
            ),
        ),
        (
            "[attack]",
            Reason(
                "{features} forge{s} the Byzantine clients' messages inside the simulator, and a deployment's messages "
                "come from real nodes",
                "remove {features}, or run the config with driftlab run",
            ),
        ),
        (
            "evaluation.personal",
            Reason(
                "evaluation.personal / evaluation.finetune_steps evaluate each client's own model on its own test "
                "split, and in a deployment those models and splits stay on the nodes",
                "remove them (the server model is still evaluated), or run the config with driftlab run",
                "; ",
            ),
        ),
        *(
            (
                f'evaluation.model = "{model}"',
                Reason(
                    f'evaluation.model = "{model}" evaluates a mean of client models, which a deployment\'s server '
                    "never "
                    "receives (only the algorithm's messages travel)",
                    'set evaluation.model = "server"',
                    "; ",
                ),
            )
            for model in ("reporting_mean", "all_clients_mean")
        ),
    ),
)
# Only when the registered set changes (availability.events, availability.initially_registered).
DEPLOYMENT_MEMBERSHIP = Requirements(
    DEPLOYMENT_KEY,
    needs=(
        (
            NO_MEMBERSHIP_HOOKS,
            Reason(
                "it updates the server state when clients join or leave (availability.events / "
                "availability.initially_registered), from those clients' states; in a deployment the client states "
                "stay on the nodes, so the server cannot do that",
                "remove availability.events and availability.initially_registered, or choose an algorithm without "
                "client_joined/client_left",
            ),
        ),
    ),
)


def present_features(config: Any) -> frozenset[str]:
    """The feature keys a run's config turns on, as the requirements above name them: its optional sections, the
    personal evaluation, and an evaluation of a mean of client models (``config`` is an ``ExperimentConfig``)."""
    present = {key for key in ("privacy", "system", "asynchronous") if getattr(config, key, None) is not None}
    keys = {f"[{key}]" for key in present}
    evaluation = config.evaluation
    if evaluation.personal or evaluation.finetune_steps:
        keys.add("evaluation.personal")
    if evaluation.model != "server":
        keys.add(f'evaluation.model = "{evaluation.model}"')
    return frozenset(keys)
