"""Moved to :mod:`ddpctx.utils.env`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.utils.env import (
    DEFAULT_TIMEOUT,
    KNOWN_BACKENDS,
    LAUNCHER_VARIABLE,
    MAX_TIMEOUT_S,
    MIN_TIMEOUT_S,
    Launcher,
    LaunchInfo,
    check_timeout,
    detect_launch,
    resolve_backend,
    resolve_device_index,
    resolve_timeout,
    slurm_port,
)
from ddpctx.utils.hostlist import parse_nodelist, parse_tasks_per_node
from ddpctx.utils.moved import warn_moved

__all__ = [
    "DEFAULT_TIMEOUT",
    "KNOWN_BACKENDS",
    "LAUNCHER_VARIABLE",
    "MAX_TIMEOUT_S",
    "MIN_TIMEOUT_S",
    "LaunchInfo",
    "Launcher",
    "check_timeout",
    "detect_launch",
    "parse_nodelist",
    "parse_tasks_per_node",
    "resolve_backend",
    "resolve_device_index",
    "resolve_timeout",
    "slurm_port",
]

warn_moved(
    __name__,
    {
        "DEFAULT_TIMEOUT": "ddpctx.utils.env",
        "KNOWN_BACKENDS": "ddpctx.utils.env",
        "LAUNCHER_VARIABLE": "ddpctx.utils.env",
        "LaunchInfo": "ddpctx.utils.env",
        "Launcher": "ddpctx.utils.env",
        "MAX_TIMEOUT_S": "ddpctx.utils.env",
        "MIN_TIMEOUT_S": "ddpctx.utils.env",
        "check_timeout": "ddpctx.utils.env",
        "detect_launch": "ddpctx.utils.env",
        "parse_nodelist": "ddpctx.utils.hostlist",
        "parse_tasks_per_node": "ddpctx.utils.hostlist",
        "resolve_backend": "ddpctx.utils.env",
        "resolve_device_index": "ddpctx.utils.env",
        "resolve_timeout": "ddpctx.utils.env",
        "slurm_port": "ddpctx.utils.env",
    },
)
