"""Moved to :mod:`ddpctx.rankzero.decorators`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.rankzero.decorators import all_reduced, rank_zero_first, rank_zero_only
from ddpctx.utils.moved import warn_moved

__all__ = [
    "all_reduced",
    "rank_zero_first",
    "rank_zero_only",
]

warn_moved(
    __name__,
    {
        "all_reduced": "ddpctx.rankzero.decorators",
        "rank_zero_first": "ddpctx.rankzero.decorators",
        "rank_zero_only": "ddpctx.rankzero.decorators",
    },
)
