"""Asynchronous buffered aggregation (FedBuff: Nguyen et al., "Federated Learning with Buffered Asynchronous
Aggregation", AISTATS 2022) on the simulated clock, replayable bit for bit."""
