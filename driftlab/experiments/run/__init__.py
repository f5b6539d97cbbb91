"""A run's life: assembling it from its config, running its rounds, its run directory, resume, progress and
trackers, loading it back, and `driftlab demo`."""
