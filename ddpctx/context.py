"""Moved to :mod:`ddpctx.session.context`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.session.context import DistributedSession, current, distributed
from ddpctx.session.distcontext import DistContext
from ddpctx.utils.moved import warn_moved

__all__ = [
    "DistContext",
    "DistributedSession",
    "current",
    "distributed",
]

warn_moved(
    __name__,
    {
        "DistContext": "ddpctx.session.distcontext",
        "DistributedSession": "ddpctx.session.context",
        "current": "ddpctx.session.context",
        "distributed": "ddpctx.session.context",
    },
)
