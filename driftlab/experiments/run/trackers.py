"""Experiment trackers (TensorBoard, Weights & Biases, MLflow) fed from the records that go to metrics.jsonl.

``log = ["tensorboard", "wandb", "mlflow"]`` in a config (or ``--log`` on ``driftlab run``
and ``driftlab sweep``) sends every round's record, the one appended to metrics.jsonl,
to each tracker: its numeric fields as scalars at step = round (``round`` itself and
list fields such as ``reporting_clients`` are left out), and the resolved config as
hyperparameters.  What a tracker shows is therefore what a report reads.

Where each one writes (inside the run directory DIR unless the tool's own setting says otherwise):

    tensorboard   DIR/tensorboard/             ``tensorboard --logdir DIR`` (or a sweep's directory: one run per folder)
    wandb         DIR/wandb/ (or $WANDB_DIR)   project $WANDB_PROJECT (default driftlab); WANDB_MODE=offline
                                               then ``wandb sync DIR/wandb/offline-run-*``
    mlflow        DIR/mlruns/ (file store)     or $MLFLOW_TRACKING_URI; experiment $MLFLOW_EXPERIMENT_NAME (default driftlab)

A tracker run is identified by the run directory: ``run_key`` hashes its absolute path
and the config fingerprint, so a resumed run continues the same tracker run (the W&B
run id; an MLflow run tagged ``driftlab_run_key``; TensorBoard's folder) and a moved or
copied directory starts a new tracker run (into which everything is replayed).

Each round is logged exactly once, also after a kill at any moment, because a resume
first brings the tracker in line with metrics.jsonl (the records up to the checkpoint)
and rounds after the checkpoint are recomputed identically (wall-clock fields aside):

- TensorBoard: a resumed run's writer purges every earlier event (``purge_step=0``:
  TensorBoard's event reader drops the folder's events at or after that step when it
  meets the new file, which sorts last) and replays the kept records, so the visible
  events are exactly the records of metrics.jsonl, then the new rounds.
- MLflow: for each metric, the last step the run holds is read back; a round is logged
  only past it.  Rounds logged before a kill keep their first values (identical but
  for ``round_seconds``).
- W&B: a round is logged only past the last step the run holds: the resumed run's
  starting step online (``resume="allow"``; W&B also drops a step that does not
  increase), and offline the history records of the run's earlier offline folders
  (read from their ``.wandb`` files), all under the same run id for ``wandb sync``.

Only a run that grows past its old last round may keep, in MLflow and W&B, that
round's evaluation (metrics.jsonl drops it: with more rounds the round is no longer
evaluated).  The packages are extras: ``pip install -e ".[tensorboard]"`` from the checkout, and so on.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from driftlab.experiments.config import ConfigError, ExperimentConfig
from driftlab.extras import install_hint

TRACKERS = ("tensorboard", "wandb", "mlflow")
# The module each tracker imports; the extra of the same name installs it.
_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
# Keys whose change keeps the run's identity (ExperimentConfig.fingerprint ignores them): MLflow gets them as tags,
# since its parameters cannot change.
_MUTABLE_KEYS = ("rounds", "checkpoint_every", "device", "log")


def parse_tracker_list(text: str) -> tuple[str, ...]:
    """``--log tensorboard,mlflow`` as a tuple; ``none`` (or nothing) turns logging off."""
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if names in ((), ("none",)):
        return ()
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ConfigError(
            f"--log takes a comma-separated list of {', '.join(TRACKERS)} (or none), got {', '.join(map(repr, unknown))}"
        )
    return names


def check_trackers_installed(names: Sequence[str]) -> None:
    """ConfigError, before any work, naming the extra of each tracker whose package is missing."""
    missing = [name for name in dict.fromkeys(names) if importlib.util.find_spec(_MODULES[name]) is None]
    if missing:
        raise ConfigError(
            f"log={list(dict.fromkeys(names))}: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; "
            f"{install_hint(*missing)} (or drop {', '.join(missing)} from log / --log)"
        )


def run_key(out: Path, config: ExperimentConfig) -> str:
    """The tracker run's identity: the run directory's absolute path and the config fingerprint (16 hex digits)."""
    return hashlib.sha256(f"{Path(out).resolve()}\0{config.fingerprint()}".encode()).hexdigest()[:16]


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers except ``round`` (the step); lists, strings and booleans are not scalars."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "round" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


def flat_config(config: ExperimentConfig) -> dict[str, Any]:
    """The resolved config as ``section.key`` -> number, string or bool; lists and empty tables as JSON text."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        elif isinstance(value, (int, float, str, bool)):
            flat[prefix] = value
        else:
            flat[prefix] = json.dumps(value)

    walk("", config.to_dict())
    return flat


@dataclass
class Trackers:
    """The open trackers of one run: ``log_round`` after each recorded round, ``close`` once at the end."""

    runs: list[Any]

    def log_round(self, record: dict[str, Any]) -> None:
        for tracker in self.runs:
            tracker.log_round(record)

    def close(self, status: str) -> None:
        """Tell each tracker the run's ``status`` (complete, interrupted, diverged, failed). Never raises, only warns:
        every round already reached the tracker, and the run's own files or error come first."""
        for tracker in self.runs:
            try:
                tracker.close(status)
            except Exception as error:  # noqa: BLE001
                warnings.warn(f"closing the {type(tracker).__name__.strip('_')} tracker failed: {error}", stacklevel=2)


def open_trackers(out: Path, config: ExperimentConfig, records: Sequence[dict[str, Any]]) -> Trackers:
    """Open every tracker of ``config.log`` for the run in ``out`` and bring each in line with ``records``
    (metrics.jsonl up to the checkpoint), logging the rounds it lacks."""
    check_trackers_installed(config.log)
    key = run_key(out, config)
    opened = Trackers([])
    try:
        for name in dict.fromkeys(config.log):
            try:
                opened.runs.append(_OPENERS[name](Path(out), config, key, records))
            except (ConfigError, KeyboardInterrupt):
                raise
            except Exception as error:
                reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300].rstrip(".")
                raise ConfigError(
                    f"cannot open the {name} tracker for {out}: {reason}{_ADVICE.get(name, '')}"
                ) from error
    except BaseException:
        opened.close("failed")
        raise
    return opened


_ADVICE = {
    "wandb": "; log in with `wandb login`, or set WANDB_MODE=offline to write the run to DIR/wandb and `wandb sync` it later",
    "mlflow": "; check MLFLOW_TRACKING_URI (unset, driftlab writes a file store in DIR/mlruns)",
}


# ---------------------------------------------------------------- TensorBoard


class _TensorBoard:
    def __init__(self, out: Path, config: ExperimentConfig, key: str, records: Sequence[dict[str, Any]]) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        folder = out / "tensorboard"
        earlier = list(folder.glob("events.out.tfevents.*")) if folder.is_dir() else []
        if earlier:
            _wait_past_second(max(_event_file_second(p) for p in earlier))
        # purge_step=0 hides every event an earlier process wrote (TensorBoard reads the folder's files in name
        # order, which starts with the creation second); the kept records are then replayed.
        self.writer = SummaryWriter(str(folder), purge_step=0 if earlier else None)
        from driftlab.simulation.evaluation import EVALUATION_KEYS

        # The HParams dashboard's columns: the evaluation series this folder's scalars hold (the values come from them).
        for summary in hparams(flat_config(config), {name: 0.0 for name in EVALUATION_KEYS}):
            self.writer.file_writer.add_summary(summary, 0)
        self.writer.add_text("config", "```\n" + json.dumps(config.to_dict(), indent=2) + "\n```", 0)
        self.writer.add_text("run_key", key, 0)
        for record in records:
            self._add(record)
        self.writer.flush()

    def _add(self, record: dict[str, Any]) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, record["round"])

    def log_round(self, record: dict[str, Any]) -> None:
        self._add(record)
        self.writer.flush()

    def close(self, status: str) -> None:  # noqa: ARG002
        self.writer.close()


def _event_file_second(path: Path) -> int:
    match = re.match(r"events\.out\.tfevents\.(\d+)\.", path.name)
    return int(match.group(1)) if match else 0


def _wait_past_second(second: int) -> None:
    """Sleep until the clock is past ``second``, so a new event file sorts after the earlier ones (at most 2 s:
    a file from further ahead comes from a clock that disagrees with ours, which waiting cannot mend)."""
    if second + 1 - time.time() > 2:
        warnings.warn(
            f"an event file in the TensorBoard folder is dated {second}, ahead of this machine's clock; TensorBoard may show stale points",
            stacklevel=3,
        )
        return
    while time.time() < second + 1:
        time.sleep(second + 1 - time.time() + 0.01)


# ---------------------------------------------------------------- MLflow


_MLFLOW_BATCH = 1000  # MLflow's limit of metrics per log_batch


class _MLflow:
    def __init__(self, out: Path, config: ExperimentConfig, key: str, records: Sequence[dict[str, Any]]) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (out / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store unless asked: it is what works without a server or database.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment_id = _mlflow_experiment(self.client, os.environ.get("MLFLOW_EXPERIMENT_NAME") or "driftlab")
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.driftlab_run_key = '{key}'", max_results=1
        )
        if found:
            run = found[0]
            self.client.update_run(run.info.run_id, status="RUNNING")
        else:
            run = self.client.create_run(
                experiment_id, run_name=str(out), tags={"driftlab_run_key": key, "driftlab_run_dir": str(out.resolve())}
            )
        self.run_id = run.info.run_id
        self.resumed = bool(found)
        flat = flat_config(config)
        held = run.data.params
        params = [
            Param(name, str(value)[:6000])
            for name, value in flat.items()
            if name.split(".")[0] not in _MUTABLE_KEYS and name not in held
        ]
        tags = [
            RunTag(f"driftlab.{name}", str(value))
            for name, value in flat.items()
            if name.split(".")[0] in _MUTABLE_KEYS
        ]
        for start in range(
            0, max(len(params), len(tags), 1), 100
        ):  # MLflow takes at most 100 params and 100 tags a call
            self.client.log_batch(self.run_id, params=params[start : start + 100], tags=tags[start : start + 100])
        self.last_step: dict[str, int] = {}
        pending = [metric for record in records for metric in self._new_metrics(record)]
        for start in range(0, len(pending), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=pending[start : start + _MLFLOW_BATCH])

    def _new_metrics(self, record: dict[str, Any]) -> list[Any]:
        """The record's scalars that the run does not hold yet (a step past the last one it holds for that key)."""
        from mlflow.entities import Metric

        step = record["round"]
        now = int(time.time() * 1000)
        metrics = []
        for name, value in scalars(record).items():
            if name not in self.last_step:
                history = self.client.get_metric_history(self.run_id, name) if self.resumed else []
                self.last_step[name] = max((m.step for m in history), default=0)
            if step > self.last_step[name]:
                metrics.append(Metric(name, value, now, step))
                self.last_step[name] = step
        return metrics

    def log_round(self, record: dict[str, Any]) -> None:
        metrics = self._new_metrics(record)
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, {"complete": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED"))


def _mlflow_experiment(client: Any, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:
        experiment = client.get_experiment_by_name(name)  # another run of the sweep created it meanwhile
        if experiment is None:
            raise
        return experiment.experiment_id


# ---------------------------------------------------------------- Weights & Biases


class _WandB:
    def __init__(self, out: Path, config: ExperimentConfig, key: str, records: Sequence[dict[str, Any]]) -> None:
        import wandb

        where = Path(os.environ.get("WANDB_DIR") or out)
        where.mkdir(parents=True, exist_ok=True)
        offline_last = wandb_logged_steps(where / "wandb", key)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "driftlab",
            id=key,
            name=str(out),
            resume="allow",
            dir=str(where),
        )
        self.run.config.update(config.to_dict(), allow_val_change=True)
        online_last = (self.run.starting_step or 0) - 1 if self.run.resumed else 0
        self.last_step = max(max(offline_last, default=0), online_last, 0)
        for record in records:
            self.log_round(record)

    def log_round(self, record: dict[str, Any]) -> None:
        if record["round"] > self.last_step:
            self.run.log(scalars(record), step=record["round"])
            self.last_step = record["round"]

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "complete" else 1)


def wandb_logged_steps(folder: Path, run_id: str) -> list[int]:
    """The steps of every history record the offline runs of ``run_id`` in ``folder`` (a ``wandb`` folder) hold."""
    from wandb.proto import wandb_internal_pb2

    steps = []
    for path in sorted(folder.glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb")):
        for data in _wandb_log_records(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            with contextlib.suppress(Exception):
                record.ParseFromString(data)
                if record.WhichOneof("record_type") == "history":
                    steps.append(int(record.history.step.num))
    return steps


_WANDB_BLOCK = 32768  # a .wandb file is a LevelDB-style log: 7-byte header, then 32 KiB blocks of chunks


def _wandb_log_records(data: bytes) -> Iterator[bytes]:
    """The records of a ``.wandb`` file; a chunk torn by a kill ends the scan."""
    if data[:4] != b":W&B":
        return
    position, pending = 7, b""
    while position + 7 <= len(data):
        left = _WANDB_BLOCK - position % _WANDB_BLOCK
        if left < 7:
            position += left  # the block's tail is padding
            continue
        length = int.from_bytes(data[position + 4 : position + 6], "little")
        kind = data[position + 6]
        body = data[position + 7 : position + 7 + length]
        if kind == 0 or len(body) < length:
            return
        position += 7 + length
        if kind == 1:  # full
            yield body
        elif kind == 2:  # first
            pending = body
        elif kind == 3:  # middle
            pending += body
        elif kind == 4:  # last
            yield pending + body
            pending = b""


_OPENERS: dict[str, Callable[[Path, ExperimentConfig, str, Sequence[dict[str, Any]]], Any]] = {
    "tensorboard": _TensorBoard,
    "wandb": _WandB,
    "mlflow": _MLflow,
}

__all__ = [
    "TRACKERS",
    "Trackers",
    "check_trackers_installed",
    "open_trackers",
    "parse_tracker_list",
    "run_key",
    "scalars",
]
