"""Progress of a run: a tqdm bar on a terminal, one summary line per run anywhere else.

A bar redrawn every round fills a log file with carriage-return frames (66 KB for
the demo), so when the stream is not a terminal (nor a notebook, where tqdm draws
a widget) the run is reported once, when it ends::

    FedAdam: 40 rounds, final accuracy 0.812, 12.3 s

A warning about the run (``warn``: the instability warning) is written at once, as
its own line, in both forms: above the bar on a terminal, as a line of its own in a log.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO


class RoundProgress(Protocol):
    def update(self, record: dict[str, Any]) -> None: ...

    def warn(self, message: str) -> None: ...

    def close(self) -> None: ...


def round_progress(
    label: str, total_rounds: int, initial_round: int = 0, stream: TextIO | None = None
) -> RoundProgress:
    """A progress reporter for one run: call ``update(record)`` after every round, ``warn(message)`` to say
    something about the run at once, and ``close()`` at the end.

    ``stream`` defaults to standard error, where tqdm writes.
    """
    stream = sys.stderr if stream is None else stream
    if _is_terminal(stream) or _in_notebook():
        return _Bar(label, total_rounds, initial_round, stream)
    return SummaryLine(label, total_rounds, initial_round, stream)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _in_notebook() -> bool:
    """A Jupyter kernel: its stderr is no terminal, but tqdm.auto draws a widget there."""
    if "IPython" not in sys.modules:
        return False
    try:
        from IPython import get_ipython

        shell = get_ipython()
        return shell is not None and "IPKernelApp" in shell.config
    except Exception:  # noqa: BLE001 - any IPython oddity just means "no notebook"
        return False


class _Bar:
    def __init__(self, label: str, total_rounds: int, initial_round: int, stream: TextIO) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total_rounds, initial=initial_round, desc=label, unit="round", leave=True, file=stream)
        self._label, self._stream = label, stream

    def update(self, record: dict[str, Any]) -> None:
        self._bar.update(1)
        if "test_accuracy" in record:
            self._bar.set_postfix(acc=f"{record['test_accuracy']:.3f}")

    def warn(self, message: str) -> None:
        self._bar.write(
            f"{self._label}: warning: {message}", file=self._stream
        )  # above the bar, which is redrawn below

    def close(self) -> None:
        self._bar.close()


@dataclass
class SummaryLine:
    """Writes one line when the run ends (or stops): rounds done, the last test accuracy, wall time."""

    label: str
    total_rounds: int
    initial_round: int
    stream: TextIO
    round: int = field(init=False)
    accuracy: float | None = field(init=False, default=None)
    started: float = field(init=False, default_factory=time.perf_counter)
    closed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.round = self.initial_round

    def update(self, record: dict[str, Any]) -> None:
        self.round = int(record.get("round", self.round + 1))
        if "test_accuracy" in record:
            self.accuracy = record["test_accuracy"]

    def warn(self, message: str) -> None:
        self.stream.write(f"{self.label}: warning: {message}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stream.write(self.text() + "\n")
        self.stream.flush()

    def text(self) -> str:
        seconds = time.perf_counter() - self.started
        done = self.round - self.initial_round
        rounds = f"{self.total_rounds} round{'' if self.total_rounds == 1 else 's'}"
        if self.round < self.total_rounds:
            what = f"stopped after round {self.round} of {self.total_rounds}"
        elif done == 0:
            what = f"{rounds}, already complete"
        elif self.initial_round > 0:
            what = f"rounds {self.initial_round + 1}-{self.round} of {self.total_rounds}"
        else:
            what = rounds
        which = "final" if self.round >= self.total_rounds else "last"
        accuracy = "" if self.accuracy is None else f", {which} accuracy {self.accuracy:.3f}"
        return f"{self.label}: {what}{accuracy}, {seconds:.1f} s"


__all__ = ["RoundProgress", "SummaryLine", "round_progress"]
