from __future__ import annotations

import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import driftlab
from driftlab.errors import ConfigError
from driftlab.experiments.config import load_config
from driftlab.experiments.run.assembly import build_simulation
from driftlab.experiments.run.loading import (
    final_state_dict,
    load_model,
    load_run,
    write_final_state_dict,
)
from driftlab.simulation.backends.flat import FlatModel

TINY = {"rounds": 2, "data": {"num_clients": 5}}


def flat(module: nn.Module) -> torch.Tensor:
    return FlatModel.wrap(module).initial_parameters()


def factory(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 7), nn.ReLU(), nn.Linear(7, num_classes))


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo") / "run"
    return out, driftlab.run(TINY, out_dir=out)


@pytest.fixture(scope="module")
def own_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("own") / "run"
    return out, driftlab.run(TINY, out_dir=out, model=factory)


def test_a_zoo_run_loads_as_its_module_with_the_final_weights_in_eval_mode(zoo_run):
    out, result = zoo_run
    module = load_model(out)
    assert not module.training
    assert torch.equal(flat(module), result.final_params)
    inputs = torch.randn(3, 60)
    assert torch.equal(module(inputs), FlatModel.wrap(module).forward(result.final_params, inputs))


def test_a_run_of_your_own_model_needs_it_again_and_says_so(own_run):
    out, result = own_run
    assert torch.equal(flat(load_model(out, model=factory)), result.final_params)
    given = factory((60,), 10)
    before = flat(given)
    assert torch.equal(flat(load_model(out, model=given)), result.final_params)
    assert torch.equal(flat(given), before)  # the module passed is copied, never changed
    with pytest.raises(ConfigError, match=r"model=your_factory_or_module") as refused:
        load_model(out)
    assert "1.weight" in str(refused.value) and "507" in str(refused.value)
    with pytest.raises(ConfigError, match=r"pass the module or factory the run was given"):
        load_model(out, model=lambda shape, k: nn.Linear(shape[0], k))


def test_the_state_dict_file_holds_the_modules_names_and_its_shapes(own_run, tmp_path):
    out, result = own_run
    model = FlatModel.wrap(factory((60,), 10))
    path = write_final_state_dict(tmp_path, model, result.final_params, (60,), 10)
    fresh = factory((60,), 10)
    fresh.load_state_dict(load_file(str(path)))  # plain torch reads it: the module's own names
    assert torch.equal(flat(fresh), result.final_params)
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata()["input_shape"] == "[60]" and handle.metadata()["num_classes"] == "10"


def test_tied_weights_get_the_trained_values_under_every_name():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encode = nn.Linear(2, 2, bias=False)
            self.decode = nn.Linear(2, 2, bias=False)
            self.decode.weight = self.encode.weight

    model = FlatModel.wrap(Tied())
    theta = torch.tensor([1.0, 2.0, 3.0, 4.0])
    state = final_state_dict(model, theta)
    assert set(state) == {"encode.weight", "decode.weight"}
    assert torch.equal(state["decode.weight"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert torch.equal(state["encode.weight"], state["decode.weight"])


def test_buffers_come_from_the_state_dict_file_when_the_run_wrote_one(tmp_path):
    def normed(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        return nn.Sequential(nn.Linear(input_shape[0], 4), nn.BatchNorm1d(4), nn.Linear(4, num_classes))

    out = tmp_path / "run"
    result = driftlab.run(TINY, out_dir=out, model=normed)
    module = normed((60,), 10)
    module[1].running_mean.fill_(0.5)  # buffers as a run that keeps them would save them
    write_final_state_dict(out, FlatModel.wrap(module), result.final_params, (60,), 10)
    loaded = load_model(out, model=normed)
    assert torch.equal(loaded[1].running_mean, torch.full((4,), 0.5))
    assert torch.equal(flat(loaded), result.final_params)


def test_a_factory_on_your_own_data_needs_no_data_once_the_shapes_are_recorded(tmp_path):
    generator = torch.Generator().manual_seed(0)
    arrays = driftlab.FederatedArrays(
        torch.randn(40, 3, generator=generator),
        torch.arange(40) % 2,
        torch.arange(40) % 4,
        torch.randn(8, 3, generator=generator),
        torch.arange(8) % 2,
    )
    out = tmp_path / "run"
    result = driftlab.run({"rounds": 1}, out_dir=out, data=arrays, model=factory)
    assert torch.equal(flat(load_model(out, model=factory)), result.final_params)  # the run recorded the shapes
    (out / "final_state_dict.safetensors").unlink()  # as a run written before that file existed
    with pytest.raises(ConfigError, match=r"data= the same data again"):
        load_model(out, model=factory)
    assert torch.equal(flat(load_model(out, model=factory, data=arrays)), result.final_params)
    write_final_state_dict(out, FlatModel.wrap(factory((3,), 2)), result.final_params, (3,), 2)
    assert torch.equal(flat(load_model(out, model=factory)), result.final_params)


def test_a_clients_own_model_comes_from_the_kept_checkpoint(tmp_path):
    out = tmp_path / "ditto"
    config = {**TINY, "keep_checkpoint": True, "algorithm": {"name": "ditto"}, "sampling": {"participation": 0.2}}
    driftlab.run(config, out_dir=out)
    stored = load_file(str(out / "checkpoint.safetensors"))
    trained = sorted(int(key.split("/")[1]) for key in stored if key.startswith("client/"))
    for client in trained:
        module = load_model(out, client=client)
        assert not module.training
        assert torch.equal(flat(module), stored[f"client/{client}/state/personal"])
    never = next(k for k in range(5) if k not in trained)
    initial = build_simulation(load_config(config))[0].initial_params
    assert torch.equal(flat(load_model(out, client=never)), initial)  # Ditto: an untrained client's v_k is θ⁰
    with pytest.raises(ConfigError, match=r"clients 0\.\.4"):
        load_model(out, client=5)


def test_a_client_model_is_refused_with_the_reason(zoo_run, tmp_path):
    out, _ = zoo_run
    with pytest.raises(ConfigError, match=r"keeps no client states.*keep_checkpoint = true"):
        load_model(out, client=0)
    kept = tmp_path / "fedavg"
    driftlab.run({**TINY, "keep_checkpoint": True}, out_dir=kept)
    with pytest.raises(ConfigError, match=r"keeps no per-client models.*apfl, ditto and fedamp"):
        load_model(kept, client=0)


def test_load_run_gives_the_config_run_json_and_records(zoo_run):
    out, result = zoo_run
    run = load_run(out)
    assert run.config == result.config
    assert run.info["status"] == "complete" and run.info["rounds_done"] == 2
    assert [dict(record) for record in run.records] == result.records
    frame = run.frame()
    assert frame["round"].tolist() == [1, 2]
    assert frame.columns[0] == "round" and "test_accuracy" in frame.columns
    with pytest.raises(TypeError):
        run.info["status"] = "edited"  # read-only


def test_frame_without_pandas_names_the_extra(zoo_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=r"pandas"):
        load_run(zoo_run[0]).frame()


def test_a_folder_without_a_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"not a driftlab run directory"):
        load_run(tmp_path)
    with pytest.raises(ConfigError, match=r"not a driftlab run directory"):
        load_model(tmp_path / "missing")


def test_a_run_without_its_final_model_says_how_to_finish_it(zoo_run, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(zoo_run[0], copy)
    (copy / "final_model.safetensors").unlink()
    before = {path.name: path.read_bytes() for path in copy.iterdir() if path.is_file()}
    with pytest.raises(ConfigError, match=r"--resume"):
        load_model(copy)
    assert {path.name: path.read_bytes() for path in copy.iterdir() if path.is_file()} == before  # nothing written


def test_a_clients_own_model_is_the_same_read_from_the_disk_store(tmp_path):
    config = {**TINY, "keep_checkpoint": True, "algorithm": {"name": "apfl"}}
    driftlab.run(config, out_dir=tmp_path / "memory")
    driftlab.run({**config, "state": {"store": "disk"}}, out_dir=tmp_path / "disk")
    assert (tmp_path / "disk" / "client_state").is_dir()
    for client in (0, 3):
        in_memory = flat(load_model(tmp_path / "memory", client=client))
        assert torch.equal(flat(load_model(tmp_path / "disk", client=client)), in_memory)
    assert not torch.equal(in_memory, flat(load_model(tmp_path / "memory")))  # APFL's mix is not the server model


def test_a_clients_own_model_of_your_own_module_needs_it_again(tmp_path):
    out = tmp_path / "ditto-own"
    driftlab.run({**TINY, "keep_checkpoint": True, "algorithm": {"name": "ditto"}}, out_dir=out, model=factory)
    with pytest.raises(ConfigError, match=r"checkpoint.safetensors has 507 parameters.*model=your_factory_or_module"):
        load_model(out, client=0)
    stored = load_file(str(out / "checkpoint.safetensors"))
    client = next(int(key.split("/")[1]) for key in stored if key.startswith("client/"))
    own = load_model(out, client=client, model=factory)
    assert torch.equal(flat(own), stored[f"client/{client}/state/personal"])
