"""How to install driftlab's optional extras, said the way that works from where this driftlab stands.

driftlab is not on PyPI, so ``pip install "driftlab[flower]"`` fails for every user.  From a source checkout
(an editable install, or Python run from the tree) the working form is ``pip install -e "CHECKOUT[flower]"``;
from an installed wheel or sdist it is the extra's own requirements, read from the installed metadata
(``pip install "flwr>=1.41,<1.43"``).  Every message that asks for an extra takes its command from
``install_hint``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
from pathlib import Path

_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def source_checkout() -> Path | None:
    """The source tree this driftlab is imported from (the folder holding its pyproject.toml), or None."""
    root = Path(__file__).resolve().parent.parent
    try:
        project = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    return root if re.search(r'^name\s*=\s*"driftlab"\s*$', project, re.MULTILINE) else None


def requirements_of(extra: str, distribution: str = "driftlab") -> list[str]:
    """The requirements an extra brings, its nested extras (``driftlab[a,b]``) expanded, in the metadata's order."""
    try:
        declared = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    found: list[str] = []
    for requirement in declared:
        spec, _, marker = requirement.partition(";")
        match = _EXTRA_MARKER.search(marker)
        if match is None or match.group(1) != extra:
            continue
        nested = re.fullmatch(rf"\s*{re.escape(distribution)}\s*\[([^\]]+)\]\s*", spec)
        if nested:
            for name in nested.group(1).split(","):
                found += [r for r in requirements_of(name.strip(), distribution) if r not in found]
        elif spec.strip() not in found:
            found.append(spec.strip())
    return found


def install_hint(*extras: str) -> str:
    """The command that installs ``extras`` here: ``pip install -e ".[a,b]"`` (the checkout's path unless it is the
    current folder) from a checkout, else the extras' requirements, else ``pip install "driftlab[a,b]"``."""
    names = ",".join(extras)
    checkout = source_checkout()
    if checkout is not None:
        where = "." if Path(os.getcwd()).resolve() == checkout else str(checkout)
        return f"pip install -e {shlex.quote(f'{where}[{names}]')}"
    requirements = [r for extra in extras for r in requirements_of(extra)]
    if requirements:
        return "pip install " + " ".join(shlex.quote(r) for r in dict.fromkeys(requirements))
    return f"pip install {shlex.quote(f'driftlab[{names}]')}"


__all__ = ["install_hint", "requirements_of", "source_checkout"]
