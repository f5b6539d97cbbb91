"""Which implementation of each batched layer is fastest: one training step, variant by variant (issue 24).

The vectorized backend trains a chunk of ``C`` clients in one forward pass (``driftlab.models.layers``): a
convolution is ONE grouped convolution over ``[B, C·ch, H, W]``, an LSTM a Python loop of ``baddbmm`` cells.
On an H200 that reached 6x (10 clients) and 8x (100) the plain PyTorch loop for FedDyn's CIFAR CNN, and 0.44x a
per-client cuDNN loop for the Shakespeare LSTM.  This script times the candidates for each layer on the same
random clients and batches, so that one short GPU call says which to use.  Per workload and variant it times
one step: the batched (or per-client) forward, the summed cross-entropy of every client's batch against random
targets, and ``torch.autograd.grad`` of it with respect to every client's parameters.

Workloads (sizes are flags; these are the defaults):

* ``cnn``: FedDyn's CIFAR CNN (zoo ``cnn``, 3x32x32 inputs, 10 classes), batch 50 per client, at 10 and 100 clients:
  (a) ``grouped``: the zoo's batched forward as the backend runs it (``batched.feddyn_cnn``, grouped convolutions);
  (b) ``unfold``: the same forward with ``layers.conv_unfold`` (im2col + one ``bmm`` per client) in place of
  ``layers.conv`` (patched in this process while the variant runs, restored after);
  (c) ``loop``: client by client, the module's own forward through ``torch.func.functional_call`` and its backward;
  (d) ``grouped-bf16`` and ``unfold-bf16``: (a) and (b) under ``torch.autocast("cuda", bfloat16)`` (CUDA only);
  (e) ``grouped-cudnn-benchmark``: (a) with ``torch.backends.cudnn.benchmark = True`` (CUDA only; its warm-up
  steps include cuDNN's search);
  (f) ``channels-last``: (a) on channels-last tensors (``convolution("channels_last")``, the layout of cuDNN's
  tensor-core kernels);
  (g) ``mixed``: ``conv_unfold`` for the first layer (3 channels per client, tiny groups), grouped elsewhere
  (``convolution("mixed")``);
  (h) ``channels-last-bf16`` and ``mixed-bf16``: (f) and (g) under autocast bf16 (CUDA only).
* ``lstm``: FedDyn's Shakespeare LSTM (zoo ``lstm``: embedding 8, 2 layers of 100, vocabulary 80), 80-character
  windows, batch 50, at 10 clients:
  (a) ``bmm``: the batched recurrence with autograd's cell (``batched.char_rnn`` inside ``recurrence("steps")``, one
  ``baddbmm`` and about nine pointwise kernels per step and layer, twice that backward);
  (b) ``loop``: client by client, the module's own forward (``functional_call``; cuDNN's LSTM on a GPU, which
  repacks the swapped-in weights each call);
  (c) ``loop-modules``: client by client, one module per client with its weights packed once (``flatten_parameters``),
  as the plain-PyTorch reference loop of ``round_speed.py`` trains;
  (d) ``fused``: the batched recurrence as ``layers.LSTMRecurrence`` (the default, ``recurrence("fused")``): six
  pointwise kernels a step forward, four backward, and one weight-gradient product per layer;
  (e) ``fused-bf16``: (d) under autocast bf16 (CUDA only).

Method (/work/.library/device/METHOD.md): every float32 variant runs inside driftlab's ``local_arithmetic("float32")``
(on CUDA that turns TF32 off for matmuls and cuDNN convolutions, as a ``precision=float32`` run does); the bf16
ones inside ``local_arithmetic("bf16")``.  Each variant first runs once on fresh random inputs (never zeros) and
its outputs and gradients are compared with variant (a)'s on the same inputs by ``‖v − a‖ / ‖a‖`` (the largest
over the gradient leaves for ``gradient_relative_error``): float32 variants must agree to 1e-4 in outputs, bf16
ones to 2e-2; gradients only to 5e-2 and 0.3, which still catches a wrong layout (a ReLU or max-pool decision
within rounding of a tie flips between orders of summation: ``GRADIENT_TOLERANCE``); a NaN fails.  Row (a)
shows its own error against (a) in float64.  Then ``--warmup`` untimed steps and up to ``--repeats`` timed ones,
rotating over ``--input-sets`` input sets, each step between two ``torch.cuda.synchronize()`` (or on a CPU
between two ``perf_counter`` reads); a variant stops repeating once its timed steps pass
``--max-seconds-per-variant`` (3 at least).  Reported: the median, the spread (interquartile range), the
extremes, the speedup over (a) (median over median), TFLOP/s (3 x the forward FLOPs counted by
``FlopCounterMode`` for a CPU copy of one example, times the step's examples, over the median) and on
CUDA the peak memory.  At the end of each workload (a) is timed again (``baseline_again``): a difference between
variants smaller than the difference of (a)'s two timings is noise.  The whole run keeps to ``--budget``
seconds: a variant that would start past it is skipped, saying so.  A variant that raises (out of memory, say)
is recorded with its error and the rest still run.

Profile: on CUDA, after timing, one more step of each variant runs under ``torch.profiler`` (CUDA activity) and the
``--profile-top`` kernels by GPU time are printed per workload and variant (name, calls, microseconds, share of the
step's kernel time) and kept in the entry's ``top_kernels``.  On a CPU there are no kernels to list: the profile is
skipped, saying so, unless ``--profile-cpu`` asks for the top CPU operators instead (cheap; the test runs it).

Prints a short table, then ONE JSON line last: ``device`` (name), ``torch``, ``device_details``, ``settings``,
``workloads`` (each with its ``variants``: ``key``, ``label``, ``status``, ``median_seconds``, ``spread_seconds``,
``speedup_vs_a``, ``max_relative_error``, ``gradient_relative_error``, ``top_kernels``, ...), ``profile`` (what was
profiled, or why not), ``failures`` and ``seconds``.
Exit status 1 when a variant fails its tolerance or raises.

Usage:
    python benchmarks/layer_variants.py                          # cuda if present: cnn at 10 and 100 clients, lstm 10
    python benchmarks/layer_variants.py --device cpu --clients 10 --repeats 5
    python benchmarks/layer_variants.py --workloads lstm --lstm-clients 10 20
    python benchmarks/layer_variants.py --quick --device cpu     # tiny sizes, 3 repeats, seconds (the test runs this)
    python benchmarks/layer_variants.py --profile-top 15 --budget 120      # on a GPU: 15 kernels per variant
    python benchmarks/layer_variants.py --json $OUT/layer_variants.json   # the JSON line written to a file too
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))  # the driftlab of this checkout

from machine_info import device_description  # noqa: E402

from driftlab.models import batched, build_model, layers  # noqa: E402
from driftlab.simulation.backends.precision import local_arithmetic  # noqa: E402

TOLERANCE = {"float32": 1e-4, "bf16": 2e-2}  # outputs against variant (a)
# Gradients are checked loosely, to catch a wrong layout or a NaN (errors near 1 or above): where a ReLU input or two
# values of a max-pool window are within rounding of each other, two orders of summation can route a whole term
# differently, and a weight's gradient sums terms that largely cancel.  On a CPU (CNN, batch 50, random targets):
# float32 (a) against float64 gave 4e-7 on nine clients of ten and 1.4e-2 on the tenth (outputs: 5e-7); autocast
# bf16 against float32 gave 0.125-0.128 for conv1.weight (outputs: 4e-3 to 5e-3).
GRADIENT_TOLERANCE = {"float32": 5e-2, "bf16": 0.3}
Leaves = dict[str, torch.Tensor]
Step = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]


@dataclass(frozen=True)
class Workload:
    """One model at one number of clients: what every variant of it trains on."""

    name: str
    module: nn.Module
    clients: int
    batch: int
    example_shape: tuple[int, ...]
    classes: int
    batched_forward: Callable

    def inputs(self, generator: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh random ``[C, B, *example]`` inputs (character ids for the LSTM) and ``[C, B]`` targets."""
        shape = (self.clients, self.batch, *self.example_shape)
        if self.name == "lstm":
            inputs = torch.randint(0, self.classes, shape, generator=generator, device=device)
        else:
            inputs = torch.randn(shape, generator=generator, device=device)
        return inputs, torch.randint(0, self.classes, shape[:2], generator=generator, device=device)

    def leaves(self, generator: torch.Generator, device: torch.device) -> Leaves:
        """Every client's own parameters, ``[C, *shape]``: the module's initial values plus noise of their size."""
        leaves = {}
        for name, parameter in self.module.named_parameters():
            scale = parameter.detach().abs().mean()
            noise = torch.randn(self.clients, *parameter.shape, generator=generator, device=device)
            leaves[name] = (parameter.detach() + 0.5 * scale * noise).requires_grad_()
        return leaves


@dataclass(frozen=True)
class Variant:
    """One implementation of a workload's step: ``build(workload, leaves)`` gives ``step(inputs, targets)``."""

    key: str
    label: str
    description: str
    build: Callable[[Workload, Leaves], Step]
    precision: str = "float32"
    convolution: str = "grouped"  # layers.convolution(...) while the variant runs: "unfold" computes conv_unfold
    recurrence: str = "fused"  # layers.recurrence(...) while the variant runs: "steps" is autograd's LSTM cell
    cudnn_benchmark: bool = False
    cuda_only: bool = False


# ---------------------------------------------------------------- steps


def summed_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Every client's summed cross-entropy, in float32 (as under autocast), summed over clients."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]).float(), targets.reshape(-1), reduction="sum")


def batched_step(workload: Workload, leaves: Leaves) -> Step:
    """The zoo's batched forward for all clients at once, as ``StackedNetwork`` runs it, and one backward."""
    parameters = layers.Parameters(leaves, workload.clients)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        outputs = workload.batched_forward(workload.module, parameters, inputs)
        return outputs, list(torch.autograd.grad(summed_loss(outputs, targets), list(leaves.values())))

    return step


def loop_step(workload: Workload, leaves: Leaves) -> Step:
    """Client by client: the module's own forward with client ``k``'s parameters (``functional_call``), its backward."""

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        outputs, gradients = [], []
        for k in range(workload.clients):
            own = {name: leaf[k].detach().requires_grad_() for name, leaf in leaves.items()}
            out = torch.func.functional_call(workload.module, own, (inputs[k],))
            gradients.append(torch.autograd.grad(summed_loss(out, targets[k]), list(own.values())))
            outputs.append(out.detach())
        return torch.stack(outputs), [torch.stack(per_leaf) for per_leaf in zip(*gradients, strict=True)]

    return step


def modules_step(workload: Workload, leaves: Leaves) -> Step:
    """Client by client, one module per client holding its parameters (packed once for cuDNN), as a plain loop does."""
    modules = []
    for k in range(workload.clients):
        module = copy.deepcopy(workload.module)
        with torch.no_grad():
            for name, parameter in module.named_parameters():
                parameter.copy_(leaves[name][k])
        for sub in module.modules():
            if isinstance(sub, nn.RNNBase):
                sub.flatten_parameters()
        modules.append(module)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        outputs, gradients = [], []
        for k, module in enumerate(modules):
            out = module(inputs[k])
            gradients.append(torch.autograd.grad(summed_loss(out, targets[k]), list(module.parameters())))
            outputs.append(out.detach())
        return torch.stack(outputs), [torch.stack(per_leaf) for per_leaf in zip(*gradients, strict=True)]

    return step


CNN_VARIANTS = [
    Variant("grouped", "(a)", "batched forward, one grouped convolution", batched_step),
    Variant("unfold", "(b)", "batched forward, conv_unfold (im2col + bmm)", batched_step, convolution="unfold"),
    Variant("loop", "(c)", "per-client loop, functional_call", loop_step),
    Variant("grouped-bf16", "(d)", "(a) under autocast bf16", batched_step, precision="bf16", cuda_only=True),
    Variant(
        "unfold-bf16",
        "(d)",
        "(b) under autocast bf16",
        batched_step,
        precision="bf16",
        convolution="unfold",
        cuda_only=True,
    ),
    Variant(
        "grouped-cudnn-benchmark", "(e)", "(a) with cudnn.benchmark", batched_step, cudnn_benchmark=True, cuda_only=True
    ),
    Variant(
        "channels-last",
        "(f)",
        "batched forward, grouped convolutions on channels-last tensors",
        batched_step,
        convolution="channels_last",
    ),
    Variant("mixed", "(g)", "batched forward, conv_unfold for 3-channel layers", batched_step, convolution="mixed"),
    *(
        Variant(f"{key}-bf16", "(h)", f"{label} under autocast bf16", batched_step, "bf16", kind, cuda_only=True)
        for key, label, kind in (("channels-last", "(f)", "channels_last"), ("mixed", "(g)", "mixed"))
    ),
]
LSTM_VARIANTS = [
    Variant("bmm", "(a)", "batched recurrence, autograd's cell step by step", batched_step, recurrence="steps"),
    Variant("loop", "(b)", "per-client loop, functional_call (cuDNN on a GPU)", loop_step),
    Variant("loop-modules", "(c)", "per-client loop, own modules, packed weights", modules_step),
    Variant("fused", "(d)", "batched recurrence, LSTMRecurrence (layer-level backward)", batched_step),
    Variant("fused-bf16", "(e)", "(d) under autocast bf16", batched_step, precision="bf16", cuda_only=True),
]


@contextlib.contextmanager
def variant_context(variant: Variant, device: torch.device) -> Iterator[None]:
    """The arithmetic, the convolution (the config's ``convolution``), the recurrence and the cuDNN flag of
    ``variant``; everything restored on exit."""
    saved_benchmark = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = variant.cudnn_benchmark
        with (
            local_arithmetic(variant.precision, device),
            layers.convolution(variant.convolution),
            layers.recurrence(variant.recurrence),
            warnings.catch_warnings(),
        ):
            # cuDNN's LSTM repacks functional_call's swapped-in weights every call and says so: that cost is measured
            warnings.filterwarnings("ignore", message="RNN module weights are not part of single contiguous chunk")
            yield
    finally:
        torch.backends.cudnn.benchmark = saved_benchmark


# ---------------------------------------------------------------- measuring


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``‖value − reference‖ / ‖reference‖`` in float64 (NaN when either holds a NaN)."""
    value, reference = value.detach().double(), reference.detach().double()
    return ((value - reference).norm() / reference.norm()).item()


def errors(
    result: tuple[torch.Tensor, list[torch.Tensor]], reference: tuple[torch.Tensor, list[torch.Tensor]]
) -> tuple[float, float]:
    """The outputs' relative error and the largest of the gradient leaves' (NaN wins over any number)."""
    outputs, gradients = result
    gradient_errors = [relative_error(g, r) for g, r in zip(gradients, reference[1], strict=True)]
    worst = math.nan if any(math.isnan(e) for e in gradient_errors) else max(gradient_errors)
    return relative_error(outputs, reference[0]), worst


def timed_steps(
    step: Step, input_sets: list, device: torch.device, warmup: int, repeats: int, max_seconds: float
) -> list[float]:
    """Seconds of up to ``repeats`` steps after ``warmup`` untimed ones, rotating over ``input_sets``."""
    for index in range(warmup):
        step(*input_sets[index % len(input_sets)])
    seconds: list[float] = []
    for index in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        step(*input_sets[index % len(input_sets)])
        synchronize(device)
        seconds.append(time.perf_counter() - started)
        if len(seconds) >= 3 and sum(seconds) > max_seconds:
            break
    return seconds


def top_kernels(step: Step, inputs: tuple, device: torch.device, count: int) -> list[dict[str, Any]]:
    """The ``count`` costliest entries of one step under ``torch.profiler``: CUDA kernels by GPU time on a GPU, CPU
    operators by self CPU time elsewhere; each with its calls, microseconds and share of the step's total."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    synchronize(device)
    with profile(activities=activities) as profiler:
        step(*inputs)
        synchronize(device)
    events = profiler.key_averages()
    kernels = [event for event in events if event.device_type == DeviceType.CUDA] if on_gpu else events
    rows = [
        (event.key, event.count, event.self_device_time_total if on_gpu else event.self_cpu_time_total)
        for event in kernels or events  # should no event say it is a kernel, every one with its GPU time
    ]
    total = sum(micros for _, _, micros in rows) or 1.0
    rows.sort(key=lambda row: row[2], reverse=True)
    return [
        {"name": name, "calls": calls, "microseconds": micros, "share": micros / total}
        for name, calls, micros in rows[:count]
    ]


def summary(seconds: list[float]) -> dict[str, Any]:
    """Median, interquartile range, extremes and count of a variant's timed steps."""
    quartiles = statistics.quantiles(seconds, n=4, method="inclusive") if len(seconds) > 1 else [seconds[0]] * 3
    return {
        "median_seconds": statistics.median(seconds),
        "spread_seconds": quartiles[2] - quartiles[0],
        "min_seconds": min(seconds),
        "max_seconds": max(seconds),
        "repeats": len(seconds),
    }


def forward_flops_per_example(workload: Workload) -> float:
    """Forward FLOPs of one example (matrix products and convolutions), counted on a CPU copy of the module.

    oneDNN is off while counting, so that ``nn.LSTM`` runs as matrix products the counter sees.
    """
    from torch.utils.flop_counter import FlopCounterMode

    module = copy.deepcopy(workload.module).cpu()
    shape = (2, *workload.example_shape)
    example = torch.randint(0, workload.classes, shape) if workload.name == "lstm" else torch.randn(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about oneDNN's TF32 setting when its flags are touched
        with torch.no_grad(), torch.backends.mkldnn.flags(enabled=False), FlopCounterMode(display=False) as counter:
            module(example)
    return counter.get_total_flops() / 2


def empty_entry(variant: Variant, status: str) -> dict[str, Any]:
    entry = {
        "key": variant.key,
        "label": variant.label,
        "description": variant.description,
        "precision": variant.precision,
    }
    entry.update(
        {
            "status": status,
            "tolerance": TOLERANCE[variant.precision],
            "gradient_tolerance": GRADIENT_TOLERANCE[variant.precision],
        }
    )
    for field in (
        "median_seconds",
        "spread_seconds",
        "min_seconds",
        "max_seconds",
        "repeats",
        "speedup_vs_a",
        "max_relative_error",
        "gradient_relative_error",
        "tflops",
        "peak_memory_mb",
        "top_kernels",
    ):
        entry[field] = None
    return entry


def measure_variant(
    variant: Variant,
    workload: Workload,
    leaves: Leaves,
    check: tuple,
    reference: tuple | None,
    input_sets: list,
    device: torch.device,
    args: argparse.Namespace,
) -> tuple[dict[str, Any], tuple]:
    """Check ``variant`` against ``reference`` (variant (a)'s result on ``check``; ``None`` for (a) itself) and time it.

    Returns the entry and the variant's result on the check inputs.
    """
    entry = empty_entry(variant, "ok")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with variant_context(variant, device):
        step = variant.build(workload, leaves)
        result = step(*check)
        result = (result[0].detach(), [g.detach() for g in result[1]])
        if reference is None:  # (a) against itself in float64
            leaves64 = {name: leaf.detach().double().requires_grad_() for name, leaf in leaves.items()}
            inputs64 = check[0].double() if check[0].is_floating_point() else check[0]
            against = variant.build(workload, leaves64)(inputs64, check[1])
        else:
            against = reference
        output_error, gradient_error = errors(result, against)
        entry["max_relative_error"], entry["gradient_relative_error"] = output_error, gradient_error
        within = (
            output_error <= TOLERANCE[variant.precision] and gradient_error <= GRADIENT_TOLERANCE[variant.precision]
        )
        if not within:  # NaN compares False: it fails too
            entry["status"] = "FAILED: differs from (a) beyond the tolerance"
        entry.update(
            summary(timed_steps(step, input_sets, device, args.warmup, args.repeats, args.max_seconds_per_variant))
        )
        if profiled(device, args) is None:
            try:
                entry["top_kernels"] = top_kernels(step, input_sets[0], device, args.profile_top)
            except Exception as error:  # noqa: BLE001 - a profiler that cannot start must not cost the timings
                print(
                    f"profile of {workload.name}-{workload.clients}:{variant.key} failed: {type(error).__name__}: {error}"
                )
    if device.type == "cuda":
        entry["peak_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return entry, result


def run_workload(
    workload: Workload, variants: list[Variant], device: torch.device, args: argparse.Namespace, deadline: float
) -> dict[str, Any]:
    """Every variant of ``workload`` on the same clients and inputs, (a) first and again at the end."""
    generator = torch.Generator(device=device).manual_seed(args.seed + workload.clients)
    leaves = workload.leaves(generator, device)
    check = workload.inputs(generator, device)
    input_sets = [workload.inputs(generator, device) for _ in range(args.input_sets)]
    flops_per_step = 3 * forward_flops_per_example(workload) * workload.clients * workload.batch
    report: dict[str, Any] = {
        "workload": workload.name,
        "clients": workload.clients,
        "batch": workload.batch,
        "example_shape": list(workload.example_shape),
        "flops_per_step": flops_per_step,
        "variants": [],
    }
    reference = None
    for variant in variants:
        if variant.cuda_only and device.type != "cuda":
            report["variants"].append(empty_entry(variant, "skipped: needs CUDA"))
            continue
        if time.perf_counter() > deadline:
            report["variants"].append(empty_entry(variant, "skipped: out of the --budget"))
            continue
        try:
            entry, result = measure_variant(variant, workload, leaves, check, reference, input_sets, device, args)
        except Exception as error:  # noqa: BLE001 - one variant's failure (out of memory, say) must not cost the others
            entry, result = empty_entry(variant, f"ERROR: {type(error).__name__}: {str(error)[:300]}"), None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report["variants"].append(entry)
        if variant is variants[0]:
            reference = result
            if result is None:  # without (a) nothing can be compared: the rest would only fail
                report["variants"] += [empty_entry(v, "skipped: variant (a) failed") for v in variants[1:]]
                break
    baseline = report["variants"][0]
    for entry in report["variants"]:
        if entry["median_seconds"]:
            entry["tflops"] = flops_per_step / entry["median_seconds"] / 1e12
            if baseline["median_seconds"]:
                entry["speedup_vs_a"] = baseline["median_seconds"] / entry["median_seconds"]
    report["baseline_again"] = None
    if baseline["median_seconds"] and time.perf_counter() <= deadline:
        with variant_context(variants[0], device):
            step = variants[0].build(workload, leaves)
            report["baseline_again"] = summary(
                timed_steps(step, input_sets, device, args.warmup, args.repeats, args.max_seconds_per_variant)
            )
    return report


# ---------------------------------------------------------------- main


def profiled(device: torch.device, args: argparse.Namespace) -> str | None:
    """Why the variants are not profiled, or ``None`` when they are (on CUDA, or on a CPU with ``--profile-cpu``)."""
    if args.profile_top < 1:
        return "skipped: --profile-top 0"
    if device.type != "cuda" and not args.profile_cpu:
        return "skipped: no CUDA device, so no kernels to list (--profile-cpu lists the top CPU operators instead)"
    return None


def workloads(args: argparse.Namespace, device: torch.device) -> Iterator[tuple[Workload, list[Variant]]]:
    """The requested workloads, built on ``device`` one at a time (a workload's tensors are freed before the next)."""
    torch.manual_seed(args.seed)
    if "cnn" in args.workloads:
        shape = (3, args.image_size, args.image_size)
        module = build_model("cnn", shape, 10).to(device)
        for clients in args.clients:
            yield Workload("cnn", module, clients, args.batch, shape, 10, batched.feddyn_cnn), CNN_VARIANTS
    if "lstm" in args.workloads:
        module = build_model("lstm", (args.window,), 80, rnn_hidden=args.lstm_hidden).to(device)
        for clients in args.lstm_clients:
            yield Workload("lstm", module, clients, args.batch, (args.window,), 80, batched.char_rnn), LSTM_VARIANTS


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 3 repeats: a smoke run in seconds on a CPU")
    parser.add_argument("--workloads", default="cnn,lstm", help="comma-separated, among cnn and lstm")
    parser.add_argument("--clients", type=int, nargs="+", default=None, help="cnn clients (default 10 100; quick 2 3)")
    parser.add_argument("--lstm-clients", type=int, nargs="+", default=None, help="lstm clients (default 10; quick 2)")
    parser.add_argument("--batch", type=int, default=None, help="examples per client (default 50; quick 4)")
    parser.add_argument(
        "--image-size", type=int, default=None, help="cnn input height and width (default 32; quick 16)"
    )
    parser.add_argument("--window", type=int, default=None, help="lstm characters per example (default 80; quick 6)")
    parser.add_argument("--lstm-hidden", type=int, default=None, help="lstm hidden units (default 100; quick 8)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed steps per variant at most (default 20; quick 3)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps before them (default 3; quick 1)")
    parser.add_argument("--input-sets", type=int, default=3, help="random input sets the timed steps rotate over")
    parser.add_argument(
        "--max-seconds-per-variant",
        type=float,
        default=3.0,
        help="a variant stops repeating past this (3 steps at least)",
    )
    parser.add_argument(
        "--budget", type=float, default=90.0, help="seconds; variants that would start later are skipped"
    )
    parser.add_argument(
        "--profile-top", type=int, default=10, help="kernels listed per variant from a profiled step (0: no profile)"
    )
    parser.add_argument(
        "--profile-cpu", action="store_true", help="on a CPU, profile CPU operators (otherwise the profile is skipped)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    defaults = {
        "clients": ([2, 3], [10, 100]),
        "lstm_clients": ([2], [10]),
        "batch": (4, 50),
        "image_size": (16, 32),
        "window": (6, 80),
        "lstm_hidden": (8, 100),
        "repeats": (3, 20),
        "warmup": (1, 3),
    }
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.workloads = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = sorted(set(args.workloads) - {"cnn", "lstm"})
    if unknown or not args.workloads:
        parser.error(f"--workloads takes cnn and/or lstm, comma-separated; got {unknown or 'none'}")
    if args.profile_top < 0:
        parser.error(f"--profile-top must be 0 or more, got {args.profile_top}")
    for name in ("batch", "image_size", "window", "lstm_hidden", "repeats", "input_sets"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if min(args.clients + args.lstm_clients) < 2:
        parser.error("--clients and --lstm-clients must be at least 2 (a batched forward of one client is the loop)")
    if args.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {args.warmup}")
    if args.image_size < 16:
        parser.error(
            f"--image-size must be at least 16 (FedDyn's CNN pools twice after two 5x5 convolutions), "
            f"got {args.image_size}"
        )
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but this torch sees no CUDA device; use --device cpu")
    return args


def fmt(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:.{digits}g}"


def print_table(report: dict[str, Any]) -> None:
    print(f"{report['device']}, torch {report['torch']}")
    header = (
        f"{'workload':<9}{'C':>5}  {'variant':<25}{'median ms':>10}{'IQR ms':>9}{'vs (a)':>8}{'TFLOP/s':>9}"
        f"{'out err':>10}{'grad err':>10}{'peak MB':>9}  status"
    )
    print(header)
    for workload in report["workloads"]:
        rows = [(f"{v['label']} {v['key']}", v) for v in workload["variants"]]
        if workload["baseline_again"]:
            again = dict.fromkeys(
                ("speedup_vs_a", "tflops", "max_relative_error", "gradient_relative_error", "peak_memory_mb")
            )
            rows.append(("(a) again", {**again, **workload["baseline_again"], "status": "noise check"}))
        for name, v in rows:
            print(
                f"{workload['workload']:<9}{workload['clients']:>5}  {name:<25}{fmt(v['median_seconds'], 1e3):>10}"
                f"{fmt(v['spread_seconds'], 1e3, 2):>9}{fmt(v['speedup_vs_a'], 1, 3):>8}{fmt(v['tflops'], 1, 3):>9}"
                f"{fmt(v['max_relative_error'], 1, 2):>10}{fmt(v['gradient_relative_error'], 1, 2):>10}"
                f"{fmt(v['peak_memory_mb'], 1, 5):>9}  {v['status']}"
            )


def print_profiles(report: dict[str, Any]) -> None:
    """Each profiled variant's top kernels (or CPU operators), workload by workload; or why there are none."""
    profile = report["profile"]
    if profile["status"] != "ok":
        print(f"profile {profile['status']}")
        return
    for workload in report["workloads"]:
        for variant in workload["variants"]:
            if not variant["top_kernels"]:
                continue
            print(
                f"top {profile['activity']} {'kernels' if profile['activity'] == 'cuda' else 'operators'}: "
                f"{workload['workload']}, {workload['clients']} clients, {variant['label']} {variant['key']}"
            )
            for row in variant["top_kernels"]:
                print(f"  {row['share']:6.1%} {row['microseconds']:10.0f} us {row['calls']:6d}x  {row['name'][:100]}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_arguments(argv)
    device = torch.device(args.device)
    started = time.perf_counter()
    deadline = started + args.budget
    details = device_description(args.device)
    report: dict[str, Any] = {
        "device": details["name"],
        "torch": torch.__version__,
        "device_details": details,
        "settings": {name: value for name, value in vars(args).items() if name != "json"},
        "profile": {"activity": device.type, "status": profiled(device, args) or "ok"},
        "workloads": [],
    }
    for workload, variants in workloads(args, device):
        report["workloads"].append(run_workload(workload, variants, device, args, deadline))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["failures"] = [
        f"{w['workload']}-{w['clients']}:{v['key']}"
        for w in report["workloads"]
        for v in w["variants"]
        if v["status"].startswith(("FAILED", "ERROR"))
    ]
    report["seconds"] = time.perf_counter() - started
    print_table(report)
    print_profiles(report)
    line = json.dumps(report, default=str)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(line + "\n")
    print(line)
    return report


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
