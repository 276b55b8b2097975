"""Moved to :mod:`ddpctx.hang.watchdog`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.hang.settings import (
    MAX_DEFAULT_HANG_TIMEOUT_S,
    ON_HANG,
    HangSettings,
    resolve_hang_settings,
)
from ddpctx.hang.watchdog import (
    ANSWER_WAIT_S,
    RAISE_GRACE_S,
    STOP_WAIT_S,
    TICK_S,
    Doctor,
    Watchdog,
)
from ddpctx.utils.moved import warn_moved

__all__ = [
    "ANSWER_WAIT_S",
    "MAX_DEFAULT_HANG_TIMEOUT_S",
    "ON_HANG",
    "RAISE_GRACE_S",
    "STOP_WAIT_S",
    "TICK_S",
    "Doctor",
    "HangSettings",
    "Watchdog",
    "resolve_hang_settings",
]

warn_moved(
    __name__,
    {
        "ANSWER_WAIT_S": "ddpctx.hang.watchdog",
        "Doctor": "ddpctx.hang.watchdog",
        "HangSettings": "ddpctx.hang.settings",
        "MAX_DEFAULT_HANG_TIMEOUT_S": "ddpctx.hang.settings",
        "ON_HANG": "ddpctx.hang.settings",
        "RAISE_GRACE_S": "ddpctx.hang.watchdog",
        "STOP_WAIT_S": "ddpctx.hang.watchdog",
        "TICK_S": "ddpctx.hang.watchdog",
        "Watchdog": "ddpctx.hang.watchdog",
        "resolve_hang_settings": "ddpctx.hang.settings",
    },
)
