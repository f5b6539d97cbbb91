"""``FEATURES``: the optional features, one ``FeatureEntry`` each (``driftlab.features.entry``), in wrapping order.

Partial personalization wraps the algorithm first (innermost: the personal coordinates never reach the others),
compression next and privacy after it (what is clipped and noised is what a client sends); simulated time, FedBuff
and the personal evaluation set the simulation's fields and checks; robust aggregation wraps outside those, and the
attack outermost (the attackers forge, then the server aggregates).  A feature of your
own registers itself the same way (``register(FeatureEntry(...))``); assembly iterates the registry.
"""

from __future__ import annotations

from driftlab.attacks.feature import FEATURE as ATTACK
from driftlab.compress.feature import FEATURE as COMPRESSION
from driftlab.features.entry import FeatureEntry
from driftlab.personal.feature import FEATURE as PERSONAL_LAYERS
from driftlab.plugins import Registry
from driftlab.privacy.feature import FEATURE as PRIVACY
from driftlab.robust.feature import FEATURE as ROBUST
from driftlab.simulation.asynchronous.feature import FEATURE as ASYNCHRONOUS
from driftlab.simulation.personal_evaluation import FEATURE as PERSONAL
from driftlab.simulation.time.feature import FEATURE as SYSTEM

REGISTRY: Registry[FeatureEntry] = Registry("feature", "driftlab.features", FeatureEntry, lambda entry: entry.plan)
FEATURES: dict[str, FeatureEntry] = REGISTRY.entries  # in registration order: the order assembly wraps in

for _entry in (
    PERSONAL_LAYERS,
    COMPRESSION,
    PRIVACY,
    SYSTEM,
    ASYNCHRONOUS,
    PERSONAL,
    ROBUST,
    ATTACK,
):  # also the sections' order
    REGISTRY.register(_entry)
REGISTRY.finish_built_ins()

register = REGISTRY.register
