"""The layer-variants benchmark run with ``--quick`` on a CPU: every variant a CPU can run is checked, timed and reported
(no timing assertions; the numbers mean nothing here), and a variant that is wrong or raises is caught, not hidden."""

from __future__ import annotations

import json
import math

import layer_variants  # benchmarks/ is on sys.path: pytest puts a test file's directory there
import pytest
import torch

from driftlab.models import layers

VARIANT_FIELDS = {
    "key", "label", "description", "precision", "status", "tolerance", "gradient_tolerance", "median_seconds",
    "spread_seconds", "min_seconds", "max_seconds", "repeats", "speedup_vs_a", "max_relative_error",
    "gradient_relative_error", "tflops", "peak_memory_mb", "top_kernels",
}  # fmt: skip
KERNEL_FIELDS = {"name", "calls", "microseconds", "share"}


def quick_report(capsys, arguments: list[str]) -> dict:
    """``main`` with ``--quick --device cpu``; the JSON object of its last printed line (the same as it returns)."""
    returned = layer_variants.main(["--quick", "--device", "cpu", *arguments])
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads(last_line)
    assert report == json.loads(json.dumps(returned, default=str))
    return report


@pytest.mark.slow
def test_quick_run_checks_and_times_every_variant_a_cpu_can_run(capsys, tmp_path):
    report = quick_report(capsys, ["--json", str(tmp_path / "report.json"), "--profile-cpu", "--profile-top", "4"])
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert report["torch"] == torch.__version__ and report["device"] == report["device_details"]["name"]
    assert report["failures"] == [] and report["seconds"] > 0
    assert report["profile"] == {"activity": "cpu", "status": "ok"}
    expected = {("cnn", 2), ("cnn", 3), ("lstm", 2)}
    assert {(workload["workload"], workload["clients"]) for workload in report["workloads"]} == expected
    for workload in report["workloads"]:
        variants = layer_variants.CNN_VARIANTS if workload["workload"] == "cnn" else layer_variants.LSTM_VARIANTS
        assert [entry["key"] for entry in workload["variants"]] == [variant.key for variant in variants]
        assert workload["flops_per_step"] > 0 and workload["baseline_again"]["median_seconds"] > 0
        for variant, entry in zip(variants, workload["variants"], strict=True):
            assert set(entry) == VARIANT_FIELDS
            if variant.cuda_only:
                assert entry["status"] == "skipped: needs CUDA" and entry["median_seconds"] is None
                continue
            assert entry["status"] == "ok", entry
            assert entry["repeats"] == 3 and entry["min_seconds"] <= entry["median_seconds"] <= entry["max_seconds"]
            assert entry["spread_seconds"] >= 0 and entry["speedup_vs_a"] > 0 and entry["tflops"] > 0
            assert 0 <= entry["max_relative_error"] <= entry["tolerance"] == 1e-4
            assert 0 <= entry["gradient_relative_error"] <= entry["gradient_tolerance"]
            assert entry["peak_memory_mb"] is None
            # the profiled step's top CPU operators, costliest first, shares of the step's total
            kernels = entry["top_kernels"]
            assert 1 <= len(kernels) <= 4 and all(set(row) == KERNEL_FIELDS for row in kernels)
            assert [row["microseconds"] for row in kernels] == sorted(
                (row["microseconds"] for row in kernels), reverse=True
            )
            assert all(row["calls"] >= 1 for row in kernels) and 0 < sum(row["share"] for row in kernels) <= 1 + 1e-9
        baseline = workload["variants"][0]
        assert baseline["speedup_vs_a"] == 1.0 and baseline["max_relative_error"] > 0  # (a) against itself in float64
    assert layers.conv is not layers.conv_unfold and not torch.backends.cudnn.benchmark  # restored after the run
    assert layers._CONVOLUTION.get() == "grouped" and layers._RECURRENCE.get() == "fused"


def wrong_step(workload, leaves):
    """Variant (a) with every output 1% too large: must fail the float32 tolerance."""
    step = layer_variants.batched_step(workload, leaves)

    def scaled(inputs, targets):
        outputs, gradients = step(inputs, targets)
        return outputs * 1.01, gradients

    return scaled


def raising_step(workload, leaves):
    raise RuntimeError("out of memory, say")


def nan_step(workload, leaves):
    step = layer_variants.batched_step(workload, leaves)

    def with_nan(inputs, targets):
        outputs, gradients = step(inputs, targets)
        return outputs, [gradients[0].clone().fill_(math.nan), *gradients[1:]]

    return with_nan


def test_a_wrong_a_raising_and_a_nan_variant_are_reported_and_the_others_still_run(capsys, monkeypatch):
    variants = [
        layer_variants.CNN_VARIANTS[0],
        layer_variants.Variant("wrong", "(x)", "outputs 1% off", wrong_step),
        layer_variants.Variant("raises", "(y)", "raises", raising_step),
        layer_variants.Variant("nan", "(z)", "a NaN gradient", nan_step),
        layer_variants.CNN_VARIANTS[1],
    ]
    monkeypatch.setattr(layer_variants, "CNN_VARIANTS", variants)
    returned = layer_variants.main(
        ["--quick", "--device", "cpu", "--workloads", "cnn", "--clients", "2", "--repeats", "1"]
    )
    printed = capsys.readouterr().out.strip().splitlines()
    report = json.loads(printed[-1])
    assert report == json.loads(json.dumps(returned, default=str))
    # on a CPU without --profile-cpu the profile is skipped, and the output says why
    assert report["profile"]["status"].startswith("skipped: no CUDA device")
    assert printed[-2] == f"profile {report['profile']['status']}"
    entries = {entry["key"]: entry for entry in report["workloads"][0]["variants"]}
    assert all(entry["top_kernels"] is None for entry in entries.values())
    assert report["failures"] == ["cnn-2:wrong", "cnn-2:raises", "cnn-2:nan"]
    assert entries["wrong"]["status"].startswith("FAILED") and 9e-3 < entries["wrong"]["max_relative_error"] < 1.1e-2
    assert entries["raises"]["status"] == "ERROR: RuntimeError: out of memory, say"
    assert entries["nan"]["status"].startswith("FAILED") and math.isnan(entries["nan"]["gradient_relative_error"])
    assert entries["unfold"]["status"] == "ok" and entries["unfold"]["median_seconds"] > 0


@pytest.mark.parametrize(
    "variants, key, convolution, recurrence",
    [
        ("CNN_VARIANTS", "unfold", "unfold", "fused"),
        ("CNN_VARIANTS", "channels-last", "channels_last", "fused"),
        ("CNN_VARIANTS", "mixed", "mixed", "fused"),
        ("LSTM_VARIANTS", "bmm", "grouped", "steps"),
    ],
)
def test_variant_context_sets_the_convolution_and_recurrence_and_restores_them_after_an_error(
    variants, key, convolution, recurrence
):
    (variant,) = [variant for variant in getattr(layer_variants, variants) if variant.key == key]
    with pytest.raises(RuntimeError, match="inside"):
        with layer_variants.variant_context(variant, torch.device("cpu")):
            # layers.conv and layers.lstm_layer compute the variant's choices here
            assert (layers._CONVOLUTION.get(), layers._RECURRENCE.get()) == (convolution, recurrence)
            raise RuntimeError("inside")
    assert (layers._CONVOLUTION.get(), layers._RECURRENCE.get()) == ("grouped", "fused")


@pytest.mark.parametrize(
    "arguments, says",
    [
        (["--workloads", "cnn,gru"], "--workloads takes cnn and/or lstm"),
        (["--clients", "1"], "at least 2"),
        (["--image-size", "8"], "--image-size must be at least 16"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--profile-top", "-1"], "--profile-top must be 0 or more"),
    ],
)
def test_bad_arguments_say_what_is_wrong(capsys, arguments, says):
    with pytest.raises(SystemExit):
        layer_variants.parse_arguments(["--quick", "--device", "cpu", *arguments])
    assert says in capsys.readouterr().err
