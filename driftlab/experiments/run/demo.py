"""``driftlab demo``: every algorithm on FedProx's synthetic(1,1), one table and one plot.

The embedded default needs no files: FedProx's synthetic(1,1) (30 devices,
60 features, 10 classes, generated from the seed), multinomial logistic
regression, 20% participation.  Every algorithm runs on the same seed, so it
sees the same client samples and minibatches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from driftlab.experiments.config import load_config
from driftlab.experiments.run.runner import RunResult, run
from driftlab.owned_folder import claim, first_line

DEMO_BASE = "demo-synthetic"

# (label, overrides on the base preset). A new algorithm joins the demo with one line.
DEMO_RUNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("FedAvg", ("algorithm.name=fedavg",)),
    ("FedAdam", ("algorithm.name=fedavg", "server.optimizer=adam", "server.lr=0.03")),
    ("FedProx", ("algorithm.name=fedprox", "algorithm.mu=1")),
    ("SCAFFOLD", ("algorithm.name=scaffold",)),
    ("FedDyn", ("algorithm.name=feddyn", "algorithm.alpha=0.01")),
    ("AdaBest", ("algorithm.name=adabest", "algorithm.mu=0.02", "algorithm.beta=0.9")),
    ("EFL", ("algorithm.name=efl",)),
)


SUMMARY_FILE = "summary.md"
PLOT_FILE = "accuracy.png"
SUMMARY_HEADER = (
    "| algorithm | final acc |"  # how summary.md begins: a demo folder from before manifests is recognised by it
)


def run_demo(
    out_dir: str | Path = "driftlab-demo", overrides: tuple[str, ...] = (), progress: bool = True, force: bool = False
) -> list[tuple[str, RunResult]]:
    """Run every demo algorithm into ``out_dir/<label>``, then write ``summary.md`` and ``accuracy.png``.

    The demo writes only those names into ``out_dir``; one of them there that driftlab did not write stops it before
    any run, unless ``force`` (``driftlab.owned_folder``).  A run folder of an earlier demo is resumed or kept.
    """
    out = Path(out_dir)
    names = [SUMMARY_FILE, PLOT_FILE, *(label.lower() for label, _ in DEMO_RUNS)]
    claim(out, names, "driftlab demo", force=force, recognise=_earlier_demo)
    results = []
    for label, run_overrides in DEMO_RUNS:
        config = load_config(DEMO_BASE, [*run_overrides, *overrides])
        run_dir = out / label.lower()
        resume = (run_dir / "config.json").exists()  # a run of an earlier demo: finished (kept as is) or to continue
        results.append((label, run(config, run_dir, resume=resume, progress=progress, progress_label=label)))
    table = summary_table(results)
    (out / SUMMARY_FILE).write_text(table + "\n")
    plot_accuracy(results, out / PLOT_FILE)
    return results


def _earlier_demo(entry: Path) -> bool:
    """Whether ``entry`` is in a demo folder from before manifests: its summary.md is a demo's table, or it is a run."""
    return first_line(entry.parent / SUMMARY_FILE).startswith(SUMMARY_HEADER) or (entry / "config.json").is_file()


def _format(value: Any, spec: str) -> str:
    return "never" if value is None else format(value, spec)


def summary_table(results: list[tuple[str, RunResult]]) -> str:
    """A Markdown table: final and best accuracy, rounds, model-equivalents and bits to the target."""
    target = results[0][1].summary["target_accuracy"] if results else None
    goal = "target" if target is None else f"{target:.0%}"
    header = f"{SUMMARY_HEADER} best acc | rounds to {goal} | models up to {goal} | Mbit to {goal} | local steps |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for label, result in results:
        s = result.summary
        bits = None if s["bits_to_target"] is None else s["bits_to_target"] / 1e6
        lines.append(
            f"| {label} | {_format(s['final_accuracy'], '.3f')} | {_format(s['best_accuracy'], '.3f')} | "
            f"{_format(s['rounds_to_target'], 'd')} | {_format(s['models_to_target'], '.1f')} | {_format(bits, '.2f')} | {s['local_steps']} |"
        )
    return "\n".join(lines)


def plot_accuracy(results: list[tuple[str, RunResult]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for label, result in results:
        scored = [r for r in result.records if "test_accuracy" in r]
        axis.plot([r["round"] for r in scored], [r["test_accuracy"] for r in scored], label=label)
    target = results[0][1].summary["target_accuracy"] if results else None
    if target is not None:
        axis.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target:.0%}")
    axis.set_xlabel("communication round")
    axis.set_ylabel("test accuracy")
    axis.set_title("driftlab demo: synthetic(1,1), 30 clients, multinomial logistic regression")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
