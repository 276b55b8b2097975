"""Moved to :mod:`ddpctx.checkpoint.meta`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.checkpoint.meta import plain_meta
from ddpctx.utils.moved import warn_moved

__all__ = [
    "plain_meta",
]

warn_moved(
    __name__,
    {
        "plain_meta": "ddpctx.checkpoint.meta",
    },
)
