"""Moved to :mod:`ddpctx.hang.report`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.hang.report import (
    PREFIX,
    Exchange,
    RankState,
    diagnose,
    folded_stack,
    format_report,
    main_thread_frame,
    snapshot,
)
from ddpctx.utils.moved import warn_moved

__all__ = [
    "PREFIX",
    "Exchange",
    "RankState",
    "diagnose",
    "folded_stack",
    "format_report",
    "main_thread_frame",
    "snapshot",
]

warn_moved(
    __name__,
    {
        "Exchange": "ddpctx.hang.report",
        "PREFIX": "ddpctx.hang.report",
        "RankState": "ddpctx.hang.report",
        "diagnose": "ddpctx.hang.report",
        "folded_stack": "ddpctx.hang.report",
        "format_report": "ddpctx.hang.report",
        "main_thread_frame": "ddpctx.hang.report",
        "snapshot": "ddpctx.hang.report",
    },
)
