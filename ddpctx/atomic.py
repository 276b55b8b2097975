"""Moved to :mod:`ddpctx.utils.atomic`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.utils.atomic import (
    ABANDONED_AFTER_S,
    atomic_save,
    fsync_directory,
    is_abandoned,
    no_space_error,
    remove_abandoned,
    replace_dir,
    temporary_name,
)
from ddpctx.utils.moved import warn_moved

__all__ = [
    "ABANDONED_AFTER_S",
    "atomic_save",
    "fsync_directory",
    "is_abandoned",
    "no_space_error",
    "remove_abandoned",
    "replace_dir",
    "temporary_name",
]

warn_moved(
    __name__,
    {
        "ABANDONED_AFTER_S": "ddpctx.utils.atomic",
        "atomic_save": "ddpctx.utils.atomic",
        "fsync_directory": "ddpctx.utils.atomic",
        "is_abandoned": "ddpctx.utils.atomic",
        "no_space_error": "ddpctx.utils.atomic",
        "remove_abandoned": "ddpctx.utils.atomic",
        "replace_dir": "ddpctx.utils.atomic",
        "temporary_name": "ddpctx.utils.atomic",
    },
)
