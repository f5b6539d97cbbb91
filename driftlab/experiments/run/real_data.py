"""Test support: find a data set's real files exactly as the library does, or skip.

Tests on real data (MNIST, the CIFAR-10 JPEG tarball, the LEAF FEMNIST sample,
tiny-shakespeare) must run wherever a user keeps those files and skip cleanly
on a machine without them. So they never name a path: they ask
:func:`real_data_path`, which is :func:`driftlab.experiments.run.datasets.find_data`
on the data set's default location (``$DRIFTLAB_DATA`` alone when set, else
``./shared/data``, ``../shared/data`` and the checkout's ``../shared/data``),
and mark themselves with :func:`needs_real_data`, whose skip reason says where
it looked. ``data.root`` is a per-run setting, so a test that uses the real
files without one exercises the very lookup a run without ``data.root`` does.

    >>> from driftlab.experiments.run.real_data import real_data_path
    >>> real_data_path("synthetic") is None  # generated data have no files
    True
"""

from __future__ import annotations

from pathlib import Path

from driftlab.experiments.run.datasets import DATA_SETS, data_search_paths, find_data

__all__ = ["needs_real_data", "real_data_path", "real_data_skip_reason"]


def real_data_path(name: str) -> Path | None:
    """The real files of data set ``name`` (a ``data.name``) where the library finds them, or None when absent."""
    location = DATA_SETS[name].location
    return None if location is None else find_data(location)


def real_data_skip_reason(name: str) -> str:
    """Why a test on ``name``'s real files skips: where the library looked, and how to point it at the files."""
    location = DATA_SETS[name].location
    looked = ", ".join(str(path) for path in data_search_paths(location))
    return f"real {name} data not found; looked in {looked} (set DRIFTLAB_DATA=DIR, a folder holding {location})"


def needs_real_data(name: str):
    """A ``pytest.mark.skipif`` for a test that needs ``name``'s real files (looked up when the module is collected)."""
    import pytest

    return pytest.mark.skipif(real_data_path(name) is None, reason=real_data_skip_reason(name))
