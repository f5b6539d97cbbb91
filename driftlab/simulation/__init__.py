"""The simulator: what a round does, how clients train, and where state lives.

* ``seam``: the interface between the engine and an algorithm (``Algorithm``, ``ClientView``, ``MessageCodec``).
* ``round/``: the round itself (``engine``: ``plan_round``, ``finish_round``, ``run_round``), what rounds share
  (``setup``: ``Simulation``, ``SimulationState``), the one client path (``client``), sampling, availability,
  randomness from (seed, round, client id), folds in sample order.
* ``backends/``: how a round's clients train: the sequential reference (``local_training``) and the vectorized
  backend (``vectorized*``, ``stacked``), with the objectives, flat parameters, precision and augmentation.
* ``state/``: client-state stores (memory, disk), checkpoints and the run's ``MemoryBudget``.
* ``evaluation``: evaluation, dissimilarity and the divergence tests.
"""
