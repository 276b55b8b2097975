"""Moved to :mod:`ddpctx.checkpoint.resume`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.checkpoint.resume import Gather, derived_seed, load, save
from ddpctx.utils.moved import warn_moved

__all__ = [
    "Gather",
    "derived_seed",
    "load",
    "save",
]

warn_moved(
    __name__,
    {
        "Gather": "ddpctx.checkpoint.resume",
        "derived_seed": "ddpctx.checkpoint.resume",
        "load": "ddpctx.checkpoint.resume",
        "save": "ddpctx.checkpoint.resume",
    },
)
