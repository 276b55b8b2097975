"""Moved to :mod:`ddpctx.data.loader`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.data.loader import SeededBatches, SeededIndices, ShardLoader, to_device
from ddpctx.utils.moved import warn_moved

__all__ = [
    "SeededBatches",
    "SeededIndices",
    "ShardLoader",
    "to_device",
]

warn_moved(
    __name__,
    {
        "SeededBatches": "ddpctx.data.loader",
        "SeededIndices": "ddpctx.data.loader",
        "ShardLoader": "ddpctx.data.loader",
        "to_device": "ddpctx.data.loader",
    },
)
