"""What every test of driftlab shares: each test starts from the registries and imported plugin files it found.

A test that registers a plugin (a model, a data set, an algorithm, ...) from a file in its own temporary
folder must not leave it behind: the next test's plugin of the same name from another folder would clash
with it, and messages that list the registered names would list it.
"""

from __future__ import annotations

import pytest

from driftlab import plugins


@pytest.fixture(autouse=True)
def registries_as_found():
    """Restore every registry's entries (in place: modules hold aliases of the dicts) and the record of imported
    plugin files after each test."""
    # Import every kind's package first, so its built-ins are registered before the snapshot.
    import driftlab.algorithms
    import driftlab.data
    import driftlab.executors
    import driftlab.models
    import driftlab.optim  # noqa: F401

    entries = [(registry, dict(registry.entries)) for registry in plugins.REGISTRIES]
    loaded = dict(plugins._loaded_paths)
    yield
    for registry, found in entries:
        registry.entries.clear()
        registry.entries.update(found)
    plugins._loaded_paths.clear()
    plugins._loaded_paths.update(loaded)


@pytest.fixture
def built_ins_only():
    """Every registry as a fresh process has it before any plugin is imported: only driftlab's own entries.

    The examples' plugin modules register their entries when pytest imports them to collect their doctests;
    a test whose expectations list the registered names, or that registers a plugin of the same name from
    another file, asks for this."""
    for registry in plugins.REGISTRIES:
        for name in [name for name in registry.entries if name not in registry.built_in]:
            del registry.entries[name]  # in place: modules hold aliases of the dict; registries_as_found restores it
    yield
