"""Smoke tests of the round-speed benchmark script: it runs for every workload and reports every number (no timing assertions)."""

from __future__ import annotations

import json

import pytest
import round_speed  # benchmarks/ is on sys.path: pytest puts a test file's directory there
import torch
import workload_data

RESULT_FIELDS = {
    "row",
    "key",
    "clients_per_round",
    "median_seconds",
    "round_seconds",
    "ratio_to_reference",
    "speedup_vs_reference",
    "peak_rss_mb",
    "peak_rss_growth_mb",
    "gflops",
    "fraction_of_matmul",
}
# Forward FLOPs of one example (2 per multiply-add of the matmuls and convolutions), worked out by hand from the zoo's layers.
FORWARD_FLOPS = {
    # 784-8-10
    "mlp": 2 * (784 * 8 + 8 * 10),
    # conv 5x5 3→64 on 28x28 outputs, conv 5x5 64→64 on 10x10, fc 1600-384-192-10
    "cnn": 2 * (28 * 28 * 64 * 3 * 25 + 10 * 10 * 64 * 64 * 25 + 1600 * 384 + 384 * 192 + 192 * 10),
    # 80 steps of two LSTM layers (4 gates, inputs 8 then 100, hidden 100), then fc 100→80 on the last step
    "lstm": 2 * (80 * 4 * 100 * (8 + 100) + 80 * 4 * 100 * (100 + 100) + 100 * 80),
}


def quick_report(capsys, arguments: list[str]) -> dict:
    """Run the script's ``main`` in --quick mode and return the JSON object of its last printed line."""
    returned = round_speed.main(["--quick", "--rounds", "1", *arguments])
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads(last_line)
    assert report == json.loads(json.dumps(returned))
    return report


def test_quick_run_reports_every_row_and_number(capsys):
    report = quick_report(capsys, ["--num-clients", "3", "--samples", "20", "--hidden", "8"])
    assert {"machine", "device", "matmul_gflops", "data", "workload", "results"} <= set(report)
    assert report["data"] == "random" and report["matmul_gflops"] > 0
    assert report["workload"]["model"] == "mlp" and report["workload"]["hidden"] == [8]
    assert report["flops_per_example"] == 3 * FORWARD_FLOPS["mlp"]
    assert report["device"]["type"] == "cpu" and report["device"]["threads"] == torch.get_num_threads()
    assert {entry["key"] for entry in report["results"]} == {"vectorized", "sequential", "reference"}
    for entry in report["results"]:
        assert RESULT_FIELDS <= set(entry)
        assert entry["median_seconds"] > 0 and len(entry["round_seconds"]) == 1 and entry["clients_per_round"] == 2
    reference = next(entry for entry in report["results"] if entry["key"] == "reference")
    assert reference["ratio_to_reference"] == 1.0 and reference["speedup_vs_reference"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("model", ["cnn", "lstm", "resnet18_gn"])
def test_quick_run_of_each_model_prints_the_report_as_its_last_line(capsys, model):
    report = quick_report(capsys, ["--model", model])
    assert report["workload"]["model"] == model and report["workload"]["device"] == "cpu" and report["data"] == "random"
    assert [entry["key"] for entry in report["results"]] == ["vectorized", "sequential", "reference"]
    for entry in report["results"]:
        assert RESULT_FIELDS <= set(entry)
        assert entry["median_seconds"] > 0 and entry["speedup_vs_reference"] > 0 and entry["fraction_of_matmul"] > 0
    if model in FORWARD_FLOPS:
        assert report["flops_per_example"] == 3 * FORWARD_FLOPS[model]
    work = report["workload"]
    if model == "lstm":
        assert (work["local_steps"], work["local_epochs"]) == (2, None)
    else:
        assert (work["local_steps"], work["local_epochs"]) == (None, 1)


@pytest.mark.slow
def test_auto_and_vmap_rows_are_shown_when_asked(capsys):
    report = quick_report(
        capsys, ["--model", "cnn", "--rows", "auto,vmap,reference", "--num-clients", "2", "--samples", "10"]
    )
    assert [(entry["key"], entry["row"]) for entry in report["results"]] == [
        ("auto", "driftlab auto"),
        ("vmap", "driftlab vectorized (vmap path)"),
        ("reference", "PyTorch reference loop"),
    ]


def test_the_lstm_flop_count_sees_the_recurrent_matrix_products():
    spec = {"model": "lstm", "model_options": {}}
    assert round_speed.forward_flops_per_example(spec) == FORWARD_FLOPS["lstm"]


def test_driftlab_reads_back_exactly_the_cifar_rows_the_reference_trains_on(tmp_path):
    from driftlab.data.images import load_cifar_tensors

    arguments = round_speed.parse_arguments(["--quick", "--model", "cnn", "--num-clients", "3", "--samples", "4"])
    inputs, targets, kind = round_speed.load_training_data(arguments)
    assert kind == "random" and inputs.shape == (12, 3, 32, 32)
    workload_data.write_cifar10_directory(tmp_path, inputs, targets)
    train_x, train_y, test_x, _ = load_cifar_tensors(tmp_path, 10)
    assert torch.equal(train_y, targets) and len(test_x) == 12
    torch.testing.assert_close(train_x, inputs, rtol=0, atol=1e-6)


def test_driftlab_reads_back_exactly_the_shakespeare_windows_as_one_user_per_client(tmp_path):
    from driftlab.data.leaf import load_leaf_shakespeare

    arguments = round_speed.parse_arguments(["--quick", "--model", "lstm", "--num-clients", "3", "--samples", "5"])
    inputs, targets, _ = round_speed.load_training_data(arguments)
    workload_data.write_leaf_shakespeare_directory(tmp_path, inputs, targets, 3)
    dataset = load_leaf_shakespeare(tmp_path)
    assert dataset.num_clients == 3 and [len(rows) for rows in dataset.client_indices] == [5, 5, 5]
    order = torch.as_tensor([int(row) for rows in dataset.client_indices for row in rows])
    assert torch.equal(dataset.train_inputs[order].long(), inputs) and torch.equal(
        dataset.train_targets[order].long(), targets
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where CUDA is missing")
def test_device_cuda_without_cuda_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exited:
        round_speed.main(["--device", "cuda", "--quick"])
    captured = capsys.readouterr()
    assert exited.value.code == 2 and captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert "--device cuda" in captured.err and "no CUDA device" in captured.err and "--device cpu" in captured.err


def test_the_real_data_is_found_where_driftlab_finds_it(tmp_path, monkeypatch):
    # a copy carried to another machine (DRIFTLAB_DATA) is found as a run finds it, not only at ../shared/data
    (tmp_path / "mnist").mkdir()
    monkeypatch.setenv("DRIFTLAB_DATA", str(tmp_path))
    assert workload_data._shared_data("mnist") == tmp_path / "mnist"
    assert (
        workload_data._shared_data("tinyshakespeare")
        == workload_data.REPOSITORY.parent / "shared" / "data" / "tinyshakespeare"
    )
