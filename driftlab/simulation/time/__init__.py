"""Simulated time: each client's device (speed, bandwidths, availability windows) and the virtual clock of a run.

``plan`` holds the types the engine reads (``DeviceProfile``, ``SystemPlan``, ``AsynchronousPlan``), ``profiles``
where profiles come from (drawn from (seed, client id), or a CSV trace), ``clock`` the pure arithmetic of a client's
download, work and upload (docs/update-rules.md, "Simulated time"), ``round_clock`` what that does to a synchronous
round (the engine's clock policy, and its null object for untimed runs).
"""
