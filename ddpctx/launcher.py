"""Moved to :mod:`ddpctx.launching.launcher`.

This old path still imports, with a ``DeprecationWarning``.

Import these names from the package instead (``from ddpctx import launch``),
which does not change when modules move.
"""

from __future__ import annotations

import warnings

from ddpctx.launching.failures import RankError, RankTimeoutError
from ddpctx.launching.launcher import launch

__all__ = ["RankError", "RankTimeoutError", "launch"]

warnings.warn(
    "ddpctx.launcher moved to ddpctx.launching.launcher; "
    "import RankError, RankTimeoutError, launch from ddpctx itself "
    "(e.g. `from ddpctx import launch`).",
    DeprecationWarning,
    stacklevel=2,
)
