"""Running driftlab's algorithms on Flower (optional extra ``driftlab[flower]``).

``apps`` is the only module that imports ``flwr`` (importing it without Flower
raises an error saying ``pip install "driftlab[flower]"``): ``server_app`` and
``client_app`` build a Flower ServerApp and ClientApp from a driftlab config.
The rest imports without ``flwr``: ``wire`` (the pickle-free message format
with validation), ``node_state`` (a client's state on the node's disk),
``deployment`` (the server and node halves of a deployment over any byte
transport) and ``project`` (``driftlab flower new`` and ``check``).
"""
