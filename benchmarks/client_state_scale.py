"""Memory, round time and checkpoint cost of a stateful algorithm with many clients (issue 14).

    python benchmarks/client_state_scale.py --algorithm scaffold --clients 100000 --per-round 1000 --rounds 40

Workload: FedProx synthetic(1, 1) data, 60 features, 10 classes, each client
capped at ``--samples`` samples (default 10, 8 of them for training: one local
step of batch 10), and an MLP 60-2000-40-10 (202,450 parameters, 0.8 MB of
float32 state per client, the issue's MNIST-MLP state size) trained by
``--algorithm`` (scaffold or feddyn) through ``driftlab.run`` into a run
directory with ``checkpoint_every=--checkpoint-every``.  The client-state store
is ``--store`` (default auto: the disk store once N states exceed the memory
budget).  The run directory lives under ``--dir`` (default: the system's
temporary directory) and is removed when the script ends, unless ``--keep``.

The data are ``data.name = "synthetic"`` with ``data.samples_per_client =
--samples``, so the run's config.json describes them exactly.

Prints one line per round (round, distinct clients trained so far, round,
evaluation and checkpoint seconds, peak RSS), then, as its last line, one JSON
object: ``peak_rss_mb`` (the process's peak resident set),
``distinct_clients_trained``, ``median_round_seconds`` (a round's record time:
training, the server update and evaluation), ``median_evaluation_seconds`` and
``median_round_seconds_without_evaluation`` (evaluation covers every client's
test data, so it grows with the number of clients whatever the state store
does), ``median_round_wall_seconds`` (from one round's record to the next's:
the round, the commit of its client states to the store and, every
``checkpoint_every`` rounds, the checkpoint), ``median_checkpoint_seconds``,
``checkpoint_bytes_written`` (bytes of the checkpoint files written, summed over
checkpoints) and ``store_bytes_written`` (client-state rows the rounds wrote to
the store's files, which each checkpoint fsyncs), with the settings.

``--kill-at-checkpoint K`` also checks the resume at this scale: before the
measured run, a child process runs the same experiment and kills itself
(``os._exit``, no handler runs) in the middle of its K-th checkpoint, after the
new checkpoint file is written and before it replaces the old one; the run is
then resumed from what the kill left.  The JSON adds ``killed_resume_identical``:
whether the resumed run's final model and every metrics record (but round
times) equal the measured uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the driftlab of this checkout

import driftlab
from driftlab.experiments.run import lifecycle, runner
from driftlab.simulation.round import engine

ALGORITHMS = {
    "scaffold": ["algorithm.name=scaffold"],
    "feddyn": ["algorithm.name=feddyn", "algorithm.alpha=0.01"],
}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def overrides(args: argparse.Namespace) -> list[str]:
    settings = [
        *ALGORITHMS[args.algorithm],
        f"rounds={args.rounds}",
        f"seed={args.seed}",
        "data.name=synthetic",
        f"data.num_clients={args.clients}",
        f"data.samples_per_client={args.samples}",
        f"sampling.participation={args.per_round / args.clients}",
        "model.name=mlp",
        f"model.hidden=[{args.hidden}, 40]",
        "client.epochs=1",
        f"client.batch_size={args.samples}",
        "client.lr=0.05",
        f"checkpoint_every={args.checkpoint_every}",
        "keep_checkpoint=true",  # the store and the checkpoint are what is measured: kept when the run completes
        f"state.store={args.store}",
        f"evaluation.every={args.evaluate_every}",
        f"evaluation.model={args.evaluation_model}",
    ]
    if args.memory_budget:
        settings.append(f"memory_budget={args.memory_budget}")
    return settings


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithm", choices=sorted(ALGORITHMS), default="scaffold")
    parser.add_argument("--clients", type=int, default=2000)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--store", choices=("auto", "memory", "disk"), default="auto")
    parser.add_argument(
        "--memory-budget", default=None, help="bytes or \"4GB\"; default: driftlab's (half of the machine's memory)"
    )
    parser.add_argument("--samples", type=int, default=10, help="samples per client (80%% train)")
    parser.add_argument("--hidden", type=int, default=2000, help="first hidden width of the MLP 60-H-40-10")
    parser.add_argument("--evaluate-every", type=int, default=1)
    parser.add_argument("--evaluation-model", choices=("server", "all_clients_mean"), default="server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the run directory goes (default: the temporary directory)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    parser.add_argument(
        "--kill-at-checkpoint",
        type=int,
        default=None,
        metavar="K",
        help="first run the experiment in a child killed mid-way through its K-th checkpoint, resume it, "
        "and compare with the measured run",
    )
    parser.add_argument("--die-in-checkpoint", type=int, default=None, help=argparse.SUPPRESS)  # the children's sides
    parser.add_argument("--resume-digest", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.per_round <= args.clients:
        parser.error("--per-round must be between 1 and --clients")
    if args.die_in_checkpoint is not None:
        return _die_in_checkpoint(args)
    if args.resume_digest:
        print(
            _digest(driftlab.run(None, Path(os.environ["DRIFTLAB_SCALE_RUN"]), resume=True, overrides=overrides(args)))
        )
        return {}

    checkpoint_seconds: list[float] = []
    checkpoint_bytes: list[int] = []
    store_bytes = {"written": 0}
    original_checkpoint = lifecycle.write_checkpoint  # the lifecycle writes every run's checkpoints

    def timed_checkpoint(out: Path, *arguments: Any) -> None:
        """``write_checkpoint(out, config, ..., state)`` timed: its arguments passed on as they come, the state last."""
        state = arguments[-1]
        started = time.perf_counter()
        original_checkpoint(out, *arguments)
        checkpoint_seconds.append(time.perf_counter() - started)
        checkpoint_bytes.append((out / runner.CHECKPOINT_FILE).stat().st_size)
        stores = [s for s in (state.clients, state.latest_models) if s is not None and hasattr(s, "bytes_written")]
        store_bytes["written"] = sum(s.bytes_written for s in stores)

    evaluation_seconds: dict[str, float] = {"last": 0.0}
    original_evaluate = engine.evaluate

    def timed_evaluate(sim: Any, params: Any) -> dict[str, float]:
        started = time.perf_counter()
        metrics = original_evaluate(sim, params)
        evaluation_seconds["last"] += time.perf_counter() - started
        return metrics

    trained: set[int] = set()
    lines: list[dict[str, Any]] = []
    reported_at: list[float] = []

    def report(record: dict[str, Any]) -> None:
        reported_at.append(time.perf_counter())
        trained.update(record["reporting_clients"])
        line = {
            "round": record["round"],
            "distinct_clients": len(trained),
            "round_seconds": record["round_seconds"],
            "evaluation_seconds": evaluation_seconds["last"],
            "checkpoint_seconds": checkpoint_seconds[-1]
            if record["round"] % args.checkpoint_every == 0 or record["round"] == args.rounds
            else None,
            "peak_rss_mb": peak_rss_mb(),
        }
        lines.append(line)
        evaluation_seconds["last"] = 0.0
        checkpoint = "" if line["checkpoint_seconds"] is None else f"{line['checkpoint_seconds']:.2f}"
        print(
            f"{line['round']:>6} {line['distinct_clients']:>10} {line['round_seconds']:>9.2f} {line['evaluation_seconds']:>8.2f} "
            f"{checkpoint:>11} {line['peak_rss_mb']:>10.0f}",
            flush=True,
        )

    parent = Path(tempfile.mkdtemp(prefix="driftlab-client-state-scale-", dir=args.dir))
    resumed = None
    try:  # in child processes, so the measured run's peak RSS is its own
        if args.kill_at_checkpoint is not None:
            resumed = _killed_and_resumed(
                argv if argv is not None else sys.argv[1:], args.kill_at_checkpoint, parent / "killed"
            )
            shutil.rmtree(parent / "killed")  # its client states would double the disk the measured run needs
    except BaseException:
        shutil.rmtree(parent, ignore_errors=True)
        raise
    lifecycle.write_checkpoint, engine.evaluate = timed_checkpoint, timed_evaluate
    started = time.perf_counter()
    try:
        print(
            f"{'round':>6} {'distinct':>10} {'round_s':>9} {'eval_s':>8} {'checkpoint_s':>11} {'peak_rss_mb':>10}",
            flush=True,
        )
        measured = driftlab.run(None, parent / "run", overrides=overrides(args), progress=report)
        wall = time.perf_counter() - started
        state_dir = parent / "run" / runner.CLIENT_STATE_DIR
        store = "disk" if state_dir.exists() else "memory"
    finally:
        lifecycle.write_checkpoint, engine.evaluate = original_checkpoint, original_evaluate
        if args.keep:
            print(f"run directory kept: {parent / 'run'}", file=sys.stderr)
        else:
            shutil.rmtree(parent, ignore_errors=True)
    result = {
        "algorithm": args.algorithm,
        "clients": args.clients,
        "per_round": args.per_round,
        "rounds": args.rounds,
        "checkpoint_every": args.checkpoint_every,
        "store": store,
        "wall_seconds": wall,
        "store_bytes_written": store_bytes["written"],
        "peak_rss_mb": peak_rss_mb(),
        "distinct_clients_trained": len(trained),
        "median_round_seconds": statistics.median(line["round_seconds"] for line in lines),
        # From one round's record to the next's: everything a round costs, the commit of its client states included.
        "median_round_wall_seconds": statistics.median(b - a for a, b in itertools.pairwise(reported_at))
        if len(reported_at) > 1
        else None,
        "median_evaluation_seconds": statistics.median(line["evaluation_seconds"] for line in lines),
        "median_round_seconds_without_evaluation": statistics.median(
            line["round_seconds"] - line["evaluation_seconds"] for line in lines
        ),
        "median_checkpoint_seconds": statistics.median(checkpoint_seconds) if checkpoint_seconds else None,
        "checkpoint_bytes_written": sum(checkpoint_bytes),
    }
    if resumed is not None:
        result["killed_at_checkpoint"] = args.kill_at_checkpoint
        result["killed_resume_identical"] = resumed == _digest(measured)
    print(json.dumps(result))
    return result


def _digest(result: Any) -> str:
    """SHA-256 of a run's final model and its records without the round times."""
    records = [{k: v for k, v in record.items() if k != "round_seconds"} for record in result.records]
    digest = hashlib.sha256(result.final_params.cpu().numpy().tobytes())
    digest.update(json.dumps(records, sort_keys=True).encode())
    return digest.hexdigest()


def _killed_and_resumed(argv: list[str], checkpoint: int, out: Path) -> str:
    """Run the experiment in a child that dies in its ``checkpoint``-th checkpoint, resume it in another; the digest."""
    environment = {**os.environ, "DRIFTLAB_SCALE_RUN": str(out)}
    command = [sys.executable, __file__, *argv]
    killed = subprocess.run(
        [*command, "--die-in-checkpoint", str(checkpoint)], capture_output=True, text=True, env=environment
    )
    if killed.returncode != 3:
        raise SystemExit(
            f"the child run was to die in checkpoint {checkpoint} with exit 3, it exited {killed.returncode}:\n{killed.stderr[-2000:]}"
        )
    print(f"child run killed in checkpoint {checkpoint}; resuming it", flush=True)
    resumed = subprocess.run([*command, "--resume-digest"], capture_output=True, text=True, env=environment)
    if resumed.returncode != 0:
        raise SystemExit(f"the resumed run failed (exit {resumed.returncode}):\n{resumed.stderr[-2000:]}")
    return resumed.stdout.strip().splitlines()[-1]


def _die_in_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    from driftlab.simulation.state import checkpoint

    seen = {"count": 0}

    def die_when_written(stage: str) -> None:
        if stage == "written":  # the new file is complete but not yet renamed over the old one
            seen["count"] += 1
            if seen["count"] == args.die_in_checkpoint:
                os._exit(3)

    checkpoint._reached = die_when_written
    driftlab.run(None, Path(os.environ["DRIFTLAB_SCALE_RUN"]), overrides=overrides(args))
    raise SystemExit(
        f"the run ended before its checkpoint {args.die_in_checkpoint}: use a smaller --kill-at-checkpoint"
    )


if __name__ == "__main__":
    main()
