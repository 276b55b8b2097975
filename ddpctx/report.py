"""Moved to :mod:`ddpctx.rankzero.report`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.rankzero.report import RankFilter, bar_on_main, get_logger, progress
from ddpctx.utils.moved import warn_moved

__all__ = [
    "RankFilter",
    "bar_on_main",
    "get_logger",
    "progress",
]

warn_moved(
    __name__,
    {
        "RankFilter": "ddpctx.rankzero.report",
        "bar_on_main": "ddpctx.rankzero.report",
        "get_logger": "ddpctx.rankzero.report",
        "progress": "ddpctx.rankzero.report",
    },
)
