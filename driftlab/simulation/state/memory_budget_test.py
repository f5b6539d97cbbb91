"""The run's one memory budget: parsing, the shares it hands out, and a GPU split between processes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import driftlab
from driftlab.errors import ConfigError
from driftlab.simulation.state.memory_budget import (
    GPU_FRACTION,
    GPU_SHARE_VARIABLE,
    GpuMemory,
    MemoryBudget,
    gpu_chunk_bytes,
    gpu_share,
    parse_bytes,
    placed_bytes,
)

GIB = 2**30
PACKAGE = Path(driftlab.__file__).parent


def test_byte_counts_are_read_in_decimal_and_binary_units():
    assert parse_bytes("4GB") == 4 * 10**9 and parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes(512) == 512
    assert parse_bytes(" 200 kb ") == 200_000
    for bad in ("4XB", "-1", "", 0, True):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(ConfigError, match="memory_budget: expected a byte count"):
        driftlab.load_config(None, ["memory_budget=lots"])


def test_a_configured_budget_is_shared_out_to_stores_caches_waves_and_cpu_chunks():
    budget = MemoryBudget(80_000_000)
    assert budget.host_bytes == 80_000_000  # state.store=auto's threshold
    assert budget.round_bytes == 10_000_000  # an eighth: waves, and the CPU chunks inside them
    assert budget.cache_bytes(2) == 5_000_000 // 2  # a sixteenth, split between the two disk stores
    assert budget.chunk_bytes(torch.device("cpu")) == 10_000_000


def test_without_a_configured_budget_the_stores_take_half_the_machine_and_waves_a_fixed_gibibyte():
    budget = MemoryBudget(machine_bytes=64 * GIB)
    assert budget.host_bytes == 32 * GIB
    assert budget.round_bytes == GIB  # the same on every machine, so runs cut their rounds alike
    assert budget.cache_bytes(1) == 512 * 2**20  # a sixteenth of 32 GiB is 2 GiB: capped
    assert MemoryBudget(machine_bytes=64 * GIB).chunk_bytes(torch.device("cpu")) == GIB


def test_two_processes_sharing_a_gpu_plan_for_at_most_80_percent_of_it_together():
    total = 80 * GIB
    # Started together: each finds the GPU empty, and each plans for half of 80%, not 80% each.
    together = [gpu_chunk_bytes(total, free=total, share=2) for _ in range(2)]
    assert together == [int(0.4 * total)] * 2 and sum(together) <= GPU_FRACTION * total
    # One after the other: the second finds the first's memory taken, and still plans for no more than its half.
    first = gpu_chunk_bytes(total, free=total, share=2)
    second = gpu_chunk_bytes(total, free=total - first, share=2)
    assert first + second <= GPU_FRACTION * total
    # Any number of runs, with data resident on the GPU: their chunks and data together stay within 80%.
    for share in (1, 3, 4, 7):
        resident = GIB
        each = gpu_chunk_bytes(total, free=total, share=share, resident=resident)
        assert share * (each + resident) <= GPU_FRACTION * total + share  # + share: one byte of rounding each
    # What other programs held before the run started is not the run's: 80% of the free memory caps it.
    assert gpu_chunk_bytes(total, free=10 * GIB, share=1) == int(0.8 * 10 * GIB)
    assert gpu_chunk_bytes(total, free=total, share=1, resident=100 * GIB) == 0  # no room left: chunks of one client
    with pytest.raises(ValueError, match="share must be at least 1"):
        gpu_chunk_bytes(total, total, share=0)


def test_a_budget_hands_each_gpu_its_measured_share():
    gpus = (GpuMemory("cuda:0", 80_000_000, 80_000_000), GpuMemory("cuda:1", 40_000_000, 20_000_000))
    budget = MemoryBudget(gpus=gpus, gpu_share=2, gpu_resident=1_000_000)
    assert budget.chunk_bytes(torch.device("cuda:0")) == 32_000_000 - 1_000_000
    # 80% of 40 MB halved, below 80% of the 20 MB free
    assert budget.chunk_bytes(torch.device("cuda:1")) == 16_000_000 - 1_000_000
    assert budget.round_bytes == GIB  # the host's shares do not depend on the GPU


def test_the_gpu_share_is_read_from_the_environment_with_a_clear_error():
    assert gpu_share({}) == 1 and gpu_share({GPU_SHARE_VARIABLE: ""}) == 1
    assert gpu_share({GPU_SHARE_VARIABLE: "3"}) == 3 and gpu_share({GPU_SHARE_VARIABLE: " 2 "}) == 2
    for bad in ("0", "two", "-1", "1.5"):
        expected = rf"{GPU_SHARE_VARIABLE}='{bad}': expected how many runs share each GPU, a whole number"
        with pytest.raises(ConfigError, match=expected):
            gpu_share({GPU_SHARE_VARIABLE: bad})
    assert MemoryBudget.for_run(None, (torch.device("cpu"),), environ={GPU_SHARE_VARIABLE: "4"}).gpu_share == 4


def test_for_run_parses_the_setting_and_measures_no_gpu_on_a_cpu():
    budget = MemoryBudget.for_run("4GB", (torch.device("cpu"),), resident_bytes=123, environ={})
    assert budget == MemoryBudget(4 * 10**9, None, (), 1, 0)  # no GPU: nothing resident on one
    assert MemoryBudget.for_run(None, environ={}).configured is None
    with pytest.raises(ConfigError, match="memory_budget: expected a byte count"):
        MemoryBudget.for_run("lots", environ={})


def test_placed_bytes_count_floating_tensors_in_the_runs_dtype_and_integers_as_they_are():
    pixels, labels = torch.zeros(10, 3, dtype=torch.uint8), torch.zeros(10, dtype=torch.long)
    features = torch.zeros(10, 2)
    assert placed_bytes((pixels, labels, features), torch.float64) == 30 + 80 + 20 * 8
    assert placed_bytes((features,), torch.float32) == 80


def test_memory_budget_is_parsed_in_one_place_and_every_share_derives_from_the_simulations_budget():
    from driftlab.experiments.run.assembly import build_simulation
    from driftlab.simulation.round import engine

    sim, _ = build_simulation(driftlab.load_config(None, ["memory_budget=80MB", "backend=vectorized"]))
    assert sim.memory_budget == MemoryBudget(80_000_000, None, (), sim.memory_budget.gpu_share, 0)
    assert sim.backend.memory_budget is sim.memory_budget  # the chunks' budget is the run's
    params = sim.initial_params.numel() * sim.initial_params.element_size()
    assert engine.wave_size(sim, None) == sim.memory_budget.round_bytes // (5 * params)
    # No other module parses the setting: parse_bytes is called by the budget itself and the config's validator only.
    callers = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name.endswith("_test.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node.func, "id", getattr(node.func, "attr", None)) if isinstance(node, ast.Call) else None
            if name == "parse_bytes":
                callers.add(path.relative_to(PACKAGE).as_posix())
    assert callers == {"simulation/state/memory_budget.py", "experiments/config/schema.py"}


def test_the_stores_take_a_memory_budget_not_a_setting(tmp_path):
    from driftlab.simulation.round.setup import make_client_stores

    with pytest.raises(TypeError, match="memory_budget must be a MemoryBudget"):
        make_client_stores("auto", 10, torch.zeros(3), None, False, lambda: tmp_path, "4GB")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_run_measures_its_gpu_once_and_takes_its_share(monkeypatch):
    device = torch.device("cuda")
    alone = MemoryBudget.for_run(None, (device,), environ={})
    shared = MemoryBudget.for_run(None, (device,), environ={GPU_SHARE_VARIABLE: "2"})
    (gpu,) = alone.gpus
    free, total = torch.cuda.mem_get_info(device)
    assert gpu.device == f"cuda:{torch.cuda.current_device()}" and gpu.total == total
    assert alone.chunk_bytes(device) <= GPU_FRACTION * free + 2**26  # measured moments apart: 64 MiB of slack
    assert shared.chunk_bytes(device) <= GPU_FRACTION * total / 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 0))  # measured once: not asked again
    assert alone.chunk_bytes(device) == gpu_chunk_bytes(gpu.total, gpu.free)
