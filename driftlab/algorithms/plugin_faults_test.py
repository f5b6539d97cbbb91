"""Broken algorithm plugins: each fault names the plugin (its name and file) and the function it happened in.

Every plugin here is one small file written to ``tmp_path``: FedAvg with a client
state of its own, and one function replaced by a broken one (``FAULTS``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

import driftlab
from driftlab.algorithms import registry
from driftlab.algorithms.plugin_guard import guarded
from driftlab.algorithms.registry_test import fresh_registry  # noqa: F401 - a fixture
from driftlab.errors import ClientStateError, PluginError
from driftlab.experiments.cli_test import REPO_ROOT, driftlab_cli
from driftlab.simulation.seam import plugin_note

TINY = ["rounds=2", "data.num_clients=6", "client.epochs=1", "sampling.participation=0.5"]

# FedAvg with a per-client counter as its client state, every function its own; {FAULT} redefines one of them.
PLUGIN = """
import dataclasses
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from driftlab.algorithms import AlgorithmEntry, fedavg, register
from driftlab.simulation.backends.objectives import LocalObjective, LocalStep, LossTerm


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["{NAME}"] = "{NAME}"


@dataclasses.dataclass(frozen=True)
class State:
    seen: torch.Tensor


def from_config(config, server_optimizer):
    base = fedavg.build(server_optimizer, incomplete="keep")

    def server_init(params):
        return base.server_init(params)

    def broadcast(server):
        return base.broadcast(server)

    def client_state_init(params):
        return State(torch.zeros(2))

    def client_objective(view, state, context):
        return base.client_objective(view, None, context)

    def client_finish(view, state, context, update):
        _, message = base.client_finish(view, None, context, update)
        return State(state.seen + 1), message

    def server_update(server, messages, context):
        return base.server_update(server, messages, context)

{FAULT}
    return dataclasses.replace(
        base, name="{NAME}", server_init=server_init, broadcast=broadcast, client_state_init=client_state_init,
        client_objective=client_objective, client_finish=client_finish, server_update=server_update, server_fold=None,
    )


{IMPORT_FAULT}
register(AlgorithmEntry("{NAME}", Config, from_config, label="Broken"))
"""


def indented(code: str) -> str:
    return "\n".join("    " + line if line else line for line in code.strip("\n").splitlines()) + "\n"


# name -> (the broken function, the function the error must name, what the message must also say)
FAULTS = {
    "raises_in_server_init": (
        "def server_init(params):\n    raise ValueError('no server today')",
        "server_init",
        "ValueError: no server today",
    ),
    "wrong_server_shape": (
        "def server_init(params):\n    return base.server_init(torch.zeros(len(params) + 1))",
        "server_init",
        "returned a server state whose params are a float32 tensor of shape (",
    ),
    "raises_in_broadcast": ("def broadcast(server):\n    raise KeyError('view')", "broadcast", "KeyError: 'view'"),
    "wrong_view_shape": (
        "def broadcast(server):\n    return dataclasses.replace(base.broadcast(server), params=server.params[:-1])",
        "broadcast",
        "returned a client view whose params are a float32 tensor of shape (",
    ),
    "raises_in_client_state_init": (
        "def client_state_init(params):\n    return 1 / 0",
        "client_state_init",
        "ZeroDivisionError: division by zero",
    ),
    "raises_in_client_objective": (
        "def client_objective(view, state, context):\n    raise RuntimeError('no objective')",
        "client_objective",
        "RuntimeError: no objective",
    ),
    "wrong_correction_shape": (
        "from driftlab.simulation.seam import GradientCorrection\n"
        "def client_objective(view, state, context):\n    return GradientCorrection(linear=torch.zeros(3))",
        "client_objective",
        "returned a GradientCorrection whose linear has shape (3,); it must be the model's shape (",
    ),
    "raises_in_client_finish": (
        "def client_finish(view, state, context, update):\n    return update.final_params @ torch.ones(3)",
        "client_finish",
        "RuntimeError:",
    ),
    "raises_in_server_update": (
        "def server_update(server, messages, context):\n    raise ArithmeticError('no update')",
        "server_update",
        "ArithmeticError: no update",
    ),
    "wrong_update_shape": (
        "def server_update(server, messages, context):\n    return dataclasses.replace(server, params=server.params[:5]), {}",
        "server_update",
        "returned a new server state whose params are a float32 tensor of shape (5,), but the model is",
    ),
    "nan_message": (
        "def client_finish(view, state, context, update):\n"
        "    _, message = base.client_finish(view, None, context, update)\n"
        "    return State(state.seen + 1), dataclasses.replace(message, params=message.params * float('nan'))",
        "client_finish",
        "returned a message whose message.params has non-finite entries although the client's trained model is finite",
    ),
    "state_changes_shape": (
        "def client_finish(view, state, context, update):\n"
        "    _, message = base.client_finish(view, None, context, update)\n"
        "    return State(torch.zeros(1 + context.round)), message",
        "client_finish",
        "returned a client state that changed: state.seen is a float32 tensor of shape (3,), not a float32 tensor of shape (2,) "
        "as in the client states it returned before",
    ),
    "list_state": (
        "def client_finish(view, state, context, update):\n"
        "    _, message = base.client_finish(view, None, context, update)\n"
        "    return [state.seen], message",
        "client_finish",
        "returned a client state that cannot be stored: state is a list, which a checkpoint cannot hold",
    ),
    "raises_in_loss_term": (
        "def _term(batch, anchor):\n    raise ValueError('bad term')\n"
        "def client_objective(view, state, context):\n    return LocalObjective(loss_term=LossTerm(_term, (view.params,)))",
        "its loss term's function",
        "ValueError: bad term",
    ),
    "term_not_a_number": (
        "def _term(batch, anchor):\n    return batch.outputs.sum(dim=0)\n"
        "def client_objective(view, state, context):\n    return LocalObjective(loss_term=LossTerm(_term, (view.params,)))",
        "its loss term's function",
        "returned a tensor of shape (",
    ),
    "step_wrong_shape": (
        "def _step(params, gradient, state, lr):\n    return params[:-1], state\n"
        "def client_objective(view, state, context):\n    return LocalStep(_step)",
        "its local step's function",
        "returned params of shape (",
    ),
    "raises_in_local_step": (
        "def _step(params, gradient, state, lr):\n    raise ValueError('bad step')\n"
        "def client_objective(view, state, context):\n    return LocalStep(_step)",
        "its local step's function",
        "ValueError: bad step",
    ),
}


def write_broken(folder: Path, name: str, fault: str = "", import_fault: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(
        PLUGIN.replace("{NAME}", name)
        .replace("{FAULT}", indented(fault) if fault else "")
        .replace("{IMPORT_FAULT}", import_fault)
    )
    return path


def run_plugin(path: Path, name: str, *overrides: str, out: Path | None = None):
    return driftlab.run(None, out, overrides=[*TINY, f"plugins=['{path}']", f"algorithm.name={name}", *overrides])


def test_the_plugin_without_a_fault_runs_as_fedavg_with_keep(fresh_registry, tmp_path):
    path = write_broken(tmp_path, "healthy")
    result = run_plugin(path, "healthy")
    same = driftlab.run(None, overrides=[*TINY, "algorithm.name=fedavg", "algorithm.incomplete=keep"])
    assert torch.equal(result.final_params, same.final_params)  # the guard changes no number


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_every_fault_names_the_plugin_its_file_and_the_function(fresh_registry, tmp_path, name):
    fault, function, detail = FAULTS[name]
    path = write_broken(tmp_path, name, fault)
    with pytest.raises(PluginError) as raised:
        run_plugin(path, name, "backend=sequential")
    message = str(raised.value)
    assert message.startswith(f"algorithm plugin '{name}' ({path.resolve()}): ") or message.startswith(
        f"algorithm plugin '{name}' ({path.resolve()}) failed in {function}"
    ), message
    assert f" {function}" in message and detail in message, message
    assert (raised.value.plugin, raised.value.function) == (name, function)


def test_a_fault_inside_a_vmapped_loss_term_is_named_on_the_vectorized_backend(fresh_registry, tmp_path):
    fault, function, detail = FAULTS["raises_in_loss_term"]
    path = write_broken(tmp_path, "term_vmapped", fault)
    with pytest.raises(PluginError, match=f"algorithm plugin 'term_vmapped' .* failed in {function}: .*{detail}"):
        run_plugin(path, "term_vmapped", "backend=vectorized")


def test_an_exception_names_the_client_and_round_and_keeps_the_original_as_its_cause(fresh_registry, tmp_path):
    path = write_broken(tmp_path, "finish_fails", FAULTS["raises_in_client_finish"][0])
    with pytest.raises(PluginError) as raised:
        run_plugin(path, "finish_fails")
    assert "failed in client_finish (client " in str(raised.value) and ", round 1): RuntimeError:" in str(raised.value)
    assert isinstance(raised.value.__cause__, RuntimeError)
    frames = []
    traceback = raised.value.__cause__.__traceback__
    while traceback is not None:
        frames.append(traceback.tb_frame.f_code.co_filename)
        traceback = traceback.tb_next
    assert str(path.resolve()) in frames  # the traceback reaches into the plugin's file


def test_from_config_returning_none_or_raising_is_named(fresh_registry, tmp_path):
    path = write_broken(tmp_path, "returns_none", "def from_config(config, server_optimizer):\n    return None")
    # from_config is redefined inside the outer from_config: make the module-level one return None instead
    path.write_text(
        path.read_text().replace(
            "def from_config(config, server_optimizer):\n    base =",
            "def from_config(config, server_optimizer):\n    return None\n    base =",
            1,
        )
    )
    with pytest.raises(PluginError) as raised:
        run_plugin(path, "returns_none")
    assert str(raised.value) == (
        f"algorithm plugin 'returns_none' ({path.resolve()}): from_config returned None (does it end without `return`?), not the "
        "driftlab.simulation.seam.Algorithm bundle of the algorithm's functions; return the Algorithm(...) your build function makes"
    )
    path = write_broken(tmp_path, "config_fails")
    path.write_text(
        path.read_text().replace(
            "    base = fedavg.build", "    raise TypeError('no bundle')\n    base = fedavg.build", 1
        )
    )
    with pytest.raises(
        PluginError,
        match=r"algorithm plugin 'config_fails' \(.*config_fails.py\) failed in from_config: TypeError: no bundle",
    ):
        run_plugin(path, "config_fails")


@pytest.mark.parametrize("raised_at_import", ["RuntimeError('broken at import')", "KeyboardInterrupt", "SystemExit(3)"])
def test_an_exception_at_import_is_a_config_error_naming_the_plugin(fresh_registry, tmp_path, raised_at_import):
    path = write_broken(tmp_path, "import_fails", import_fault=f"raise {raised_at_import}\n")
    with pytest.raises(driftlab.ConfigError) as raised:
        run_plugin(path, "import_fails")
    message = str(raised.value)
    assert message.startswith(f"plugins: cannot import plugin '{path}': "), message
    assert f"(raised at {path.resolve()}, line " in message, message


def test_the_cli_names_the_plugin_and_logs_the_traceback(fresh_registry, tmp_path):
    path = write_broken(tmp_path, "cli_broken", FAULTS["raises_in_server_update"][0])
    out = tmp_path / "out"
    config_file = tmp_path / "experiment.toml"
    config_file.write_text('plugins = ["cli_broken.py"]\n[algorithm]\nname = "cli_broken"\n')
    result = driftlab_cli("run", config_file, "--out", out, *TINY, "--quiet")
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(
        f"driftlab: error: PluginError: algorithm plugin 'cli_broken' ({path.resolve()}) failed in server_update: ArithmeticError: no update"
    ), result.stderr
    log = (out / "error.log").read_text()
    assert (
        "ArithmeticError: no update" in log
        and f'File "{path.resolve()}"' in log
        and "raise ArithmeticError('no update')" in log
    )
    info = json.loads((out / "run.json").read_text())
    assert info["status"] == "failed" and "algorithm plugin 'cli_broken'" in info["message"]


def test_a_plugins_nan_metric_is_not_blamed_on_the_learning_rate_alone(fresh_registry, tmp_path):
    fault = (
        "def server_update(server, messages, context):\n"
        "    server, metrics = base.server_update(server, messages, context)\n"
        "    return server, {**metrics, 'spread': float('nan')}"
    )
    path = write_broken(tmp_path, "nan_metric", fault)
    with pytest.raises(FloatingPointError) as raised:
        run_plugin(path, "nan_metric")
    message = str(raised.value)
    assert "spread=nan" in message and f"the algorithm is algorithm plugin 'nan_metric' ({path.resolve()})" in message
    assert "the plugin could be at fault rather than the learning rate" in message


def test_built_in_algorithms_are_not_wrapped_and_carry_no_plugin_note():
    from driftlab.algorithms import fedavg
    from driftlab.experiments.run.assembly import configured_algorithm

    config = driftlab.load_config(None, ["algorithm.name=fedavg"])
    algorithm = configured_algorithm(config)
    assert algorithm.plugin is None and plugin_note(algorithm) == ""
    assert algorithm.client_finish.__module__ == fedavg.__name__  # the function itself, no wrapper


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_a_client_state_changing_shape_is_refused_by_both_stores_naming_the_plugin(
    fresh_registry, tmp_path, store, monkeypatch
):
    # Without the guard (as for a bundle passed in directly), the store itself refuses the state.
    monkeypatch.setattr(registry, "is_plugin", lambda entry: False)
    path = write_broken(tmp_path, f"grows_{store}", FAULTS["state_changes_shape"][0])
    with pytest.raises(ClientStateError) as raised:
        run_plugin(path, f"grows_{store}", f"state.store={store}", out=tmp_path / "run")
    message = str(raised.value)
    assert message.startswith("the new state of client "), message
    reference = (
        "client_state_init's state (whose layout the disk store's files hold)"
        if store == "disk"
        else "the states stored before it"
    )
    assert (
        f"state.seen is a float32 tensor of shape (3,), not a float32 tensor of shape (2,) as in {reference}; "
        in message
    ), message


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_a_list_as_client_state_fails_the_run_cleanly_on_both_stores(fresh_registry, tmp_path, store, monkeypatch):
    monkeypatch.setattr(registry, "is_plugin", lambda entry: False)  # the store's own check, not the guard's
    path = write_broken(tmp_path, f"lists_{store}", FAULTS["list_state"][0])
    out = tmp_path / "run"
    with pytest.raises(
        ClientStateError,
        match=r"^the new state of client \d+ cannot be stored: state is a list, which a checkpoint cannot hold",
    ):
        run_plugin(path, f"lists_{store}", f"state.store={store}", "checkpoint_every=1", out=out)
    info = json.loads((out / "run.json").read_text())
    assert info["status"] == "failed" and "state is a list" in info["message"]


def test_the_store_names_the_plugin_that_made_a_state(tmp_path):
    from driftlab.simulation.state.state_store import DiskClientStore, InMemoryClientStore

    owner = "algorithm plugin 'toy' (/x/toy.py)"
    memory = InMemoryClientStore(lambda: (torch.zeros(2), 0), owner=owner)
    memory.put(1, (torch.ones(2), 1))
    with pytest.raises(ClientStateError) as raised:
        memory.put(2, (torch.ones(2), 1.5))
    assert str(raised.value).startswith(
        f"the new state of client 2 (made by {owner}) cannot be stored: state[1] is a float, not an int as in the states stored before it; "
    )
    with pytest.raises(
        ClientStateError,
        match=r"client 3 .* state is a list, which a checkpoint cannot hold: .*; return a tuple instead",
    ):
        memory.put(3, [torch.ones(2)])
    disk = DiskClientStore(tmp_path, 4, (torch.zeros(2), 0), None, owner=owner)
    with pytest.raises(
        ClientStateError,
        match=r"client 0 \(made by algorithm plugin 'toy' .*\) .*state\[0\] is a float32 tensor of shape \(3,\)",
    ):
        disk.put(0, (torch.zeros(3), 0))


def test_a_field_that_starts_as_none_may_fill_in_on_the_memory_store_and_resumes(tmp_path):
    from driftlab.simulation.state.state_store import InMemoryClientStore

    memory = InMemoryClientStore(lambda: (None, 0))
    memory.put(0, (torch.zeros(2), 1))  # None in client_state_init's state: a checkpoint restores what was stored
    memory.put(1, (torch.zeros(2), 1))
    with pytest.raises(
        ClientStateError,
        match=r"state\[0\] is a float32 tensor of shape \(5,\), not a float32 tensor of shape \(2,\) as in the states stored before it",
    ):
        memory.put(2, (torch.zeros(5), 1))


def test_guarding_keeps_a_vmapped_loss_term_vmapped_and_every_number(fresh_registry, tmp_path, monkeypatch, caplog):
    moon = REPO_ROOT / "examples" / "moon" / "moon.py"
    overrides = [*TINY, f"plugins=['{moon}']", "algorithm.name=moon", "backend=vectorized"]
    with caplog.at_level(logging.WARNING):
        guarded_run = driftlab.run(None, overrides=overrides)
    assert not [record for record in caplog.records if "cannot be vmapped" in record.getMessage()]
    monkeypatch.setattr(registry, "is_plugin", lambda entry: False)
    plain = driftlab.run(None, overrides=overrides)
    assert torch.equal(guarded_run.final_params, plain.final_params)
    assert [r["train_loss"] for r in guarded_run.records if "train_loss" in r] == [
        r["train_loss"] for r in plain.records if "train_loss" in r
    ]


def test_clients_sharing_a_term_function_still_share_it_after_wrapping():
    from driftlab.algorithms import fedavg
    from driftlab.optim.server import make_server_optimizer
    from driftlab.simulation.backends.objectives import LocalObjective, LossTerm
    from driftlab.simulation.seam import ClientContext

    def term(batch, anchor):
        return anchor.sum()

    base = fedavg.build(make_server_optimizer("sgd"))
    bundle = dataclasses.replace(
        base, client_objective=lambda view, state, context: LocalObjective(loss_term=LossTerm(term, (view.params,)))
    )
    wrapped = guarded(bundle, "algorithm plugin 'x' (x.py)", "x")
    view = wrapped.broadcast(wrapped.server_init(torch.zeros(3)))
    first, second = (wrapped.client_objective(view, None, ClientContext(k, 1, 1, 1.0, 2, 1, 0.1)) for k in (0, 1))
    assert first.loss_term.function is second.loss_term.function is not term
    assert first.loss_term.function(None, torch.ones(3)) == 3.0  # the wrapper computes what the term does


def test_a_compressed_plugin_keeps_its_guard_and_its_name(fresh_registry, tmp_path):
    healthy = write_broken(tmp_path, "compressed_ok")
    result = run_plugin(healthy, "compressed_ok", "compression.ratio=0.3")
    same = driftlab.run(
        None, overrides=[*TINY, "algorithm.name=fedavg", "algorithm.incomplete=keep", "compression.ratio=0.3"]
    )
    assert torch.equal(result.final_params, same.final_params)
    path = write_broken(tmp_path, "compressed_fails", FAULTS["raises_in_client_finish"][0])
    with pytest.raises(
        PluginError, match=r"algorithm plugin 'compressed_fails' \(.*\) failed in client_finish \(client \d+, round 1\)"
    ):
        run_plugin(path, "compressed_fails", "compression.ratio=0.3")
    from driftlab.experiments.config import load_config
    from driftlab.experiments.run.assembly import build_algorithm
    from driftlab.simulation.backends.flat import FlatModel

    config = load_config(None, [f"plugins=['{healthy}']", "algorithm.name=compressed_ok", "compression.ratio=0.3"])
    compressed = build_algorithm(config, FlatModel.wrap(torch.nn.Linear(2, 1)))
    assert compressed.plugin == f"algorithm plugin 'compressed_ok' ({healthy.resolve()})"
