"""The package's layers point one way: subsystems import only those below them, and no circle."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpctx.utils.moved import OLD_PATHS as OLD_PATH_TABLE
from ddpctx.utils.moved import moved_names
from tests.helpers import REPO

PACKAGE = REPO / "ddpctx"

#: Each subsystem (a subpackage of ddpctx) and the subsystems it may import.
#: Pure helpers at the bottom; the session above the subsystems it composes;
#: launching, testing and the command line on top. The package's own modules
#: (``__init__``, ``__main__``, ``compat``) are the top and may import anything.
MAY_IMPORT: dict[str, set[str]] = {
    "utils": set(),
    "reduce": {"utils"},
    "data": {"utils"},
    "hang": {"utils"},
    "watch": {"utils", "reduce", "hang"},
    "rankzero": {"utils", "reduce"},
    "parallel": {"utils", "data"},
    "checkpoint": {"utils", "reduce", "rankzero", "data", "parallel"},
    "session": {"utils", "reduce", "rankzero", "data", "parallel", "checkpoint", "hang", "watch"},
    "launching": {"utils", "session"},
    "testing": {"utils", "session", "launching"},
    "cli": {"utils", "reduce", "rankzero", "hang", "checkpoint", "session", "launching"},
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


def test_the_package_shows_its_subsystems_and_few_flat_modules() -> None:
    """``ls ddpctx/`` is the architecture: subpackages, and no module per old import path."""
    flat = {path.name for path in PACKAGE.glob("*.py")}
    extra = sorted(flat - FLAT_MODULES)
    assert flat == FLAT_MODULES, f"flat modules beside the subpackages: {extra}"


def test_every_old_path_is_served_by_the_table_and_no_file() -> None:
    """An old path has no module file: the one table serves it (or its package replaced it)."""
    for old in OLD_PATH_TABLE:
        assert not (PACKAGE / f"{old}.py").exists(), f"ddpctx/{old}.py: serve it from the table"


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


#: Every module path of the flat layout before the move into subpackages, each public name
#: it had (defined there, or listed in its ``__all__``) and that name's home now, from the
#: package's one table; and the names later commits removed on purpose, with what replaced
#: them. Both checked against git by :func:`names_before_the_move`.
MOVED = {
    "moved": {f"ddpctx.{old}": moved_names(f"ddpctx.{old}") for old in OLD_PATH_TABLE},
    **json.loads((Path(__file__).parent / "moved_names.json").read_text()),
}
#: The commit that moved the flat modules into subpackages.
LAYOUT_MOVE = "62e5683"
OLD_PATHS = [(old, name) for old, names in sorted(MOVED["moved"].items()) for name in names]
#: The flat modules ``ls ddpctx/`` may show beside the subpackages: the package, ``python
#: -m ddpctx``, and the Kronos-style helper names.
FLAT_MODULES = {"__init__.py", "__main__.py", "compat.py"}

#: Imports each old path as a fresh module (made again from the table), then each
#: of its names, and prints per name the warnings they raised, the imported object's
#: module and whether it is the very object of its new home.
IMPORT_EACH_OLD_PATH = """
import importlib, json, sys, warnings
found = {}
for old, names in MOVED.items():
    for name, home in names.items():
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                value = getattr(importlib.import_module(old), name)
            except (ImportError, AttributeError) as error:
                found[f"{old}.{name}"] = {"error": repr(error)}
                continue
        found[f"{old}.{name}"] = {
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
            "module": getattr(value, "__module__", ""),
            "same": value is getattr(importlib.import_module(home), name),
        }
print(json.dumps(found))
"""


def names_before_the_move() -> dict[str, dict[str, str]]:
    """Per old module path, its public names, read from the tree before the layout move."""
    git = ["git", "-C", str(REPO)]
    listing = subprocess.run(
        [*git, "ls-tree", "--name-only", f"{LAYOUT_MOVE}^", "ddpctx/"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found = {}
    for path in listing:
        if not path.endswith(".py") or path.endswith(("__init__.py", "__main__.py")):
            continue
        source = subprocess.run(
            [*git, "show", f"{LAYOUT_MOVE}^:{path}"], capture_output=True, text=True, check=True
        ).stdout
        found[path.removesuffix(".py").replace("/", ".")] = sorted(public_names(source))
    return found


def public_names(source: str) -> set[str]:
    """A module's public names: defined at its top (type variables aside), or in ``__all__``."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            targets = {target.id for target in node.targets if isinstance(target, ast.Name)}
            if targets == {"__all__"}:
                names |= set(ast.literal_eval(node.value))
            elif not (
                isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", "") in ("TypeVar", "ParamSpec")
            ):
                names |= targets
    return {name for name in names if not name.startswith("_")}


@pytest.mark.slow
def test_the_moved_names_are_those_git_has() -> None:
    """The committed list is complete: every old module and name, moved or removed on purpose."""
    try:
        before = names_before_the_move()
    except subprocess.CalledProcessError:
        pytest.skip(f"no git history with the layout move ({LAYOUT_MOVE}) in this checkout")
    unmoved = {"ddpctx.cli", "ddpctx.compat"}  # the same path today (cli is a package of it)
    listed = {
        old: sorted({*MOVED["moved"].get(old, {}), *MOVED["removed"].get(old, {})})
        for old in {*MOVED["moved"], *MOVED["removed"]}
    }
    assert listed == {old: names for old, names in before.items() if old not in unmoved}


@pytest.fixture(scope="module")
def old_imports() -> dict[str, dict[str, Any]]:
    """What importing each old path did, in one interpreter (each costs a torch import)."""
    code = f"MOVED = {MOVED['moved']!r}\n{IMPORT_EACH_OLD_PATH}"
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
    assert "error" not in found, found
    deprecations = [text for text in found["warnings"] if text.startswith("DeprecationWarning")]
    assert len(deprecations) == 1, found
    home = MOVED["moved"][old][name]
    assert home in deprecations[0], deprecations  # where to import it from now
    assert re.search(rf"\b{name}\b", deprecations[0]) or "import it from" in deprecations[0]
    assert found["same"], found  # the object itself, from its new home


@pytest.mark.parametrize(
    ("old", "name"), [("ddpctx.context", "distributed"), ("ddpctx.rankzero", "RankZeroError")]
)
@pytest.mark.slow
def test_a_public_name_at_an_old_path_says_to_import_it_from_ddpctx(
    old_imports: dict[str, dict[str, Any]], old: str, name: str
) -> None:
    (warning,) = old_imports[f"{old}.{name}"]["warnings"]
    assert "from ddpctx import" in warning, warning


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


@pytest.mark.parametrize(
    "statement", ["from ddpctx.wire import Wire", "from ddpctx.data import epochs"]
)
def test_a_from_import_of_an_old_name_warns_once_at_the_importing_line(statement: str) -> None:
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    {statement}\n"
        "print([(str(w.message), w.filename, w.lineno) for w in caught])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    ((message, filename, line),) = eval(result.stdout)  # one warning, naming the user's line
    assert (filename, line) == ("<string>", 4), message
    assert "moved to ddpctx." in message


def test_an_old_path_lists_its_names_and_refuses_unknown_ones() -> None:
    import ddpctx.wire as old  # type: ignore[import-not-found]

    assert old.__all__ == sorted(moved_names("ddpctx.wire"))
    with pytest.raises(AttributeError, match=r"'ddpctx\.wire' has no attribute 'nope'"):
        old.nope  # noqa: B018


@pytest.mark.parametrize("package", ["ddpctx.checkpoint", "ddpctx.data", "ddpctx.rankzero"])
def test_a_star_import_of_a_package_that_replaced_an_old_module_brings_its_names(
    package: str,
) -> None:
    """``from ddpctx.checkpoint import *`` gave the old module's names; it still does, warning."""
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    from {package} import *\n"
        "print(sorted(n for n in dir() if not n.startswith('_')), len(caught))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    names, warned = eval(result.stdout.strip().rpartition(" ")[0]), int(result.stdout.split()[-1])
    expected = set(moved_names(package))
    assert expected <= set(names), sorted(expected - set(names))
    assert warned == len(expected)
