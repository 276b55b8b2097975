"""Moved to :mod:`ddpctx.reduce.collectives`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.reduce.collectives import (
    Reduction,
    ReductionError,
    Site,
    all_reduce_tree,
    check_op,
    comm_device,
    failed_reduction,
    group_size,
    report_failure,
)
from ddpctx.reduce.objects import all_gather_objects, broadcast_object
from ddpctx.utils.moved import warn_moved

__all__ = [
    "Reduction",
    "ReductionError",
    "Site",
    "all_gather_objects",
    "all_reduce_tree",
    "broadcast_object",
    "check_op",
    "comm_device",
    "failed_reduction",
    "group_size",
    "report_failure",
]

warn_moved(
    __name__,
    {
        "Reduction": "ddpctx.reduce.collectives",
        "ReductionError": "ddpctx.reduce.collectives",
        "Site": "ddpctx.reduce.collectives",
        "all_gather_objects": "ddpctx.reduce.objects",
        "all_reduce_tree": "ddpctx.reduce.collectives",
        "broadcast_object": "ddpctx.reduce.objects",
        "check_op": "ddpctx.reduce.collectives",
        "comm_device": "ddpctx.reduce.collectives",
        "failed_reduction": "ddpctx.reduce.collectives",
        "group_size": "ddpctx.reduce.collectives",
        "report_failure": "ddpctx.reduce.collectives",
    },
)
