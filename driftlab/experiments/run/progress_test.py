"""Run progress: a bar on a terminal, one line per run anywhere else, labelled as the caller says."""

from __future__ import annotations

import io
import re

import pytest

import driftlab
from driftlab.experiments.run.progress import SummaryLine, round_progress

TINY = ["rounds=2", "client.epochs=none", "client.steps=1", "data.num_clients=5", "sampling.participation=0.4"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _feed(progress, rounds, accuracy_every=1, close=True):
    for r in rounds:
        record = {"round": r, "local_steps": 3}
        if r % accuracy_every == 0:
            record["test_accuracy"] = r / 100
        progress.update(record)
    if close:
        progress.close()


def test_off_a_terminal_a_run_is_one_line_when_it_ends():
    stream = io.StringIO()
    progress = round_progress("FedAdam", 40, 0, stream)
    assert isinstance(progress, SummaryLine)
    _feed(progress, range(1, 40), close=False)
    assert stream.getvalue() == ""  # nothing while it runs
    _feed(progress, [40])
    progress.close()  # a second close writes nothing more
    assert re.fullmatch(r"FedAdam: 40 rounds, final accuracy 0\.400, \d+\.\d s\n", stream.getvalue())


def test_the_line_says_when_a_run_stopped_early_or_was_resumed():
    stream = io.StringIO()
    _feed(round_progress("SCAFFOLD", 40, 0, stream), range(1, 18), accuracy_every=5)
    assert stream.getvalue().startswith("SCAFFOLD: stopped after round 17 of 40, last accuracy 0.150, ")
    stream = io.StringIO()
    _feed(round_progress("FedDyn", 40, 30, stream), range(31, 41))
    assert stream.getvalue().startswith("FedDyn: rounds 31-40 of 40, final accuracy 0.400, ")
    stream = io.StringIO()
    _feed(round_progress("EFL", 40, 40, stream), [])
    assert stream.getvalue().startswith("EFL: 40 rounds, already complete, ")
    stream = io.StringIO()
    _feed(round_progress("quadratic", 3, 0, stream), range(1, 4), accuracy_every=10)  # no accuracy recorded
    assert re.fullmatch(r"quadratic: 3 rounds, \d+\.\d s\n", stream.getvalue())


def test_on_a_terminal_a_bar_carries_the_label():
    stream = Terminal()
    progress = round_progress("FedAdam", 4, 1, stream)
    assert not isinstance(progress, SummaryLine)
    _feed(progress, range(2, 5))
    shown = stream.getvalue()
    assert "FedAdam" in shown and "4/4" in shown and "acc=0.040" in shown


def test_run_labels_its_progress_and_writes_one_line_to_a_log(capsys):
    driftlab.run(None, overrides=TINY, progress=True, progress_label="FedAdam")
    err = capsys.readouterr().err  # pytest's capture is no terminal, as a log file is not
    assert re.fullmatch(r"FedAdam: 2 rounds, final accuracy \d\.\d{3}, \d+\.\d s\n", err), err
    driftlab.run(None, overrides=[*TINY, "server.optimizer=adam", "server.lr=0.01"], progress=True)
    assert capsys.readouterr().err.startswith("fedavg: 2 rounds")  # no label given: the algorithm's name


def test_a_callable_progress_gets_every_record_and_nothing_is_printed(capsys):
    seen = []
    result = driftlab.run(None, overrides=TINY, progress=seen.append)
    assert seen == result.records and [r["round"] for r in seen] == [1, 2]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("stream", [io.StringIO(), None])
def test_default_stream_is_stderr_and_a_closed_stream_is_no_terminal(stream, capsys):
    if stream is None:
        progress = round_progress("x", 1)
        _feed(progress, [1])
        assert capsys.readouterr().err.startswith("x: 1 round, final accuracy 0.010, ")
    else:
        stream.close()
        assert isinstance(round_progress("x", 1, 0, stream), SummaryLine)


def test_a_warning_is_its_own_line_at_once_in_a_log_and_above_the_bar_on_a_terminal():
    stream = io.StringIO()
    progress = round_progress("FedAvg", 3, 0, stream)
    _feed(progress, [1], close=False)
    progress.warn("unstable run: ...")
    assert stream.getvalue() == "FedAvg: warning: unstable run: ...\n"  # at once, not when the run ends
    _feed(progress, [2, 3])
    assert stream.getvalue().startswith("FedAvg: warning: unstable run: ...\nFedAvg: 3 rounds, final accuracy 0.030, ")
    terminal = Terminal()
    bar = round_progress("FedAvg", 3, 0, terminal)
    _feed(bar, [1], close=False)
    bar.warn("unstable run: ...")
    _feed(bar, [2, 3])
    shown = terminal.getvalue()
    assert shown.count("FedAvg: warning: unstable run: ...\n") == 1 and "3/3" in shown.split("warning")[1]
