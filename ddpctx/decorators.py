"""Moved to :mod:`ddpctx.rankzero.decorators`.

This old path still imports, with a ``DeprecationWarning``.

Import these names from the package instead (``from ddpctx import rank_zero_only``),
which does not change when modules move.
"""

from __future__ import annotations

import warnings

from ddpctx.rankzero.decorators import all_reduced, rank_zero_first, rank_zero_only

__all__ = ["all_reduced", "rank_zero_first", "rank_zero_only"]

warnings.warn(
    "ddpctx.decorators moved to ddpctx.rankzero.decorators; "
    "import all_reduced, rank_zero_first, rank_zero_only from ddpctx itself "
    "(e.g. `from ddpctx import rank_zero_only`).",
    DeprecationWarning,
    stacklevel=2,
)
