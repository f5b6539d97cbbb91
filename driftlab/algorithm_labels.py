"""How reports and sweeps name the built-in algorithms, in the papers' order, in a module that imports nothing.

The registry's entries for the built-ins (``driftlab.algorithms``) take their labels
from this table, and ``driftlab report`` reads it to label runs without importing the
algorithms (and with them torch). A plugin's label is in its own registry entry.
"""

BUILT_IN_LABELS: dict[str, str] = {
    "fedavg": "FedAvg",
    "fedprox": "FedProx",
    "scaffold": "SCAFFOLD",
    "feddyn": "FedDyn",
    "adabest": "AdaBest",
    "efl": "EFL",
    "fednova": "FedNova",
    "fedgate": "FedGATE",
    "vrlsgd": "VRL-SGD",
    "mimelite": "MimeLite",
    "mime": "Mime",
    "apfl": "APFL",
    "ditto": "Ditto",
    "fedamp": "FedAMP",
}
