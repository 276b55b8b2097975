"""Moved to :mod:`ddpctx.data.sampling`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.data.sampling import Position, ShardSampler, deal, deal_length, done_mask
from ddpctx.utils.moved import warn_moved

__all__ = [
    "Position",
    "ShardSampler",
    "deal",
    "deal_length",
    "done_mask",
]

warn_moved(
    __name__,
    {
        "Position": "ddpctx.data.sampling",
        "ShardSampler": "ddpctx.data.sampling",
        "deal": "ddpctx.data.sampling",
        "deal_length": "ddpctx.data.sampling",
        "done_mask": "ddpctx.data.sampling",
    },
)
