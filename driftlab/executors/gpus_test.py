import pytest
import torch

from driftlab.errors import ConfigError
from driftlab.executors import gpus
from driftlab.executors.gpus import (
    GPU_SHARE_VARIABLE,
    GpuRequest,
    check_gpus,
    gpu_environment,
    gpu_request,
    gpu_shares,
    gpu_slots,
    next_to_start,
    parse_gpus,
    place,
    recorded_gpus,
    renumbered,
    visible_gpus,
)

CUDA = GpuRequest(1)
AUTO = GpuRequest(1, optional=True)
CPU = GpuRequest()


def test_a_device_asks_for_as_many_gpus_as_it_uses_and_names_one_only_alone():
    assert gpu_request({}) == gpu_request({"device": "cpu"}) == CPU
    assert gpu_request({"device": "cuda"}) == CUDA
    assert gpu_request({"device": "auto"}) == AUTO
    assert gpu_request({"device": "cuda:2"}) == GpuRequest(1, pinned=2)
    assert gpu_request({"device": "cuda:1,cuda:3"}) == GpuRequest(2)  # a list asks for two GPUs, any
    assert [r.device for r in (CPU, CUDA, AUTO, GpuRequest(1, pinned=2), GpuRequest(3))] == [
        "cpu",
        "cuda",
        "auto",
        "cuda:2",
        "cuda:0,cuda:1,cuda:2",
    ]


def test_a_worker_gets_its_device_numbered_from_its_own_first_gpu():
    assert renumbered({"device": "cuda", "seed": 1}, 1) == {"device": "cuda", "seed": 1}
    assert renumbered({"device": "auto"}, 1) == {"device": "auto"}
    assert renumbered({"device": "cuda:3"}, 1) == {"device": "cuda:0"}
    assert renumbered({"device": "cuda:2,cuda:5"}, 2) == {"device": "cuda:0,cuda:1"}
    unchanged = {"device": "cuda:0,cuda:1"}
    assert renumbered(unchanged, 2) is unchanged
    assert renumbered({"device": "cuda:3"}, 0) == {"device": "cuda:3"}  # given no GPU: left as it is


def test_gpus_are_all_none_or_a_list_and_anything_else_says_what_to_write():
    assert parse_gpus(None) is None and parse_gpus("all") is None and parse_gpus(" ALL ") is None
    assert parse_gpus("none") == parse_gpus("") == parse_gpus(()) == ()
    assert parse_gpus("0,2") == parse_gpus(" 0, 2 ") == parse_gpus([0, 2]) == (0, 2)
    assert parse_gpus(1) == (1,)
    for bad in ("0,x", "cuda:0", "-1", "0,,1", [True], [1.5]):
        with pytest.raises(
            ConfigError,
            match=r"--gpus .*: expected GPU indices such as 0,2 \(torch's numbering of the visible GPUs\), all",
        ):
            parse_gpus(bad)
    with pytest.raises(ConfigError, match=r"^--gpus 0,1,0 names GPU 0 more than once; name each GPU once$"):
        parse_gpus("0,1,0")


def test_a_gpu_this_machine_lacks_is_refused_and_the_machine_is_asked_only_for_a_list():
    def never():
        raise AssertionError("asked the machine for its GPUs")

    assert check_gpus(None, never) is None and check_gpus("none", never) == ()
    assert check_gpus("0,1", lambda: ("0", "1")) == (0, 1)
    with pytest.raises(
        ConfigError, match=r"^--gpus 0,3: this machine shows 2 GPU\(s\), numbered 0-1, so GPU 3 does not exist$"
    ):
        check_gpus("0,3", lambda: ("0", "1"))
    with pytest.raises(
        ConfigError, match=r"^--gpus 0: this machine shows no GPU torch can use, so GPU 0 does not exist$"
    ):
        check_gpus("0", lambda: ())


def test_the_visible_gpus_are_torch_s_count_named_as_cuda_visible_devices_names_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert visible_gpus({}) == ("0", "1", "2")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "4,6,7"}) == ("4", "6", "7")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a1, GPU-b2,GPU-c3,GPU-d4"}) == ("GPU-a1", "GPU-b2", "GPU-c3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert visible_gpus({}) == () == visible_gpus({"CUDA_VISIBLE_DEVICES": ""})


def test_single_gpu_runs_go_round_robin_over_the_sweep_s_gpus_in_its_order():
    assert place([CUDA] * 5, (0, 1)) == [(0,), (1,), (0,), (1,), (0,)]
    assert place([CUDA, CPU, AUTO, CUDA], (2, 0)) == [(2,), (), (0,), (2,)]  # --gpus 2,0: in that order
    assert place([CUDA] * 3, (1,)) == [(1,)] * 3
    assert place([CPU, AUTO], ()) == [(), ()]  # auto without a GPU runs on the CPU


def test_runs_on_several_gpus_take_the_least_loaded_and_pinned_or_resumed_runs_keep_theirs():
    two = GpuRequest(2)
    assert place([two, two, two], (0, 1, 2, 3)) == [(0, 1), (2, 3), (0, 1)]
    assert place([CUDA, two, CUDA], (0, 1, 2)) == [(0,), (1, 2), (0,)]
    # cuda:1 stays on GPU 1, counted before the others are placed round it
    assert place([CUDA, GpuRequest(1, pinned=1), CUDA, CUDA], (0, 1)) == [(0,), (1,), (0,), (1,)]
    # a resumed run goes back to the GPU it ran on; the new runs go first to the GPUs with fewer runs
    assert place([CUDA, CUDA, CUDA], (0, 1), recorded=[None, (0,), None]) == [(1,), (0,), (0,)]
    # a recorded placement that no longer fits (another count, a GPU --gpus leaves out) is placed again
    assert place([CUDA, two], (0, 1), recorded=[(5,), (1,)]) == [(0,), (0, 1)]


def test_a_run_the_sweep_s_gpus_cannot_hold_is_refused_before_any_starts():
    with pytest.raises(
        ConfigError,
        match=r"^run-b asks for a GPU \(device=cuda\), but this machine shows no GPU torch can use; set device=cpu, or auto "
        r"\(a GPU where there is one\)$",
    ):
        place([CPU, CUDA], (), labels=["run-a", "run-b"])
    with pytest.raises(
        ConfigError, match=r"^run 1 asks for a GPU \(device=cuda:1\), but --gpus none gives the sweep no GPU"
    ):
        place([GpuRequest(1, pinned=1)], (), why_none="--gpus none gives the sweep no GPU")
    with pytest.raises(
        ConfigError,
        match=r"^run 2 asks for 3 GPUs \(device=cuda:0,cuda:1,cuda:2\), but the sweep has 2 \(--gpus 0,1\); list fewer",
    ):
        place([CUDA, GpuRequest(3)], (0, 1))
    with pytest.raises(
        ConfigError,
        match=r"^run 1 names GPU 1 \(device=cuda:1\), which --gpus 0,2 leaves out; set device=cuda to let the sweep place it, or add 1",
    ):
        place([GpuRequest(1, pinned=1)], (0, 2))


def test_runs_on_one_gpu_split_that_gpu_and_no_other():
    placements = place([CUDA] * 5, (0, 1))  # 0, 1, 0, 1, 0
    assert gpu_shares(placements, jobs=5) == {0: 3, 1: 2}
    assert gpu_shares(placements, jobs=2) == {0: 1, 1: 1}  # 2 runs at once, one on each GPU: each has its GPU alone
    assert gpu_shares(placements, jobs=1) == {0: 1, 1: 1}
    assert gpu_shares(place([CUDA] * 40, (0, 1, 2, 3)), jobs=16) == {0: 4, 1: 4, 2: 4, 3: 4}  # not 10: 4 at once
    assert gpu_shares([(1,)] * 3, jobs=3) == {1: 3}  # three runs pinned to GPU 1: all three at once
    assert gpu_shares(place([CUDA] * 4, (0, 1)), jobs=4) == {0: 2, 1: 2}  # two runs on GPU 0: each plans for half of it
    visible = ("4", "6")
    shares = {0: 2, 1: 1}
    assert gpu_environment((0,), CUDA, visible, shares, {}) == {"CUDA_VISIBLE_DEVICES": "4", GPU_SHARE_VARIABLE: "2"}
    assert gpu_environment((1,), CUDA, visible, shares, {}) == {"CUDA_VISIBLE_DEVICES": "6"}  # alone on GPU 1
    # a run on both plans for the more shared one
    assert gpu_environment((0, 1), GpuRequest(2), visible, shares, {}) == {
        "CUDA_VISIBLE_DEVICES": "4,6",
        GPU_SHARE_VARIABLE: "2",
    }
    # a share given to the whole sweep (two sweeps on one GPU) is split further between its runs
    assert gpu_environment((0,), CUDA, visible, shares, {GPU_SHARE_VARIABLE: "2"})[GPU_SHARE_VARIABLE] == "4"
    # a CPU run is left alone; auto without a GPU is shown none, so that it runs on the CPU
    assert gpu_environment((), CPU, visible, shares, {}) == {}
    assert gpu_environment((), AUTO, visible, shares, {}) == {"CUDA_VISIBLE_DEVICES": ""}


def test_the_gpu_share_variable_is_the_one_the_memory_budget_reads():
    from driftlab.simulation.state.memory_budget import GPU_SHARE_VARIABLE as READ
    from driftlab.simulation.state.memory_budget import gpu_share

    assert GPU_SHARE_VARIABLE == READ
    assert gpu_share({GPU_SHARE_VARIABLE: "3"}) == 3


def test_a_recorded_placement_is_found_by_the_gpus_names():
    info = {gpus.PLACEMENT_KEY: {"gpus": [1], "cuda_visible_devices": "GPU-b", "gpu_names": ["X"]}}
    assert recorded_gpus(info, ("GPU-a", "GPU-b")) == (1,)
    assert recorded_gpus(info, ("GPU-b",)) == (0,)  # the sweep sees fewer GPUs now: the same GPU by its name
    assert recorded_gpus(info, ("GPU-a",)) is None  # not visible to this sweep
    two = {gpus.PLACEMENT_KEY: {"cuda_visible_devices": "2,3"}}
    assert recorded_gpus(two, ("0", "1", "2", "3")) == (2, 3) and recorded_gpus(two, ("0", "1", "2")) is None
    assert recorded_gpus(None, ("0",)) is recorded_gpus({}, ("0",)) is recorded_gpus({"placement": "x"}, ("0",)) is None


def test_no_gpu_runs_more_than_its_slots_and_a_waiting_run_is_not_overtaken_on_its_gpus():
    assert gpu_slots([(0,), (1,), (0,)], jobs=5) == 3 and gpu_slots([(0,), (1,)], jobs=4) == 2
    assert gpu_slots([(0,), (0,)], jobs=4) == 4 and gpu_slots([(), ()], jobs=3) == 3  # one GPU in use; none
    assert next_to_start([(0,), (1,)], {0: 1}, slots=1) == 1  # GPU 0 is full: the run on GPU 1 goes first
    assert next_to_start([(0,), (0,)], {0: 1}, slots=1) is None
    assert next_to_start([(0,), ()], {0: 1}, slots=1) == 1  # a CPU run starts whatever the GPUs hold
    # a run on GPUs 0 and 1 waits for GPU 0; a later run on GPU 1 does not take the slot it waits for
    assert next_to_start([(0, 1), (1,), (2,)], {0: 1}, slots=1) == 2
    assert next_to_start([(0, 1), (1,)], {}, slots=1) == 0
