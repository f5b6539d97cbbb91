import importlib.metadata
from pathlib import Path

import pytest

from driftlab import extras

CHECKOUT = Path(__file__).resolve().parent.parent


def test_from_the_checkout_the_hint_is_an_editable_install_of_it(monkeypatch, tmp_path):
    monkeypatch.chdir(CHECKOUT)
    assert extras.install_hint("flower") == "pip install -e '.[flower]'"
    monkeypatch.chdir(tmp_path)  # elsewhere the checkout is named by its path
    assert extras.install_hint("flower", "ray") == f"pip install -e '{CHECKOUT}[flower,ray]'"


def test_from_an_installed_copy_the_hint_lists_the_extras_requirements(monkeypatch):
    monkeypatch.setattr(extras, "source_checkout", lambda: None)
    declared = [
        "torch>=2.11",
        'flwr<1.43,>=1.41; extra == "flower"',
        'ray>=2.60; extra == "ray"',
        'pandas>=3.1.1; extra == "pandas"',
        'driftlab[flower,pandas]; extra == "both"',
    ]
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: declared)
    assert extras.requirements_of("both") == ["flwr<1.43,>=1.41", "pandas>=3.1.1"]
    assert extras.install_hint("flower", "ray") == "pip install 'flwr<1.43,>=1.41' 'ray>=2.60'"
    assert extras.install_hint("nothing") == "pip install 'driftlab[nothing]'"  # an extra the metadata does not know


def test_the_installed_metadata_has_every_extra_the_hints_name():
    """The checkout's own metadata (an editable install): `all` expands to every user extra, none of the dev tools."""
    try:
        everything = extras.requirements_of("all")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - driftlab run from the tree, not installed
        pytest.skip("driftlab is not installed")
    names = {requirement.split(">")[0].split("<")[0].split("=")[0] for requirement in everything}
    assert {"flwr", "opacus", "ray", "submitit", "pandas", "orjson"} <= names and not names & {"pytest", "ruff"}
