"""``ConfigError``, in a module of its own so that algorithm modules and plugins can raise it
without importing the config module (which imports the algorithm registry)."""


class ConfigError(ValueError):
    """A configuration the run cannot start with; the message says which key and what is allowed."""
