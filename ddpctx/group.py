"""Moved to :mod:`ddpctx.session.group`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.session.group import (
    DESTROY_TIMEOUT_S,
    TCPStore,
    destroy_group_bounded,
    formation_store,
    host_store,
    init_group,
    init_kwargs,
    loopback_gloo,
    tcp_url,
)
from ddpctx.utils.errors import is_follow_on_exit, record_for_torchrun, should_record
from ddpctx.utils.moved import warn_moved

__all__ = [
    "DESTROY_TIMEOUT_S",
    "TCPStore",
    "destroy_group_bounded",
    "formation_store",
    "host_store",
    "init_group",
    "init_kwargs",
    "is_follow_on_exit",
    "loopback_gloo",
    "record_for_torchrun",
    "should_record",
    "tcp_url",
]

warn_moved(
    __name__,
    {
        "DESTROY_TIMEOUT_S": "ddpctx.session.group",
        "TCPStore": "ddpctx.session.group",
        "destroy_group_bounded": "ddpctx.session.group",
        "formation_store": "ddpctx.session.group",
        "host_store": "ddpctx.session.group",
        "init_group": "ddpctx.session.group",
        "init_kwargs": "ddpctx.session.group",
        "is_follow_on_exit": "ddpctx.utils.errors",
        "loopback_gloo": "ddpctx.session.group",
        "record_for_torchrun": "ddpctx.utils.errors",
        "should_record": "ddpctx.utils.errors",
        "tcp_url": "ddpctx.session.group",
    },
)
