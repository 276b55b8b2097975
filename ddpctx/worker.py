"""Moved to :mod:`ddpctx.launching.worker`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.launching.worker import Outcome, Task, read_from, worker_main
from ddpctx.utils.moved import warn_moved

__all__ = [
    "Outcome",
    "Task",
    "read_from",
    "worker_main",
]

warn_moved(
    __name__,
    {
        "Outcome": "ddpctx.launching.worker",
        "Task": "ddpctx.launching.worker",
        "read_from": "ddpctx.launching.worker",
        "worker_main": "ddpctx.launching.worker",
    },
)
