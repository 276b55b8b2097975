"""Moved to :mod:`ddpctx.session.formation`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.session.formation import FORMATION_ATTEMPTS, form_group, is_mesh_race
from ddpctx.utils.moved import warn_moved

__all__ = [
    "FORMATION_ATTEMPTS",
    "form_group",
    "is_mesh_race",
]

warn_moved(
    __name__,
    {
        "FORMATION_ATTEMPTS": "ddpctx.session.formation",
        "form_group": "ddpctx.session.formation",
        "is_mesh_race": "ddpctx.session.formation",
    },
)
