"""Sweep presets: the papers' headline experiments (``driftlab presets``; ``driftlab sweep NAME --out DIR``)."""
