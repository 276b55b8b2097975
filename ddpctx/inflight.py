"""Moved to :mod:`ddpctx.hang.inflight`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.hang.inflight import (
    DDP_BACKWARD,
    TRACKED,
    HangError,
    TrackedWork,
    Tracker,
    install,
    is_library_file,
    short_path,
    user_site,
)
from ddpctx.hang.peers import ranks_text
from ddpctx.utils.moved import warn_moved

__all__ = [
    "DDP_BACKWARD",
    "TRACKED",
    "HangError",
    "TrackedWork",
    "Tracker",
    "install",
    "is_library_file",
    "ranks_text",
    "short_path",
    "user_site",
]

warn_moved(
    __name__,
    {
        "DDP_BACKWARD": "ddpctx.hang.inflight",
        "HangError": "ddpctx.hang.inflight",
        "TRACKED": "ddpctx.hang.inflight",
        "TrackedWork": "ddpctx.hang.inflight",
        "Tracker": "ddpctx.hang.inflight",
        "install": "ddpctx.hang.inflight",
        "is_library_file": "ddpctx.hang.inflight",
        "ranks_text": "ddpctx.hang.peers",
        "short_path": "ddpctx.hang.inflight",
        "user_site": "ddpctx.hang.inflight",
    },
)
