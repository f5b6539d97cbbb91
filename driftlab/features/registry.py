"""``FEATURES``: the optional features, one ``FeatureEntry`` each (``driftlab.features.entry``), in wrapping order.

Compression wraps the algorithm first and privacy second (what is clipped and noised is what a client sends);
simulated time, FedBuff and the personal evaluation set the simulation's fields and checks.  A feature of your
own registers itself the same way (``register(FeatureEntry(...))``); assembly iterates the registry.
"""

from __future__ import annotations

from driftlab.compress.feature import FEATURE as COMPRESSION
from driftlab.features.entry import FeatureEntry
from driftlab.plugins import Registry
from driftlab.privacy.feature import FEATURE as PRIVACY
from driftlab.simulation.asynchronous.feature import FEATURE as ASYNCHRONOUS
from driftlab.simulation.personal_evaluation import FEATURE as PERSONAL
from driftlab.simulation.time.feature import FEATURE as SYSTEM

REGISTRY: Registry[FeatureEntry] = Registry("feature", "driftlab.features", FeatureEntry, lambda entry: entry.plan)
FEATURES: dict[str, FeatureEntry] = REGISTRY.entries  # in registration order: the order assembly wraps in

for _entry in (COMPRESSION, PRIVACY, SYSTEM, ASYNCHRONOUS, PERSONAL):  # also the order of the config's sections
    REGISTRY.register(_entry)
REGISTRY.finish_built_ins()

register = REGISTRY.register
