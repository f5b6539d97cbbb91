"""Optional features as data: what algorithms provide and drivers need (``capabilities``), one refusal template
(``capabilities.refusal``), and each feature as a registry entry (``entry``, ``registry``).

This package imports nothing from ``driftlab.experiments``: the experiments read it, never the other way round.
The package itself imports nothing, so the seam can read ``capabilities`` without loading the feature entries.
"""
