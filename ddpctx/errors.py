"""Moved to :mod:`ddpctx.utils.errors`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.utils.errors import PEER_FAILED, PEER_GONE, describe, is_follow_on
from ddpctx.utils.moved import warn_moved

__all__ = [
    "PEER_FAILED",
    "PEER_GONE",
    "describe",
    "is_follow_on",
]

warn_moved(
    __name__,
    {
        "PEER_FAILED": "ddpctx.utils.errors",
        "PEER_GONE": "ddpctx.utils.errors",
        "describe": "ddpctx.utils.errors",
        "is_follow_on": "ddpctx.utils.errors",
    },
)
