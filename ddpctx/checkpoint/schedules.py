"""Step-counted schedulers across a world-size change: named at load, never left to drift.

A scheduler stepped once per batch counts *steps*; its horizon
(``OneCycleLR.total_steps``, ``total_iters``, ``T_max``, ...) was computed
from the steps per epoch of the run that made it. Resumed on another world
size, every rank reads a different number of batches per epoch, so the saved
horizon is wrong: going from 2 to 3 ranks, a ``OneCycleLR(total_steps=30)``
ended at step 23 with its learning rate still far from the end of the cycle;
going from 3 to 2 it raised "Tried to step 19 times" halfway through an epoch.

ddpctx cannot rescale such a scheduler exactly (the shape of the remaining
cycle depends on how the user built it), so at ``load_checkpoint(...,
allow_world_size_change=True)``, when the steps per epoch of a saved loader
change:

- a ``OneCycleLR`` (always counted in steps, and it raises past its total)
  is an error naming its total and current step, the old and new steps per
  epoch, and the fix;
- any other scheduler with a horizon gets the same facts as a warning (it may
  be stepped per epoch, which a world-size change does not affect).

Example:
    >>> steps_per_epoch(length=100, world_size=2, batch_size=10, pad=True)
    5
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from ddpctx.data.book import SavedLoader

#: Scheduler attributes that hold a horizon counted in scheduler steps.
HORIZONS = ("total_steps", "total_iters", "T_max", "T_0", "step_size_up")


def steps_per_epoch(length: int, world_size: int, batch_size: int, pad: bool) -> int:
    """Batches rank 0 reads in a whole epoch (the most any rank reads)."""
    per_rank = math.ceil(length / world_size)
    return math.ceil(per_rank / batch_size) if batch_size else 0


def check_scheduler(
    scheduler: Any,
    saved_state: dict[str, Any] | None,
    saved: list[SavedLoader],
    new_world_size: int,
    where: str,
) -> None:
    """Refuse (OneCycleLR) or warn (others with a horizon) when steps per epoch change."""
    if scheduler is None:
        return
    horizon = next((name for name in HORIZONS if hasattr(scheduler, name)), None)
    if horizon is None:
        return
    for loader in sorted(saved, key=lambda record: not record.pad):  # training loaders first
        old = steps_per_epoch(loader.length, loader.world_size, loader.batch_size, loader.pad)
        new = steps_per_epoch(loader.length, new_world_size, loader.batch_size, loader.pad)
        if old != new and old and new:
            break
    else:
        return
    name = type(scheduler).__name__
    state = saved_state or {}
    total = state.get(horizon, getattr(scheduler, horizon))
    current = state.get("last_epoch", "?")
    facts = (
        f"{where} was saved by {loader.world_size} ranks reading {old} batches per epoch of "
        f"{loader.description}; on {new_world_size} ranks they read {new}. The scheduler "
        f"{name} ({horizon}={total}, at step {current} when saved) counts steps from the old "
        "run"
    )
    if horizon == "total_steps":
        raise ValueError(
            f"{facts}: it would end too early or raise 'Tried to step ... times' later. Resume "
            f"on {loader.world_size} ranks, or leave scheduler= out of load_checkpoint and build "
            f"a new {name} for the steps left (e.g. total_steps = remaining epochs x {new} "
            "batches)."
        )
    warnings.warn(
        f"{facts}. If it is stepped once per batch, its schedule no longer fits: rebuild it "
        f"for {new} batches per epoch. If it is stepped once per epoch, nothing changes.",
        RuntimeWarning,
        stacklevel=4,
    )
