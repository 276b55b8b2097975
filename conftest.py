"""Collection rules for the whole repository (the tests' fixtures live in tests/conftest.py).

The flat modules left at the old import paths (``ddpctx/context.py``, ...)
only re-export moved names with a ``DeprecationWarning``: they hold no
doctests, and importing them for doctest collection would only warn.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).parent / "ddpctx"

collect_ignore = [
    str(module)
    for module in sorted(_PACKAGE.glob("*.py"))
    if module.read_text(encoding="utf-8").startswith('"""Moved to ')
]
