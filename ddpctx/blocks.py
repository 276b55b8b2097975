"""Moved to :mod:`ddpctx.rankzero.blocks`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.rankzero.blocks import atomic_dir, rank_zero_block
from ddpctx.utils.moved import warn_moved

__all__ = [
    "atomic_dir",
    "rank_zero_block",
]

warn_moved(
    __name__,
    {
        "atomic_dir": "ddpctx.rankzero.blocks",
        "rank_zero_block": "ddpctx.rankzero.blocks",
    },
)
