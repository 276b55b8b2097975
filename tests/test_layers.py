"""The package's layers point one way: subsystems import only those below them, and no circle."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO

PACKAGE = REPO / "ddpctx"

#: Each subsystem (a subpackage of ddpctx) and the subsystems it may import.
#: Pure helpers at the bottom; the session above the subsystems it composes;
#: launching, testing and the command line on top. The package's own modules
#: (``__init__``, ``compat``, the old-path shims) are the top and may import anything.
MAY_IMPORT: dict[str, set[str]] = {
    "utils": set(),
    "reduce": {"utils"},
    "data": {"utils"},
    "hang": {"utils"},
    "rankzero": {"utils", "reduce"},
    "parallel": {"utils", "data"},
    "checkpoint": {"utils", "reduce", "rankzero", "data", "parallel"},
    "session": {"utils", "reduce", "rankzero", "data", "parallel", "checkpoint", "hang"},
    "launching": {"utils", "session"},
    "testing": {"utils", "session", "launching"},
    "cli": {"utils", "reduce", "rankzero", "hang", "session", "launching"},
}

#: Modules allowed past ~400 lines; each says why in its docstring.
LONG_MODULE_LINES = 400


def imports_of(path: Path) -> set[str]:
    """Every ``ddpctx.*`` module ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddpctx."):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("ddpctx.")}
    return found


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def subsystem(module: str) -> str | None:
    """``ddpctx.reduce.wire`` -> ``reduce``; None for the package's own top modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else None


def test_every_subpackage_is_a_known_subsystem() -> None:
    found = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert found == set(MAY_IMPORT), "add the new subsystem to MAY_IMPORT with its allowed imports"


@pytest.mark.parametrize("name", sorted(MAY_IMPORT))
def test_each_subpackage_opens_with_its_contract_and_what_it_may_import(name: str) -> None:
    doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
    assert doc, f"ddpctx/{name}/__init__.py has no docstring"
    assert name == "testing" or "May import" in doc, (
        f"ddpctx.{name} does not say what it may import"
    )


def test_subsystems_import_only_the_layers_below_them() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        own = subsystem(importer)
        if own is None:
            continue
        for imported in sorted(imports_of(path)):
            theirs = subsystem(imported)
            if theirs is not None and theirs != own and theirs not in MAY_IMPORT[own]:
                upward.append(f"{importer} imports {imported} ({own} may not import {theirs})")
    assert upward == [], "imports against the layers:\n" + "\n".join(upward)


def test_no_module_is_part_of_an_import_circle() -> None:
    # The package's own __init__ re-exports everything lazily; it is the top, not a layer.
    graph = {
        module_name(path): imports_of(path)
        for path in PACKAGE.rglob("*.py")
        if path != PACKAGE / "__init__.py"
    }
    circles = []
    for start in graph:
        stack = [(start, [start])]
        while stack:
            module, path = stack.pop()
            for imported in graph.get(module, set()):
                if imported == start:
                    circles.append(" -> ".join([*path, start]))
                elif imported not in path:
                    stack.append((imported, [*path, imported]))
    assert circles == [], "import circles:\n" + "\n".join(sorted(set(circles)))


def test_a_long_module_says_why_it_is_long() -> None:
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > LONG_MODULE_LINES and "Why one module" not in doc:
            unexplained.append(f"{path.relative_to(REPO)}: {lines} lines")
    assert unexplained == [], (
        "split these, or say 'Why one module' in the docstring:\n" + "\n".join(unexplained)
    )


OLD_PATHS = [
    ("ddpctx.context", "distributed"),
    ("ddpctx.context", "DistContext"),
    ("ddpctx.decorators", "rank_zero_only"),
    ("ddpctx.launcher", "launch"),
]

#: Imports each old path as a fresh module (its module-level shim runs again) and prints,
#: per path, the warnings that import raised and the imported object's module.
IMPORT_EACH_OLD_PATH = """
import importlib, json, sys, warnings
found = {}
for old, name in OLD_PATHS:
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(importlib.import_module(old), name)
    found[f"{old}.{name}"] = {
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "module": getattr(value, "__module__", ""),
    }
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def old_imports() -> dict[str, dict[str, Any]]:
    """What importing each old path did, in one interpreter (each costs a torch import)."""
    code = f"OLD_PATHS = {OLD_PATHS!r}\n{IMPORT_EACH_OLD_PATH}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    found: dict[str, dict[str, Any]] = json.loads(result.stdout)
    return found


@pytest.mark.parametrize(("old", "name"), OLD_PATHS)
@pytest.mark.slow
def test_an_old_module_path_still_imports_with_a_deprecation_warning(
    old_imports: dict[str, dict[str, Any]], old: str, name: str
) -> None:
    found = old_imports[f"{old}.{name}"]
    deprecations = [text for text in found["warnings"] if text.startswith("DeprecationWarning")]
    assert len(deprecations) == 1, found
    assert "moved to ddpctx." in deprecations[0]
    assert "from ddpctx import" in deprecations[0]
    assert found["module"].startswith("ddpctx."), found  # the object itself, from its new home


@pytest.mark.slow
def test_the_testing_plugin_still_imports_without_a_warning() -> None:
    code = "import warnings; warnings.simplefilter('error'); import ddpctx.testing.plugin"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_module_of_the_package_counts_as_ddpctx_own_frames() -> None:
    """Hang reports and rank tracebacks skip ddpctx's frames in every subpackage, not one."""
    from ddpctx.hang.inflight import is_library_file
    from ddpctx.launching import worker

    modules = sorted((REPO / "ddpctx").rglob("*.py"))
    assert len(modules) > 40
    for module in modules:
        path = str(module.resolve())
        assert is_library_file(path), path
        assert path.startswith(worker._PACKAGE), path
