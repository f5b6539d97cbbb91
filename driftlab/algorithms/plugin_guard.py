"""Algorithm plugins' faults, named: every function of a plugin's bundle is wrapped so that what goes wrong in it says which plugin and which function.

A plugin's ``from_config`` and each function of the ``seam.Algorithm`` it
returns (``server_init``, ``broadcast``, ``client_state_init``,
``client_objective``, ``client_finish``, ``server_update`` or its fold's
``start``/``add``/``finish``, ``client_joined``, ``client_left``, and the
functions of the ``LossTerm`` and ``LocalStep`` its objectives carry) runs
inside a wrapper that turns an exception into a ``PluginError``::

    algorithm plugin 'moon' (/home/me/moon.py) failed in client_finish (client 3, round 2): RuntimeError: ...

chained to the original (``raise ... from``), so the traceback into the
plugin's code is kept (the CLI writes it to ``DIR/error.log``).  The wrappers
also check, where it is cheap, what the plugin returns: a bundle from
``from_config``; a server state and client view whose ``params`` are the
model's shape and dtype; an objective of a type the backends train; an
affine correction of the model's shape; a ``(state, message)`` pair from
``client_finish`` whose state keeps one layout (``state_store.state_layout``)
and whose message is finite when the client's trained model is.

Built-in algorithms are never wrapped (``registry.is_plugin``): they pay
nothing and compute exactly what they did.  A wrapper computes nothing the
plugin would not: a plugin's numbers are unchanged too.  Memory errors pass
through as they are (they say what the machine lacks, not what the plugin did
wrong), and so does ``KeyboardInterrupt``.

Loss-term and local-step functions are wrapped once per function (a small
cache keyed by the function), so clients whose terms share a function still
share it after wrapping: the vectorized backend batches clients by it, and
runs the wrapper inside ``torch.func.vmap(torch.func.grad(...))`` as it would
the function itself.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

from driftlab.errors import ClientStateError, ConfigError, PluginError
from driftlab.simulation.backends.objectives import LocalObjective, LocalStep, LossTerm
from driftlab.simulation.seam import Algorithm, ClientContext, GradientCorrection, ServerFold
from driftlab.simulation.state.state_store import layout_difference, state_layout

PASSED_THROUGH = (
    MemoryError,
    torch.OutOfMemoryError,
)  # resource errors keep their type: they are not the plugin's fault
_WRAPPED_LIMIT = (
    64  # term and step functions remembered per algorithm (a plugin making new ones per client gets no unbounded cache)
)


def call_from_config(entry: Any, config: Any, server_optimizer: Any, who: str) -> Algorithm:
    """``entry.from_config(config, server_optimizer)`` of a plugin, its failures named, and its bundle guarded.

    ``who`` is how messages name the plugin (``registry.describe_plugin``).  A ``ConfigError`` the plugin raises
    stays one (with the plugin named); another exception becomes a ``PluginError``; a value that is not a
    ``seam.Algorithm`` (None: a forgotten ``return``) is a ``PluginError`` too.
    """
    try:
        algorithm = entry.from_config(config, server_optimizer)
    except ConfigError as error:
        raise ConfigError(f"{who}: {error}") from error
    except PASSED_THROUGH:
        raise
    except Exception as error:  # whatever the plugin raises is named, then chained
        raise _failure(who, entry.name, "from_config", error) from error
    if not isinstance(algorithm, Algorithm):
        hint = " (does it end without `return`?)" if algorithm is None else ""
        raise PluginError(
            f"{who}: from_config returned {_a(algorithm)}{hint}, not the driftlab.simulation.seam.Algorithm bundle of the "
            "algorithm's functions; return the Algorithm(...) your build function makes",
            entry.name,
            "from_config",
        )
    return guarded(algorithm, who, entry.name)


def guarded(algorithm: Algorithm, who: str, plugin: str | None = None) -> Algorithm:
    """``algorithm`` with each function wrapped (module docstring); ``who`` names the plugin in messages."""
    plugin = plugin or algorithm.name
    guard = _Guard(who, plugin)
    fold = None
    if algorithm.server_fold is not None:
        inner = algorithm.server_fold
        fold = ServerFold(
            guard.wrap(inner.start, "server_fold.start"),
            guard.wrap(inner.add, "server_fold.add"),
            guard.checked(inner.finish, "server_fold.finish", guard.check_server_result),
        )
    server_update = (
        fold.server_update
        if fold is not None
        else guard.checked(algorithm.server_update, "server_update", guard.check_server_result)
    )
    return dataclasses.replace(
        algorithm,
        server_init=guard.checked(algorithm.server_init, "server_init", guard.check_server_init),
        client_objective=guard.objective(algorithm.client_objective),
        client_finish=guard.checked(algorithm.client_finish, "client_finish", guard.check_finish),
        server_update=server_update,
        broadcast=guard.checked(algorithm.broadcast, "broadcast", guard.check_view),
        client_state_init=guard.optional(algorithm.client_state_init, "client_state_init", guard.check_initial_state),
        client_joined=guard.optional(algorithm.client_joined, "client_joined", guard.check_membership),
        client_left=guard.optional(algorithm.client_left, "client_left", guard.check_membership),
        server_fold=fold,
        plugin=who,
    )


class _Guard:
    """The wrappers of one plugin's bundle, and what they remember: the model's shape and dtype (from
    ``server_init``'s argument), the layout of the first client state, the wrapped term and step functions."""

    def __init__(self, who: str, plugin: str) -> None:
        self.who = who
        self.plugin = plugin
        self.model: tuple[tuple[int, ...], torch.dtype] | None = None
        self.initial_layout: Any = None  # of client_state_init's state
        self.state_layout: Any = None  # of the first state client_finish returned
        self.wrapped: dict[int, tuple[Callable, Callable]] = {}

    # ------------------------------------------------------------------ wrappers

    def wrap(self, function: Callable, name: str) -> Callable:
        """``function``, its exceptions re-raised as a ``PluginError`` naming the plugin and ``name``."""
        who, plugin = self.who, self.plugin

        @functools.wraps(function)
        def plugin_function(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            except (PluginError, *PASSED_THROUGH):
                raise
            except Exception as error:  # whatever the plugin raises is named, then chained
                raise _failure(who, plugin, name, error, _client_of(args)) from error

        return plugin_function

    def checked(self, function: Callable, name: str, check: Callable[[str, tuple, Any], None]) -> Callable:
        """``wrap(function)``, then ``check(name, arguments, result)`` on what it returned."""
        wrapped = self.wrap(function, name)

        @functools.wraps(function)
        def plugin_function(*args: Any, **kwargs: Any) -> Any:
            result = wrapped(*args, **kwargs)
            check(name, args, result)
            return result

        return plugin_function

    def objective(self, function: Callable) -> Callable:
        """``client_objective``, checked, its loss term's and local step's functions wrapped too (``wrap_objective``)."""
        checked = self.checked(function, "client_objective", self.check_objective)

        @functools.wraps(function)
        def client_objective(*args: Any, **kwargs: Any) -> Any:
            return wrap_objective(self, checked(*args, **kwargs))

        return client_objective

    def optional(
        self, function: Callable | None, name: str, check: Callable[[str, tuple, Any], None]
    ) -> Callable | None:
        return None if function is None else self.checked(function, name, check)

    def once(self, function: Callable, name: str, check: Callable[[str, tuple, Any], None]) -> Callable:
        """The one wrapper of a term or step ``function`` (the same object for every client that uses it)."""
        found = self.wrapped.get(id(function))
        if found is not None and found[0] is function:
            return found[1]
        if len(self.wrapped) >= _WRAPPED_LIMIT:
            self.wrapped = {}
        wrapped = self.checked(function, name, check)
        self.wrapped[id(function)] = (function, wrapped)  # the function is kept, so its id is not reused
        return wrapped

    # ------------------------------------------------------------------ checks of what the plugin returned

    def refuse(self, name: str, problem: str, args: tuple = ()) -> PluginError:
        return PluginError(f"{self.who}: {name}{_where(_client_of(args))} returned {problem}", self.plugin, name)

    def check_server_init(self, name: str, args: tuple, server: Any) -> None:
        initial = args[0] if args else None
        if isinstance(initial, torch.Tensor):
            self.model = (tuple(initial.shape), initial.dtype)
        self.check_params(name, args, server, "a server state")

    def check_view(self, name: str, args: tuple, view: Any) -> None:
        self.check_params(name, args, view, "a client view")

    def check_membership(self, name: str, args: tuple, server: Any) -> None:
        self.check_params(name, args, server, "a server state")

    def check_server_result(self, name: str, args: tuple, result: Any) -> None:
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
            raise self.refuse(name, f"{_a(result)}; it must return (new server state, metrics dict)")
        self.check_params(name, args, result[0], "a new server state")

    def check_params(self, name: str, args: tuple, value: Any, what: str) -> None:
        params = getattr(value, "params", None)
        if not isinstance(params, torch.Tensor):
            raise self.refuse(name, f"{_a(value)} as {what}; it must have a `params` tensor field (the model)", args)
        if self.model is not None and (tuple(params.shape), params.dtype) != self.model:
            shape, dtype = self.model
            raise self.refuse(
                name,
                f"{what} whose params are a {_dtype(params.dtype)} tensor of shape {tuple(params.shape)}, but the model is a "
                f"{_dtype(dtype)} tensor of shape {shape}",
                args,
            )

    def check_objective(self, name: str, args: tuple, objective: Any) -> None:
        # The term and step functions are wrapped in place of the objective the backends get (see ``client_objective``).
        if not isinstance(objective, (GradientCorrection, LocalObjective, LossTerm, LocalStep)):
            raise self.refuse(
                name,
                f"{_a(objective)}; it must return a GradientCorrection or a LocalObjective (driftlab.simulation.backends.objectives)",
                args,
            )
        correction = (
            objective.correction
            if isinstance(objective, LocalObjective)
            else objective
            if isinstance(objective, GradientCorrection)
            else None
        )
        if correction is None or self.model is None:
            return
        shape = self.model[0]
        for field in ("linear", "quadratic", "reference"):
            value = getattr(correction, field)
            if isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
                raise self.refuse(
                    name,
                    f"a GradientCorrection whose {field} has shape {tuple(value.shape)}; it must be the model's shape {shape}",
                    args,
                )

    # guard.once calls each check as check(name, args, value); a loss term's value is checked without its arguments
    def check_term(self, name: str, args: tuple, value: Any) -> None:  # noqa: ARG002
        # Inside vmap a tensor shows its one client's shape: a term gives one number per client.
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            shape = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else _a(value)
            raise self.refuse(
                name,
                f"{shape}; a loss term returns one number (a 0-dimensional tensor), e.g. (batch.weights * h).sum()",
            )

    def check_step(self, name: str, args: tuple, value: Any) -> None:
        params = args[0] if args else None
        if not (
            isinstance(value, tuple)
            and len(value) == 2
            and isinstance(value[0], torch.Tensor)
            and isinstance(value[1], tuple)
        ):
            raise self.refuse(name, f"{_a(value)}; a local step returns (new params, new state tuple)")
        if isinstance(params, torch.Tensor) and value[0].shape != params.shape:
            raise self.refuse(
                name, f"params of shape {tuple(value[0].shape)} for params of shape {tuple(params.shape)}"
            )

    def check_initial_state(self, name: str, args: tuple, state: Any) -> None:
        try:
            self.initial_layout = state_layout(state)
        except ClientStateError as error:
            raise self.refuse(name, f"a client state that cannot be stored: {error}", args) from None

    def check_finish(self, name: str, args: tuple, result: Any) -> None:
        if not (isinstance(result, tuple) and len(result) == 2):
            raise self.refuse(name, f"{_a(result)}; it must return (new client state, message or None)", args)
        state, message = result
        try:
            layout = state_layout(state)
        except ClientStateError as error:
            raise self.refuse(name, f"a client state that cannot be stored: {error}", args) from None
        if layout is not None:
            if self.state_layout is None:
                problem = layout_difference(layout, self.initial_layout, "client_state_init's state")
                self.state_layout = layout if problem is None else None
            else:
                problem = layout_difference(layout, self.state_layout, "the client states it returned before")
            if problem is not None:
                raise self.refuse(
                    name,
                    f"a client state that changed: {problem}; a client state must keep one structure, dtype and shape in "
                    "every round, or no checkpoint of it could be resumed",
                    args,
                )
        update = args[3] if len(args) > 3 else None
        trained = getattr(update, "final_params", None)
        if message is not None and isinstance(trained, torch.Tensor) and bool(torch.isfinite(trained).all()):
            bad = _non_finite_tensor(message, "message")
            if bad is not None:
                raise self.refuse(
                    name,
                    f"a message whose {bad} has non-finite entries although the client's trained model is finite: "
                    "the plugin computed them, and a lower learning rate would not cure that",
                    args,
                )


def wrap_objective(guard: _Guard, objective: Any) -> Any:
    """``objective`` with its loss term's and local step's functions replaced by their (shared) wrappers."""
    if isinstance(objective, LossTerm):
        return dataclasses.replace(
            objective, function=guard.once(objective.function, "its loss term's function", guard.check_term)
        )
    if isinstance(objective, LocalStep):
        return dataclasses.replace(
            objective, function=guard.once(objective.function, "its local step's function", guard.check_step)
        )
    if isinstance(objective, LocalObjective) and (objective.loss_term is not None or objective.local_step is not None):
        return dataclasses.replace(
            objective,
            loss_term=wrap_objective(guard, objective.loss_term) if objective.loss_term is not None else None,
            local_step=wrap_objective(guard, objective.local_step) if objective.local_step is not None else None,
        )
    return objective


def _failure(
    who: str, plugin: str, name: str, error: BaseException, context: ClientContext | None = None
) -> PluginError:
    text = " ".join(str(error).split())
    cause = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return PluginError(f"{who} failed in {name}{_where(context)}: {cause}", plugin, name)


def _client_of(args: tuple) -> ClientContext | None:
    return next((a for a in args if isinstance(a, ClientContext)), None)


def _where(context: ClientContext | None) -> str:
    return f" (client {context.client_id}, round {context.round})" if context is not None else ""


def _a(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _non_finite_tensor(value: Any, path: str, depth: int = 0) -> str | None:
    """The path of the first floating tensor in ``value`` (a message) with a non-finite entry, or None."""
    if depth > 8:
        return None
    if isinstance(value, torch.Tensor):
        return path if value.is_floating_point() and not bool(torch.isfinite(value).all()) else None
    if isinstance(value, float):
        return path if value != value or value in (float("inf"), float("-inf")) else None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = ((f"{path}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value))
    elif isinstance(value, (tuple, list)):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    elif isinstance(value, dict):
        items = ((f"{path}[{k!r}]", item) for k, item in value.items())
    else:
        return None
    return next(
        (found for found in (_non_finite_tensor(item, where, depth + 1) for where, item in items) if found is not None),
        None,
    )
