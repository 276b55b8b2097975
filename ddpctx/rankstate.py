"""Moved to :mod:`ddpctx.launching.taskstate`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.launching.taskstate import RankState, capture, replace_environ, restore, task_state
from ddpctx.utils.moved import warn_moved

__all__ = [
    "RankState",
    "capture",
    "replace_environ",
    "restore",
    "task_state",
]

warn_moved(
    __name__,
    {
        "RankState": "ddpctx.launching.taskstate",
        "capture": "ddpctx.launching.taskstate",
        "replace_environ": "ddpctx.launching.taskstate",
        "restore": "ddpctx.launching.taskstate",
        "task_state": "ddpctx.launching.taskstate",
    },
)
