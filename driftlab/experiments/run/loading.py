"""A finished run back in Python: its trained ``torch.nn.Module`` and its records.

``load_model(run_dir)`` rebuilds the run's module (the zoo's or a plugin's model from config.json, or your own
module or factory passed again with ``model=``) and loads the final server model into it, in evaluation mode.  A
run keeps its model as one flat vector θ (``final_model.safetensors``, key ``params``): the module's trainable
parameters, each flattened and concatenated in ``named_parameters()`` order, as ``FlatModel`` flattens them, so
``FlatModel.unflatten(θ)`` gives them back by name.  ``final_state_dict(...)`` is the same model under the
module's own ``state_dict`` names (buffers included), which ``write_final_state_dict`` saves as
``final_state_dict.safetensors`` beside the flat vector; ``torch.nn.Module.load_state_dict`` reads it without
driftlab.

``load_model(run_dir, client=k)`` is client k's own model for an algorithm that keeps one in its client state
(APFL's mixed model, Ditto's v_k, FedAMP's w_k: ``Algorithm.personalization``), computed as the run's
evaluation computes it (``simulation.evaluation.evaluate_personal``) from the run's checkpoint: only a checkpoint
holds client states, so the run must have kept it (``keep_checkpoint = true``) or not have finished.

``load_run(run_dir)`` is the config, ``run.json`` and the per-round records; ``.frame()`` gives them as a pandas
DataFrame (the ``pandas`` extra).

Example:
    >>> import driftlab
    >>> result = driftlab.run({"rounds": 2, "data": {"num_clients": 5}}, out_dir="runs/tiny")   # doctest: +SKIP
    >>> module = driftlab.load_model("runs/tiny")                                                 # doctest: +SKIP
    >>> driftlab.load_run("runs/tiny").frame()[["round", "test_accuracy"]]                        # doctest: +SKIP
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Union

from driftlab.errors import ConfigError
from driftlab.experiments.report.read import read_metrics
from driftlab.experiments.run.run_directory import (
    CHECKPOINT_FILE,
    CLIENT_STATE_DIR,
    CONFIG_FILE,
    FINAL_MODEL_FILE,
    FINAL_STATE_DICT_FILE,
    METRICS_FILE,
    read_run_config,
)
from driftlab.run_files import read_run_info

if TYPE_CHECKING:
    import pandas
    import torch
    from torch import nn

    from driftlab.experiments.config import ExperimentConfig
    from driftlab.simulation.backends.flat import FlatModel


ModelGiven = Union["nn.Module", Callable[[tuple, int], "nn.Module"], None]


# ---------------------------------------------------------------- the records


@dataclass(frozen=True)
class LoadedRun:
    """A run directory's config (``ExperimentConfig``), ``run.json`` (a read-only mapping; empty for a run written
    before run.json existed) and per-round records (``metrics.jsonl``, one read-only mapping per round; a last line
    torn by a kill is left out)."""

    path: Path
    config: ExperimentConfig
    info: Mapping[str, Any]
    records: tuple[Mapping[str, Any], ...]

    def frame(self) -> pandas.DataFrame:
        """The records as a DataFrame: one row per round, one column per key (first-seen order), NaN where a round
        lacks a key (a round that was not evaluated has no ``test_accuracy``)."""
        try:
            import pandas
        except ImportError:
            from driftlab.extras import install_hint

            raise ImportError(f"LoadedRun.frame() needs pandas, the extra `pandas`: {install_hint('pandas')}") from None
        columns = list(dict.fromkeys(key for record in self.records for key in record))
        return pandas.DataFrame([dict(record) for record in self.records], columns=columns)


def load_run(run_dir: str | Path) -> LoadedRun:
    """The run in ``run_dir``: its config, ``run.json`` and records (see ``LoadedRun``); reads files only, no torch
    model is built.  A ConfigError says what is missing when ``run_dir`` holds no run."""
    path = _run_directory(run_dir)
    config, _ = read_run_config(path / CONFIG_FILE)
    info = read_run_info(path)
    records, _ = read_metrics(path / METRICS_FILE) if (path / METRICS_FILE).is_file() else ([], None)
    return LoadedRun(
        path,
        config,
        MappingProxyType(dict(info) if isinstance(info, dict) else {}),
        tuple(MappingProxyType(record) for record in records),
    )


def _run_directory(run_dir: str | Path) -> Path:
    path = Path(run_dir)
    if not (path / CONFIG_FILE).is_file():
        what = "does not exist" if not path.exists() else f"has no {CONFIG_FILE}"
        raise ConfigError(f"{path} is not a driftlab run directory: it {what}; give the --out directory of a run")
    return path


# ---------------------------------------------------------------- the model under its state_dict names


def final_state_dict(model: FlatModel, params: torch.Tensor) -> dict[str, torch.Tensor]:
    """The module's ``state_dict`` at the flat vector ``params``: every trainable parameter (under each of its names,
    tied weights included) from ``model.unflatten(params)``, every other entry (buffers, frozen parameters) as the
    module holds it; CPU tensors, each its own copy."""
    values = model.unflatten(params.detach().cpu())
    module = model.module
    # A tied parameter has several state_dict names and one flat slot: the slot is under its first name.
    first_name = {id(parameter): name for name, parameter in module.named_parameters()}
    slot_of = {name: first_name[id(parameter)] for name, parameter in module.named_parameters(remove_duplicate=False)}
    state = {}
    for name, tensor in module.state_dict().items():
        source = values.get(slot_of.get(name, ""), tensor)
        state[name] = source.detach().cpu().clone().contiguous()
    return state


def write_final_state_dict(
    out: Path,
    model: FlatModel,
    params: torch.Tensor,
    input_shape: tuple[int, ...] | None = None,
    num_classes: int | None = None,
) -> Path:
    """``final_state_dict.safetensors`` in ``out`` (atomically): ``final_state_dict(model, params)``, with the data's
    ``input_shape`` and ``num_classes`` in its metadata, which is what ``load_model`` needs to rebuild a zoo model or
    call a factory without loading the data again."""
    from driftlab.simulation.state.checkpoint import save_tensors, write_atomically

    tensors = final_state_dict(model, params)
    metadata = {"format": "1"}
    if input_shape is not None:
        metadata["input_shape"] = json.dumps([int(size) for size in input_shape])
    if num_classes is not None:
        metadata["num_classes"] = str(int(num_classes))
    path = Path(out) / FINAL_STATE_DICT_FILE
    write_atomically(path, lambda tmp: save_tensors(tensors, str(tmp), metadata=metadata))
    return path


# ---------------------------------------------------------------- the model


def load_model(
    run_dir: str | Path, *, model: ModelGiven = None, client: int | None = None, data: Any = None
) -> nn.Module:
    """The trained ``torch.nn.Module`` of the run in ``run_dir``, in evaluation mode, on the CPU, in the run's
    precision.

    ``model``: the module or factory ``(input_shape, num_classes) -> module`` the run was given (``driftlab.run(...,
    model=...)``); a run of the config's zoo or plugin model needs none.  A module is copied, never changed.
    ``client=k``: client k's own model (``Algorithm.personalization``) from the run's checkpoint instead of the
    server model.  ``data``: the data the run was given (``driftlab.run(..., data=...)``), needed when a zoo model
    or factory must learn the data's input shape and class count from it (a run that wrote
    ``final_state_dict.safetensors`` records them), and for ``client=k``.

    Parameters come from ``final_model.safetensors`` (mapped back as ``FlatModel`` flattens them), buffers from
    ``final_state_dict.safetensors`` when the run wrote one, else the module's own, built under the run's seed as
    the run built it.  ConfigError, naming what to pass, when the module cannot be rebuilt.
    """
    import torch

    path = _run_directory(run_dir)
    config, _ = read_run_config(path / CONFIG_FILE)
    if client is not None:
        return _personal_model(path, config, model, client, data)
    params, stored_names = _final_params(path)
    flat = _rebuilt(path, config, model, data)
    _check_layout(path / FINAL_MODEL_FILE, flat, params, stored_names, model)
    module = flat.module.to(dtype=params.dtype)
    values = flat.unflatten(params)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name in values:
                parameter.copy_(values[name])
        buffers = dict(module.named_buffers())
        for name, tensor in _stored_buffers(path, module).items():
            buffers[name].copy_(tensor)
    return module.eval()


def _final_params(path: Path) -> tuple[torch.Tensor, list[str] | None]:
    from safetensors import safe_open

    final = path / FINAL_MODEL_FILE
    if not final.is_file():
        info = read_run_info(path) or {}
        status, done, rounds = info.get("status", "unknown"), info.get("rounds_done", "?"), info.get("rounds", "?")
        raise ConfigError(
            f"{path} has no {FINAL_MODEL_FILE}: the run has not completed "
            f"(status {status}, {done} of {rounds} rounds); "
            f"finish it with `driftlab run {path / CONFIG_FILE} --out {path} --resume`, then load its model"
        )
    with safe_open(str(final), framework="pt") as handle:
        if "params" not in handle.keys():
            raise ConfigError(
                f"{final} holds no 'params' tensor: it is not a driftlab final model; restore it from the run"
            )
        params = handle.get_tensor("params")
        names = (handle.metadata() or {}).get("parameter_names")
    return params, names.split(",") if names else None


def _rebuilt(path: Path, config: ExperimentConfig, model: ModelGiven, data: Any) -> FlatModel:
    """The run's module, built as ``assembly.build_model`` builds it: under the run's seed (``Stream.MODEL_INIT``)."""
    import torch
    from torch import nn

    from driftlab.experiments.run.assembly import build_configured_model
    from driftlab.randomness import Stream, torch_seed
    from driftlab.simulation.backends.flat import FlatModel

    if model is not None and not isinstance(model, nn.Module) and not callable(model):
        raise ConfigError(
            f"model= takes the torch.nn.Module or the factory (input_shape, num_classes) -> module the run was given, "
            f"got {type(model).__name__}"
        )
    if isinstance(model, nn.Module):
        module = copy.deepcopy(model)
    else:
        input_shape, num_classes = _data_shape(path, config, data, model)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(torch_seed(config.seed, Stream.MODEL_INIT))
            if model is None:
                module = build_configured_model(config, input_shape, num_classes)
            else:
                module = model(input_shape, num_classes)
    named = [name for name, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ConfigError("the model has no trainable parameters: it is not the module the run trained")
    return FlatModel.wrap(module)


def _data_shape(path: Path, config: ExperimentConfig, data: Any, model: ModelGiven) -> tuple[tuple[int, ...], int]:
    """The data's input shape and class count: from ``final_state_dict.safetensors`` when the run recorded them, else
    from the data (``data=``, or the config's data set loaded as the run loaded it)."""
    recorded = _state_dict_metadata(path)
    if "input_shape" in recorded and "num_classes" in recorded:
        return tuple(json.loads(recorded["input_shape"])), int(recorded["num_classes"])
    dataset = _run_data(config, data, model)
    return dataset.input_shape, dataset.num_classes


def _run_data(config: ExperimentConfig, data: Any, model: ModelGiven) -> Any:
    """The run's data set, prepared as the run prepared it (partition, test and validation splits, digest checked)."""
    from driftlab.experiments.run.assembly import user_data

    if config.data.name == "custom" and data is None and not config.data.loader:
        what = (
            "model= your torch.nn.Module (no data is then needed), or " if model is None or not callable(model) else ""
        )
        raise ConfigError(
            "this run trained on data given to driftlab.run(data=...), which config.json cannot reload: pass "
            f"{what}data= the same data again, e.g. driftlab.load_model(run_dir, data=arrays)"
        )
    _, dataset = user_data(config, data)
    if dataset is None:
        from driftlab.experiments.run.assembly import load_data

        dataset = load_data(config)
    return dataset


def _check_layout(
    source: Path, flat: FlatModel, params: torch.Tensor, stored_names: list[str] | None, model: ModelGiven
) -> None:
    """A ConfigError, naming what to pass, when the rebuilt module's parameters are not those ``source`` holds."""
    same_names = stored_names is None or list(flat.names) == stored_names
    if same_names and flat.num_parameters == params.numel():
        return
    stored = ", ".join((stored_names or [])[:4]) + (", ..." if stored_names and len(stored_names) > 4 else "")
    built = ", ".join(flat.names[:4]) + (", ..." if len(flat.names) > 4 else "")
    if model is None:
        fix = (
            "the run was given a model of its own (driftlab.run(..., model=...)), which config.json cannot rebuild: "
            "pass the same module or factory again, driftlab.load_model(run_dir, model=your_factory_or_module)"
        )
    else:
        fix = "pass the module or factory the run was given (model=), or nothing for a run of the config's model"
    raise ConfigError(
        f"the model in {source} has {params.numel():,} parameters ({stored or 'names not recorded'}), "
        f"but the module built here has {flat.num_parameters:,} ({built}); {fix}"
    )


def _state_dict_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    file = path / FINAL_STATE_DICT_FILE
    if not file.is_file():
        return {}
    with safe_open(str(file), framework="pt") as handle:
        return dict(handle.metadata() or {})


def _stored_buffers(path: Path, module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers as ``final_state_dict.safetensors`` holds them ({} when the run wrote none)."""
    from safetensors import safe_open

    file = path / FINAL_STATE_DICT_FILE
    if not file.is_file():
        return {}
    buffers = dict(module.named_buffers())
    found = {}
    with safe_open(str(file), framework="pt") as handle:
        for name in handle.keys():
            if name in buffers:
                tensor = handle.get_tensor(name)
                if tensor.shape != buffers[name].shape:
                    raise ConfigError(
                        f"{file} holds buffer {name!r} of shape {tuple(tensor.shape)}, the module's is "
                        f"{tuple(buffers[name].shape)}: pass the module the run was given (model=)"
                    )
                found[name] = tensor
    return found


# ---------------------------------------------------------------- a client's own model


def _personal_model(path: Path, config: ExperimentConfig, model: ModelGiven, client: int, data: Any) -> nn.Module:
    """Client ``client``'s own model from the run's checkpoint, computed as ``evaluate_personal`` computes it:
    ``personalization.model(view_k, state_k)``, ``view_k`` what the server would send client k now."""
    import torch

    from driftlab.experiments.run.assembly import build_simulation, client_stores, user_data
    from driftlab.simulation.backends.buffers import load_buffers, own_buffers_record
    from driftlab.simulation.round.checkpointing import record_template, restored_state
    from driftlab.simulation.round.setup import SimulationState, disk_stores
    from driftlab.simulation.state.checkpoint import load_checkpoint

    if isinstance(client, bool) or not isinstance(client, int) or client < 0:
        raise ConfigError(f"client= is a client id 0, 1, 2, ..., got {client!r}")
    checkpoint = path / CHECKPOINT_FILE
    if not checkpoint.is_file():
        raise ConfigError(
            f"{path} keeps no client states: only a run's checkpoint holds them, and a completed run removes it unless "
            f"keep_checkpoint = true; run again with keep_checkpoint = true to export client {client}'s own model, or "
            "load the server model with driftlab.load_model(run_dir)"
        )
    if config.data.name == "custom" and data is None and not config.data.loader:
        raise ConfigError(
            "this run trained on data given to driftlab.run(data=...), which config.json cannot reload; a client's own "
            "model needs the run's clients: pass data= the same data again"
        )
    # On the CPU, whatever device the run used (a GPU run's model loads on a machine without one): the device is no
    # part of the run's fingerprint; the personal model is computed from the checkpoint's states there.
    config, dataset = user_data(config.model_copy(update={"device": "cpu"}), data)
    sim, state = build_simulation(config, model, state_dir=path / CLIENT_STATE_DIR, data=dataset)
    algorithm = sim.algorithm
    if algorithm.personalization is None:
        raise ConfigError(
            f"algorithm {config.algorithm.name!r} keeps no per-client models: every client predicts with the server "
            "model, driftlab.load_model(run_dir); apfl, ditto and fedamp keep one per client"
        )
    if client >= sim.data.num_clients:
        raise ConfigError(f"client={client}, but the run has clients 0..{sim.data.num_clients - 1}")
    server_params = _checkpointed_server_params(checkpoint)
    if server_params is not None:
        _check_layout(checkpoint, sim.model, server_params, None, model)
    loaded = load_checkpoint(checkpoint, state.server, record_template(sim, state), config.fingerprint(), sim.device)
    if loaded.store_names() and not disk_stores(state):  # written with the disk store: read through it
        state = SimulationState(0, state.server, *client_stores(config, sim, "disk", path / CLIENT_STATE_DIR))
    for name, store in disk_stores(state).items():
        if name in loaded.store_names():
            store.restore(loaded.store_tables, f"store/{name}", checkpoint)
    state = restored_state(sim, state, loaded)  # the states are staged, read as the evaluation reads them
    clients = state.clients
    own = next((held for client_id, held in clients.items(include_staged=True) if client_id == client), None)
    if own is None and algorithm.client_state_init is not None:
        own = algorithm.client_state_init(sim.initial_params)  # a client that never trained: its initial state
    view = algorithm.view_for(
        state.server, client, algorithm.broadcast(state.server), lambda: clients.items(include_staged=True)
    )
    params = algorithm.personalization.model(view, own).detach().cpu()
    module = sim.model.module.cpu().to(dtype=params.dtype)
    values = sim.model.unflatten(params)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name in values:
                parameter.copy_(values[name])
    local = own_buffers_record(sim)
    if local is not None:  # FedBN: the client's own BatchNorm statistics, as the personal evaluation uses them
        load_buffers(module, local.start_of(client))
    return module.eval()


def _checkpointed_server_params(checkpoint: Path) -> torch.Tensor | None:
    """The server model a checkpoint holds (``server/params``), to check the rebuilt module against it before the
    checkpoint is read; None for a server state that nests it (a wrapper's), which ``load_checkpoint`` checks."""
    from safetensors import safe_open

    with safe_open(str(checkpoint), framework="pt") as handle:
        return handle.get_tensor("server/params") if "server/params" in handle.keys() else None


__all__ = ["FINAL_STATE_DICT_FILE", "LoadedRun", "final_state_dict", "load_model", "load_run", "write_final_state_dict"]
