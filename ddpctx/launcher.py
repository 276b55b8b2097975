"""Moved to :mod:`ddpctx.launching.launcher`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.launching.echo import ECHO_INTERVAL_S
from ddpctx.launching.failures import (
    RankError,
    RankSkipped,
    RankTimeoutError,
    RemoteTraceback,
    summary,
)
from ddpctx.launching.launcher import launch
from ddpctx.launching.pool import FINALLY_GRACE_S, FOLLOW_ON_GRACE_S, STACK_DUMP_WAIT_S, RankPool
from ddpctx.utils.moved import warn_moved

__all__ = [
    "ECHO_INTERVAL_S",
    "FINALLY_GRACE_S",
    "FOLLOW_ON_GRACE_S",
    "STACK_DUMP_WAIT_S",
    "RankError",
    "RankPool",
    "RankSkipped",
    "RankTimeoutError",
    "RemoteTraceback",
    "launch",
    "summary",
]

warn_moved(
    __name__,
    {
        "ECHO_INTERVAL_S": "ddpctx.launching.echo",
        "FINALLY_GRACE_S": "ddpctx.launching.pool",
        "FOLLOW_ON_GRACE_S": "ddpctx.launching.pool",
        "RankError": "ddpctx.launching.failures",
        "RankPool": "ddpctx.launching.pool",
        "RankSkipped": "ddpctx.launching.failures",
        "RankTimeoutError": "ddpctx.launching.failures",
        "RemoteTraceback": "ddpctx.launching.failures",
        "STACK_DUMP_WAIT_S": "ddpctx.launching.pool",
        "launch": "ddpctx.launching.launcher",
        "summary": "ddpctx.launching.failures",
    },
)
