"""Capabilities, not prose: what an algorithm provides, what a driver or feature needs, and the one refusal.

An algorithm provides capabilities (``driftlab.simulation.seam.Algorithm.capabilities``, derived from its fields):
a release form, an asynchronous rule, one phase per round, one shared view, no membership hooks.  Where it lacks one
for a reason of its own (FedNova's τ_eff, SCAFFOLD's c), it attaches that reason to the missing capability
(``Lack``) instead of writing prose elsewhere.  A driver or a feature declares what it needs of an algorithm (with a
generic reason used when the algorithm gives none) and which other features it excludes (``Requirements``).

``conflicts`` computes every refusal from these sets, and ``refusal`` is the one message template::

    {first} with {second}: {why}: {fix}

naming both keys (``[privacy]`` and ``algorithm.name = "mime"``, ``[system]`` and ``a deployment``) and the fix.
This module imports nothing from driftlab, so the seam, the algorithms and every driver can read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Mapping

# What an algorithm provides (Algorithm.capabilities): each is a fact its fields state.
RELEASE_FORM = "release form"  # Algorithm.release: a message's released vector ([privacy] clips and noises it)
ASYNCHRONOUS_RULE = "asynchronous rule"  # Algorithm.asynchronous with a form: FedBuff's staleness rule applies
ONE_PHASE = "one phase"  # Algorithm.prelude is None: one download, training and one upload per client and round
SHARED_VIEW = "shared view"  # Algorithm.client_view is None: every selected client receives broadcast(server)
NO_MEMBERSHIP_HOOKS = "no membership hooks"  # client_joined and client_left are None
PERSONAL_MODELS = "personal models"  # Algorithm.personalization: each client's own model

CAPABILITIES = (RELEASE_FORM, ASYNCHRONOUS_RULE, ONE_PHASE, SHARED_VIEW, NO_MEMBERSHIP_HOOKS, PERSONAL_MODELS)


@dataclass(frozen=True)
class Reason:
    """Why a pair cannot run together, and what to change: ``why`` then ``fix``, joined by ``joint``.

    ``text`` is the two as one clause (``why`` alone when there is no fix).  ``{features}`` and ``{s}`` in either
    are filled by ``refusal`` with the refused feature keys ("[system] and [asynchronous]") and a verb's "s" for one.
    """

    why: str
    fix: str = ""
    joint: str = ": "

    @property
    def text(self) -> str:
        return f"{self.why}{self.joint}{self.fix}" if self.fix else self.why

    def then(self, other: Reason | None) -> Reason:
        """This reason, then ``other``'s (a wrapper's refusal, then its inner algorithm's); this one alone when
        ``other`` is None (the inner algorithm gives no reason)."""
        return self if other is None else Reason(self.why, f"{self.fix}; and {other.text}", self.joint)


UNIFORM_FEDAVG = 'use fedavg or fedprox with aggregation = "uniform"'  # the usual alternative under FedBuff


def synchronous_only(name: str, why: str, alternative: str = UNIFORM_FEDAVG) -> Reason:
    """Why FedBuff cannot run algorithm ``name``, which has no asynchronous rule: ``why``, and the fix of running
    ``name`` synchronously or else ``alternative`` ("" for none)."""
    fix = f"run {name} synchronously (remove [asynchronous])"
    return Reason(why, f"{fix}, or {alternative}" if alternative else fix)


@dataclass(frozen=True)
class Lack:
    """An algorithm's declaration that it does not provide ``capability``, with its own reason and fix."""

    capability: str
    reason: Reason

    def __post_init__(self) -> None:
        if self.capability not in CAPABILITIES:
            raise ValueError(f"unknown capability {self.capability!r}; one of {', '.join(CAPABILITIES)}")


@dataclass(frozen=True)
class Requirements:
    """What a driver or a feature (``key``: "[asynchronous]", "a deployment") needs and excludes.

    ``needs``: capability (of an algorithm) or feature key (of a run) -> the reason when it is missing;
    ``excludes``: feature key -> the reason when it is present.  Both in the order refusals are reported.
    """

    key: str
    needs: tuple[tuple[str, Reason], ...] = ()
    excludes: tuple[tuple[str, Reason], ...] = field(default=())


@dataclass(frozen=True)
class Conflict:
    """One refused pair: ``first`` (a feature or driver) with ``second`` (an algorithm, a feature, a driver)."""

    first: str
    second: str
    reason: Reason

    @property
    def message(self) -> str:
        return refusal(self.first, self.second, self.reason)


def refusal(first: str, second: str, reason: Reason) -> str:
    """The one refusal message: both keys, why, and the fix."""
    plural = " and " in first
    text = reason.text.replace("{features}", first).replace("{s}", "" if plural else "s")
    return f"{first} with {second}: {text}"


def conflicts(
    requirements: Requirements,
    second: str,
    present: AbstractSet[str],
    lacks: Mapping[str, Reason] | None = None,
) -> list[Conflict]:
    """Every refusal of ``requirements`` against ``second``, which provides ``present`` (capabilities, feature keys).

    A need missing from ``present`` is refused as ``requirements.key`` with ``second``, with ``second``'s own reason
    from ``lacks`` when it gives one (an algorithm's ``Lack``; these come first), else the need's.  An exclusion found
    in ``present`` is refused as that feature with ``requirements.key``; exclusions sharing a reason are one refusal
    naming them all ("[system] and [asynchronous] with a deployment").
    """
    lacks = lacks or {}
    missing = [(need, reason) for need, reason in requirements.needs if need not in present]
    # the second's own reasons first: they name its own fix (Mime's control variate), the generic ones a kind's
    missing.sort(key=lambda pair: pair[0] not in lacks)
    found = [Conflict(requirements.key, second, lacks.get(need, reason)) for need, reason in missing]
    excluded: dict[Reason, list[str]] = {}
    for key, reason in requirements.excludes:
        if key in present:
            excluded.setdefault(reason, []).append(key)
    found += [Conflict(" and ".join(keys), requirements.key, reason) for reason, keys in excluded.items()]
    return found


def first_refusal(
    requirements: Requirements, second: str, present: AbstractSet[str], lacks: Mapping[str, Reason] | None = None
) -> str | None:
    """The message of the first of ``conflicts``, or None when the pair runs."""
    found = conflicts(requirements, second, present, lacks)
    return found[0].message if found else None


def algorithm_key(name: str) -> str:
    """How a refusal names an algorithm: its config key."""
    return f'algorithm.name = "{name}"'


def lacking(capability: str, reason: Reason | None) -> tuple[Lack, ...]:
    """``(Lack(capability, reason),)``, or ``()`` when there is no reason (the capability is provided)."""
    return () if reason is None else (Lack(capability, reason),)


def with_lack(lacks: tuple[Lack, ...], capability: str, reason: Reason) -> tuple[Lack, ...]:
    """``lacks`` with ``capability``'s reason set to ``reason`` (a wrapper's own, over what it wraps); others kept."""
    return (*(lack for lack in lacks if lack.capability != capability), Lack(capability, reason))
