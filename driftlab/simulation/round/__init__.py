"""The round: which clients train, on what, and how their messages fold into the server's model (engine, client path, sampling, availability, randomness)."""
