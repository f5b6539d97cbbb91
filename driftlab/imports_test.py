"""driftlab's modules import each other without circles, and the layers point one way.

The graph is read from the source with ``ast``: every ``import`` statement counts, at module level, inside
functions and under ``if TYPE_CHECKING`` alike, because a function-level import that closes a circle is a
circle the code hides, not one it avoids.  ``from package import name`` is an arrow to ``package.name`` when
that is a module, else to the package.  Test files are not part of the library and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
ROOT = PACKAGE.parent

# What a layer must never import: data and models are below the simulation, the simulation below the
# experiments, and nothing below the command line imports it.
# the layers that assemble and drive runs: nothing below them imports them
DRIVERS = ("driftlab.experiments", "driftlab.executors", "driftlab.deploy", "driftlab.flower", "driftlab.cli")
FORBIDDEN = {
    "driftlab.data": ("driftlab.simulation", *DRIVERS),
    "driftlab.models": ("driftlab.simulation", *DRIVERS),
    "driftlab.optim": ("driftlab.simulation", *DRIVERS),
    "driftlab.simulation": ("driftlab.privacy", *DRIVERS),
    "driftlab.algorithms": ("driftlab.privacy", *DRIVERS),
    # privacy wraps any algorithm through the seam's ReleaseForm, so it never names one
    "driftlab.privacy": ("driftlab.algorithms", *DRIVERS),
    # executors start and watch runs: the run directory's files they read are driftlab.run_files', the run itself is
    # named by the sweep (RunTask.entry), not imported
    "driftlab.executors": ("driftlab.experiments", "driftlab.deploy", "driftlab.flower", "driftlab.cli"),
    "driftlab.experiments": ("driftlab.cli",),
    "driftlab.deploy": ("driftlab.flower", "driftlab.cli"),
    # (seed, stream, round, client) -> draws: below everything that draws
    "driftlab.randomness": (
        "driftlab.data",
        "driftlab.models",
        "driftlab.simulation",
        "driftlab.algorithms",
        "driftlab.privacy",
        "driftlab.features",
        *DRIVERS,
    ),
    # the features' registry and refusals: below the experiments that assemble runs from them
    "driftlab.features": DRIVERS,
    # robust aggregation, attacks and partial personalization wrap any algorithm through its release form (feature
    # entries), so they never name one
    "driftlab.robust": ("driftlab.algorithms", "driftlab.privacy", *DRIVERS),
    "driftlab.attacks": ("driftlab.algorithms", "driftlab.privacy", *DRIVERS),
    "driftlab.personal": ("driftlab.algorithms", "driftlab.privacy", *DRIVERS),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def library_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for path in sorted(PACKAGE.rglob("*.py"))
        if not path.name.endswith("_test.py") and path.name != "conftest.py"
    }


def imported(tree: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The driftlab modules a module's source imports, wherever the import statement is."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `import driftlab.x.y` of a name inside a module
                name = name.rpartition(".")[0]
            if name.startswith("driftlab") and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = library_modules()
    return {
        module: imported(ast.parse(path.read_text(), str(path)), module, path.name == "__init__.py", modules)
        for module, path in modules.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # iterative, so a deep chain of imports cannot reach Python's recursion limit
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_is_read_from_every_kind_of_import():
    modules = {
        "driftlab.a": Path(),
        "driftlab.b": Path(),
        "driftlab.c": Path(),
        "driftlab.pkg": Path(),
        "driftlab.pkg.d": Path(),
    }
    source = (
        "import driftlab.a\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from driftlab.b import Thing\n"
        "def f():\n    from driftlab.pkg import d\n    from driftlab.pkg import e\n"
    )
    assert imported(ast.parse(source), "driftlab.c", False, modules) == {
        "driftlab.a",
        "driftlab.b",
        "driftlab.pkg.d",
        "driftlab.pkg",
    }
    relative = "from . import d\nfrom .. import a\n"
    assert imported(ast.parse(relative), "driftlab.pkg.x", False, {**modules, "driftlab.pkg.x": Path()}) == {
        "driftlab.pkg.d",
        "driftlab.a",
    }


def test_circles_are_found_and_only_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set(), "c": {"b"}}) == []


def test_no_module_imports_itself_through_others():
    found = circles(import_graph())
    assert not found, "import circles (function-level and TYPE_CHECKING imports count): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_layers_point_one_way():
    wrong = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for layer, forbidden in FORBIDDEN.items()
        if is_within(module, layer)
        for target in targets
        if any(is_within(target, below) for below in forbidden)
    ]
    assert not wrong, "imports against the layering: " + "; ".join(sorted(wrong))


def test_executors_import_nothing_of_the_experiments():
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if is_within(module, "driftlab.executors")
        for target in targets
        if is_within(target, "driftlab.experiments")
    )
    assert not wrong, "executors sit below the experiments: " + "; ".join(wrong)


def test_config_sections_of_features_and_the_low_modules_import_nothing_above_them():
    graph = import_graph()
    # the bases every section and every layer may use: nothing of driftlab but its errors
    for low in ("driftlab.config_section", "driftlab.run_files"):
        assert graph[low] <= {"driftlab.errors"}, f"{low} imports {sorted(graph[low])}"
    # a feature's own section is below the config that assembles it
    for section in (
        "driftlab.compress.section",
        "driftlab.privacy.section",
        "driftlab.simulation.time.section",
        "driftlab.simulation.asynchronous.section",
    ):
        above = sorted(target for target in graph[section] if is_within(target, "driftlab.experiments"))
        assert not above, f"{section} imports {above}"
