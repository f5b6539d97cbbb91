"""Running driftlab's algorithms on Flower (optional extra ``driftlab[flower]``).

``apps`` is the only module that imports ``flwr`` (importing it without Flower
raises an error saying how to install the ``flower`` extra, ``driftlab.extras.install_hint``): ``server_app`` and
``client_app`` build a Flower ServerApp and ClientApp from a driftlab config,
around the transport-agnostic deployment of ``driftlab.deploy``.  ``project``
(``driftlab flower new`` and ``check``) imports without ``flwr``.
"""
