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
  epoch (``drop_last`` counted), and the fix: the total for a new one, the
  batches left in the resumed epoch (mapped as the loader will read them)
  plus the later epochs' batches;
- any other scheduler with a horizon gets the same facts as a warning (it may
  be stepped per epoch, which a world-size change does not affect).

Example:
    >>> steps_per_epoch(length=100, world_size=2, batch_size=10, pad=True)
    5
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ddpctx.data.book import SavedLoader
from ddpctx.data.sampling import ShardSampler
from ddpctx.utils.warn import warn_user

#: Scheduler attributes that hold a horizon counted in scheduler steps.
HORIZONS = ("total_steps", "total_iters", "T_max", "T_0", "step_size_up")


def steps_per_epoch(
    length: int, world_size: int, batch_size: int, pad: bool, drop_last: bool = False
) -> int:
    """Batches rank 0 reads in a whole epoch (the most any rank reads).

    >>> steps_per_epoch(length=320, world_size=3, batch_size=16, pad=True, drop_last=True)
    6
    """
    per_rank = math.ceil(length / world_size)
    return _batches(per_rank, batch_size, drop_last)


def _batches(samples: int, batch_size: int, drop_last: bool) -> int:
    if not batch_size:
        return 0
    return samples // batch_size if drop_last else math.ceil(samples / batch_size)


def steps_left(loader: SavedLoader, world_size: int) -> int | None:
    """Batches rank 0 reads in the rest of the saved epoch on ``world_size`` ranks.

    None when the loader was saved at no mid-epoch position (the next epoch
    starts whole).
    """
    if loader.position is None:
        return None
    fill = loader.batch_size if loader.drop_last and loader.batch_size else 1
    sampler = ShardSampler(loader.length, world_size, 0, pad=loader.pad, fill=fill)
    sampler.resume(loader.position)  # the mapping load_checkpoint gives the loader
    return _batches(len(sampler), loader.batch_size, loader.drop_last)


def check_scheduler(
    scheduler: Any,
    saved_state: dict[str, Any] | None,
    saved: Sequence[object],
    new_world_size: int,
    where: str,
) -> None:
    """Refuse (OneCycleLR) or warn (others with a horizon) when steps per epoch change.

    Streams (whose steps per epoch nobody knows ahead) are not counted.
    """
    if scheduler is None:
        return
    counted = [loader for loader in saved if isinstance(loader, SavedLoader)]
    horizon = next((name for name in HORIZONS if hasattr(scheduler, name)), None)
    if horizon is None:
        return
    for loader in sorted(counted, key=lambda record: not record.pad):  # training loaders first
        shape = (loader.batch_size, loader.pad, loader.drop_last)
        old = steps_per_epoch(loader.length, loader.world_size, *shape)
        new = steps_per_epoch(loader.length, new_world_size, *shape)
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
        left = steps_left(loader, new_world_size)
        epoch = loader.position.epoch if loader.position is not None else None
        if left is None or epoch is None:
            total = f"total_steps = remaining epochs x {new} batches"
        else:
            total = (
                f"total_steps = {left} + {new} x (epochs after epoch {epoch}): on "
                f"{new_world_size} ranks the resumed epoch {epoch} has {left} batch(es) left "
                f"and each later epoch {new}"
            )
        raise ValueError(
            f"{facts}: it would end too early or raise 'Tried to step ... times' later. Resume "
            f"on {loader.world_size} ranks, or leave scheduler= out of load_checkpoint and build "
            f"a new {name} for the steps left ({total})."
        )
    warn_user(
        f"{facts}. If it is stepped once per batch, its schedule no longer fits: rebuild it "
        f"for {new} batches per epoch. If it is stepped once per epoch, nothing changes.",
        RuntimeWarning,
    )
