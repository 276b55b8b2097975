"""Moved to :mod:`ddpctx.utils.seeding`.

This old path still imports, with a ``DeprecationWarning`` naming each name's new home.
"""

from __future__ import annotations

from ddpctx.utils.moved import warn_moved
from ddpctx.utils.seeding import (
    MAX_SEED,
    enable_deterministic,
    rng_state,
    seed_everything,
    seed_worker,
    set_rng_state,
    validate_seed,
    worker_seed,
)

__all__ = [
    "MAX_SEED",
    "enable_deterministic",
    "rng_state",
    "seed_everything",
    "seed_worker",
    "set_rng_state",
    "validate_seed",
    "worker_seed",
]

warn_moved(
    __name__,
    {
        "MAX_SEED": "ddpctx.utils.seeding",
        "enable_deterministic": "ddpctx.utils.seeding",
        "rng_state": "ddpctx.utils.seeding",
        "seed_everything": "ddpctx.utils.seeding",
        "seed_worker": "ddpctx.utils.seeding",
        "set_rng_state": "ddpctx.utils.seeding",
        "validate_seed": "ddpctx.utils.seeding",
        "worker_seed": "ddpctx.utils.seeding",
    },
)
