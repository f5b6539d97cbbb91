"""A run on a device trace resumes only with the trace it started with; the trace's folder is not part of its identity."""

import shutil

import pytest

import driftlab
from driftlab.errors import ConfigError

ROWS = "".join(f"{client},{10 + client},1e6,1e5\n" for client in range(5))


def _overrides(trace, rounds):
    return [
        f"rounds={rounds}",
        "data.num_clients=5",
        "sampling.participation=0.4",
        "keep_checkpoint=true",
        "system.profiles=trace",
        f"system.trace={trace}",
    ]


def test_a_changed_trace_is_refused_on_resume_and_a_moved_one_is_not(tmp_path):
    trace = tmp_path / "a" / "devices.csv"
    trace.parent.mkdir()
    trace.write_text("client,speed,download,upload\n" + ROWS)
    out = tmp_path / "run"
    first = driftlab.run(None, out, overrides=_overrides(trace, 2))
    assert first.records[-1]["time_end"] > 0

    moved = tmp_path / "b" / "devices.csv"  # the same bytes in another folder: the same run
    moved.parent.mkdir()
    shutil.copy(trace, moved)
    extended = driftlab.run(None, out, resume=True, overrides=_overrides(moved, 3))
    straight = driftlab.run(None, tmp_path / "straight", overrides=_overrides(trace, 3))
    assert extended.records == [
        {**r, "round_seconds": e["round_seconds"]} for r, e in zip(straight.records, extended.records, strict=True)
    ]

    moved.write_text("client,speed,download,upload\n" + ROWS.replace("10,", "99,", 1))
    with pytest.raises(ConfigError, match="cannot resume: the run .* started with a device trace of SHA-256"):
        driftlab.run(None, out, resume=True, overrides=_overrides(moved, 4))
