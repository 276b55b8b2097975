"""Moved to :mod:`ddpctx.parallel.accumulate`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.parallel.accumulate import Accumulation, no_sync
from ddpctx.utils.moved import warn_moved

__all__ = [
    "Accumulation",
    "no_sync",
]

warn_moved(
    __name__,
    {
        "Accumulation": "ddpctx.parallel.accumulate",
        "no_sync": "ddpctx.parallel.accumulate",
    },
)
