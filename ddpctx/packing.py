"""Moved to :mod:`ddpctx.reduce.packing`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.reduce.packing import OPS, SMALL, OpSpec, Plan, leaf_ops, plan_key
from ddpctx.utils.moved import warn_moved

__all__ = [
    "OPS",
    "SMALL",
    "OpSpec",
    "Plan",
    "leaf_ops",
    "plan_key",
]

warn_moved(
    __name__,
    {
        "OPS": "ddpctx.reduce.packing",
        "OpSpec": "ddpctx.reduce.packing",
        "Plan": "ddpctx.reduce.packing",
        "SMALL": "ddpctx.reduce.packing",
        "leaf_ops": "ddpctx.reduce.packing",
        "plan_key": "ddpctx.reduce.packing",
    },
)
