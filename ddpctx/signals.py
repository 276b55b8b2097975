"""Moved to :mod:`ddpctx.session.signals`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.session.signals import GRACE_S, exit_on_sigterm
from ddpctx.utils.errors import SIGTERM_STATUS
from ddpctx.utils.moved import warn_moved

__all__ = [
    "GRACE_S",
    "SIGTERM_STATUS",
    "exit_on_sigterm",
]

warn_moved(
    __name__,
    {
        "GRACE_S": "ddpctx.session.signals",
        "SIGTERM_STATUS": "ddpctx.utils.errors",
        "exit_on_sigterm": "ddpctx.session.signals",
    },
)
