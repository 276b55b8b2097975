"""The package's layers point one way: no module imports, even lazily, one that imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

PACKAGE = REPO / "ddpctx"


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
