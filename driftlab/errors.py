"""``ConfigError``, in a module of its own so that algorithm modules and plugins can raise it
without importing the config module (which imports the algorithm registry)."""


class ConfigError(ValueError):
    """A configuration the run cannot start with; the message says which key and what is allowed."""


class PluginError(RuntimeError):
    """An exception raised inside an algorithm plugin's function, or a value a plugin returned that driftlab cannot use.

    The message names the plugin (its algorithm name and source file) and the function; the
    original exception is the ``__cause__``, so its traceback (in the plugin's code) is kept.
    ``plugin`` and ``function`` hold the names, for code that handles the error.
    """

    def __init__(self, message: str, plugin: str | None = None, function: str | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.function = function

    def __reduce__(self):  # picklable across a sweep's processes with its names
        return (type(self), (str(self), self.plugin, self.function))


class ClientStateError(ValueError):
    """A client state a store cannot keep: of a type a checkpoint cannot hold, or changed in structure,
    dtype or shape from the states stored before it (a checkpoint of it could not be resumed)."""
