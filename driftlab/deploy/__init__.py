"""A driftlab run deployed over any transport that moves bytes; nothing here imports Flower.

``server`` (``DeploymentServer``, ``run_in_process``; its docstring describes the
protocol), ``node`` (``DeploymentClient``), ``messages`` (what the two say to each
other, the ``Transport`` they say it over, and what both derive from the config),
``wire`` (the pickle-free message format with validation) and ``node_state`` (a
client's state on the node's disk).  ``driftlab.flower`` adapts them to Flower.
"""
