"""ruff, configured in pyproject.toml ([tool.ruff]), finds nothing in the repository and `ruff format` would change
nothing: the lint and the format are part of the test run.

CI installs ruff through the `dev` extra, pinned, because rules change between ruff releases; where ruff is missing,
or another release is installed, these tests skip and say why. The lint itself runs in well under a second.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def _pinned_ruff() -> str:
    """The ruff version the `dev` extra pins (``ruff==X.Y.Z``)."""
    extras = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    pins = [re.fullmatch(r"ruff==(\S+)", requirement) for requirement in extras["dev"]]
    found = [pin.group(1) for pin in pins if pin]
    assert len(found) == 1, f"the dev extra should pin ruff exactly once (ruff==X.Y.Z), not {extras['dev']}"
    return found[0]


def _ruff(*arguments: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``ruff check`` run from the repository root, so it reads pyproject.toml; ``--no-cache`` writes nothing there."""
    return subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", *arguments],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def ruff() -> None:
    """Skips unless this is a checkout (pyproject.toml beside the package) with the pinned ruff installed."""
    if not PYPROJECT.is_file():
        pytest.skip(f"no pyproject.toml at {ROOT}: driftlab is installed, not checked out, so there is no repository")
    if importlib.util.find_spec("ruff") is None:
        pytest.skip('ruff is not installed: pip install -e ".[dev]" installs the pinned one')
    installed = subprocess.run(
        [sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True
    ).stdout.split()
    pinned = _pinned_ruff()
    if installed[-1:] != [pinned]:
        pytest.skip(f"ruff {' '.join(installed[1:]) or '?'} is installed, the dev extra pins {pinned}: rules differ")


def _codes(source: str, filename: str) -> list[str]:
    """The rule codes ruff reports for ``source`` as if it were the file ``filename`` (relative to the root)."""
    result = _ruff("--output-format", "concise", "--stdin-filename", filename, "-", stdin=source)
    assert result.returncode in (0, 1), result.stderr  # 2: ruff itself failed (a bad configuration, say)
    return sorted(re.findall(r":\d+:\d+: ([A-Z]+[0-9]+) ", result.stdout))


def test_ruff_finds_nothing_in_the_repository(ruff):
    result = _ruff("--output-format", "concise", ".")
    assert result.returncode == 0, (
        f"ruff check found (fix them, or `# noqa: CODE - why`):\n{result.stdout}{result.stderr}"
    )


def test_the_repository_is_as_ruff_format_writes_it(ruff):
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--no-cache", "--check", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"`ruff format` would change these files (run it):\n{result.stdout}{result.stderr}"


def test_imports_are_sorted(ruff):
    unsorted = "import torch\nimport os\n\nprint(os.sep, torch.pi)\n"
    assert _codes(unsorted, "driftlab/example.py") == ["I001"]
    assert _codes("import os\n\nimport torch\n\nprint(os.sep, torch.pi)\n", "driftlab/example.py") == []


def test_the_configured_rule_families_are_the_ones_enforced(ruff):
    source = (
        "import os\n"  # F401: unused import
        "\n"
        "\n"
        "def load(path, retries):\n"  # ARG001: retries unused
        "    try:\n"
        "        return open(path).read()\n"
        "    except Exception:\n"  # BLE001: blind except
        "        return None\n"
        "\n"
        "\n"
        "def Pairs(a, b):\n"  # N802: function name not lowercase
        "    return list(zip(a, b))\n"  # B905: zip without strict
    )
    assert _codes(source, "driftlab/example.py") == ["ARG001", "B905", "BLE001", "F401", "N802"]


def test_a_noqa_that_silences_nothing_is_refused(ruff):
    assert _codes("import os  # noqa: F401\n\nprint(os.sep)\n", "driftlab/example.py") == ["RUF100"]
    assert _codes("import os  # noqa: F401\n", "driftlab/example.py") == []


def test_long_lines_are_refused_past_160_characters(ruff):
    def assignment(length: int) -> str:
        return "x = '" + "a" * (length - len("x = ''")) + "'\n"

    assert len(assignment(160)) == 161  # the newline does not count
    assert _codes(assignment(160), "driftlab/example.py") == []
    assert _codes(assignment(161), "driftlab/example.py") == ["E501"]


def test_tests_may_request_fixtures_they_do_not_name_and_torch_keeps_its_f(ruff):
    fixture = "def test_it(tmp_path):\n    assert True\n"
    assert _codes(fixture, "driftlab/example_test.py") == []
    assert _codes(fixture, "driftlab/example.py") == ["ARG001"]
    assert _codes("import torch.nn.functional as F\n\nrelu = F.relu\n", "driftlab/example.py") == []
