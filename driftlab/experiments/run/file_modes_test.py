"""Data, state and result files are created without executable bits, honouring the umask: files 0o666 and
folders 0o777, less the umask, as the umask's owner asked (a run with its disk client-state store, a report, a sweep)."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

import pytest

import driftlab
from driftlab.experiments.report import make_report
from driftlab.experiments.sweep import run_sweep, sweep_from_config

TINY = ["rounds=1", "client.epochs=none", "client.steps=1", "data.num_clients=5", "sampling.participation=0.4"]


@contextlib.contextmanager
def umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def modes(root: Path) -> dict[str, int]:
    """Every file and folder under ``root`` (``root`` itself excluded), by path, with its permission bits."""
    return {path.relative_to(root).as_posix(): stat.S_IMODE(path.lstat().st_mode) for path in root.rglob("*")}


def assert_modes(root: Path, mask: int) -> None:
    found = modes(root)
    assert found  # something was written
    for name, mode in found.items():
        expected = (0o777 if (root / name).is_dir() else 0o666) & ~mask
        assert mode == expected, f"{name}: {oct(mode)}, expected {oct(expected)} under umask {oct(mask)}"
        if not (root / name).is_dir():
            assert not mode & 0o111, name


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_a_run_with_disk_state_and_its_report_create_no_executable_file(tmp_path, mask):
    with umask(mask):
        # SCAFFOLD keeps per-client state; the disk store writes it into client_state/ (kept with the checkpoint)
        driftlab.run(
            "synthetic-fedavg",
            tmp_path / "run",
            overrides=[*TINY, "algorithm.name=scaffold", "state.store=disk", "keep_checkpoint=true"],
        )
        make_report([tmp_path / "run"], tmp_path / "report", targets=[0.5])
    assert (tmp_path / "run" / "client_state").is_dir() and (tmp_path / "report" / "report.md").exists()
    assert any(name.endswith(".png") for name in modes(tmp_path / "report"))
    assert_modes(tmp_path / "run", mask)
    assert_modes(tmp_path / "report", mask)


def test_a_sweep_and_its_runs_processes_honour_the_umask(tmp_path):
    mask = 0o027  # neither Python's nor a shell's usual one: the run's process inherits it, it is not assumed
    with umask(mask):
        spec = sweep_from_config("synthetic-fedprox", ["algorithm.mu=0"], [0], "modes")
        outcomes = run_sweep(spec, tmp_path / "sweep", jobs=1, extra_overrides=TINY, log=lambda _: None)
        make_report([tmp_path / "sweep"], tmp_path / "sweep" / "report")
    assert [o.status for o in outcomes] == ["complete"]
    assert_modes(tmp_path / "sweep", mask)
