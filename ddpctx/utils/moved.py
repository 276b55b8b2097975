"""Old import paths that keep working for a release, with a ``DeprecationWarning``.

When the flat modules moved into subpackages, every name that could be imported
from an old path (``from ddpctx.env import detect_launch``) kept working: a
shim module at the old path imports the names from their new homes and warns
once, and a package that replaced an old module of the same name
(``ddpctx.rankzero``, ``ddpctx.data``, ``ddpctx.checkpoint``) serves the old
module's names through a module ``__getattr__`` that warns on each use.

The warning names, per name, where to import it from now: ``ddpctx`` itself
for the public API (``from ddpctx import RankZeroError``), else the module that
defines it.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from ddpctx.rankzero import RankZeroError
>>> print(caught[0].message)  # doctest: +NORMALIZE_WHITESPACE
ddpctx.rankzero.RankZeroError moved to ddpctx.rankzero.outcome;
import it from ddpctx itself (e.g. `from ddpctx import RankZeroError`).

This module knows nothing of the names it serves: each caller passes its table
``{name: new home module}``.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def _public(name: str) -> bool:
    """Whether ``from ddpctx import name`` works (read from the loaded package, never imported)."""
    return name in getattr(sys.modules.get("ddpctx"), "__all__", ())


def moved_message(old: str, homes: Mapping[str, str]) -> str:
    """The warning for importing ``old``, whose names now live in ``homes``.

    >>> moved_message("ddpctx.seeding", {"seed_everything": "ddpctx.utils.seeding"})
    'ddpctx.seeding moved to ddpctx.utils.seeding; import seed_everything from there.'
    """
    by_home: dict[str, list[str]] = {}
    for name, home in sorted(homes.items()):
        by_home.setdefault(home, []).append(name)
    main = max(by_home, key=lambda home: len(by_home[home]))
    also = "".join(
        f", {', '.join(names)} to {home}" for home, names in by_home.items() if home != main
    )
    public = sorted(name for name in homes if _public(name))
    private = sorted(name for name in homes if not _public(name))
    where = []
    if private:
        sources = "from there" if len(by_home) == 1 else "from those modules"
        where.append(f"import {', '.join(private)} {sources}")
    if public:
        where.append(
            f"import {', '.join(public)} from ddpctx itself (e.g. `from ddpctx import {public[0]}`)"
        )
    return f"{old} moved to {main}{also}; {'; '.join(where)}."


def warn_moved(old: str, homes: Mapping[str, str]) -> None:
    """Warn, from a shim module at the old path ``old``, where its names moved."""
    # stacklevel: this function, the shim's module body, then the importer.
    warnings.warn(moved_message(old, homes), DeprecationWarning, stacklevel=3)


def moved_attributes(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` serving an old module's ``homes``, with a warning.

    Unknown names raise ``AttributeError`` as usual, so submodule imports and
    ``hasattr`` behave as without it.
    """

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        source = f"ddpctx itself (e.g. `from ddpctx import {name}`)" if _public(name) else "there"
        warnings.warn(
            f"{package}.{name} moved to {home}; import it from {source}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)

    return __getattr__
