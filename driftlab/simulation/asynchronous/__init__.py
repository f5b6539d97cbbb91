"""Asynchronous buffered aggregation (FedBuff: Nguyen et al., "Federated Learning with Buffered Asynchronous
Aggregation", AISTATS 2022) on the simulated clock, replayable bit for bit.

``engine.run_update`` is one server update (the driver's "round"), ``state`` the clients in flight between two
updates (``SimulationState.in_flight``), ``events`` which idle client a dispatch picks and when it arrives,
``checkpointing`` the in-flight state as checkpoint tensors.
"""
