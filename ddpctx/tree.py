"""Moved to :mod:`ddpctx.reduce.tree`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.reduce.tree import Leaf, describe, flatten, signature
from ddpctx.utils.moved import warn_moved

__all__ = [
    "Leaf",
    "describe",
    "flatten",
    "signature",
]

warn_moved(
    __name__,
    {
        "Leaf": "ddpctx.reduce.tree",
        "describe": "ddpctx.reduce.tree",
        "flatten": "ddpctx.reduce.tree",
        "signature": "ddpctx.reduce.tree",
    },
)
