"""Moved to :mod:`ddpctx.utils.identity`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.utils.identity import Placed, occupant, occupy, whoami
from ddpctx.utils.moved import warn_moved

__all__ = [
    "Placed",
    "occupant",
    "occupy",
    "whoami",
]

warn_moved(
    __name__,
    {
        "Placed": "ddpctx.utils.identity",
        "occupant": "ddpctx.utils.identity",
        "occupy": "ddpctx.utils.identity",
        "whoami": "ddpctx.utils.identity",
    },
)
