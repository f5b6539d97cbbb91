"""Configs, runs, sweeps and reports, a folder each (``config``, ``run``, ``sweep``, ``report``, ``reproduce``).
Importing this package imports none of its modules, so
``driftlab.experiments.report`` (and ``driftlab report``) reads run directories without torch."""
