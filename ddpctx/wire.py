"""Moved to :mod:`ddpctx.reduce.wire`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.reduce.wire import Slot, Wire, leaf_of
from ddpctx.utils.moved import warn_moved

__all__ = [
    "Slot",
    "Wire",
    "leaf_of",
]

warn_moved(
    __name__,
    {
        "Slot": "ddpctx.reduce.wire",
        "Wire": "ddpctx.reduce.wire",
        "leaf_of": "ddpctx.reduce.wire",
    },
)
