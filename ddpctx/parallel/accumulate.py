"""Gradient accumulation: skip DDP's all-reduce on all but the last micro-batch.

DDP all-reduces gradients in every ``backward``. Accumulating N micro-batches
needs only one all-reduce, in the last backward before ``optimizer.step()``;
the others run inside DDP's ``no_sync()`` and accumulate locally. Summing
local gradients and all-reducing once gives the same result as all-reducing
each (the all-reduce is a sum divided by the world size), up to float
rounding.

:class:`Accumulation` decides which micro-batch syncs. Given the loader made
by ``ctx.dataloader`` it counts by the loader's position in its epoch, so the
sync points are the same after a mid-epoch resume, and the last batch of an
epoch always syncs (no gradient leaks into the next epoch).

Example:
    >>> model = torch.nn.Linear(2, 1)          # not DDP: never anything to skip
    >>> accumulation = Accumulation(model, every=2, world_size=1)
    >>> def micro_batch() -> bool:
    ...     with accumulation as sync:      # sync: this backward all-reduces
    ...         return sync
    >>> [micro_batch() for _ in range(4)]
    [False, True, False, True]
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ddpctx.data.loader import ShardLoader
from ddpctx.data.streamloader import StreamLoader


def no_sync(
    model: torch.nn.Module, enabled: bool, world_size: int
) -> contextlib.AbstractContextManager[Any]:
    """DDP's ``no_sync()`` when ``enabled`` and it matters; a no-op otherwise."""
    if enabled and world_size > 1 and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


class Accumulation:
    """``with accumulation as sync:`` around each micro-batch's forward and backward.

    ``sync`` is True on the micro-batch after which the optimizer should step
    (every ``every``-th, and the last of the loader's epoch); on the others the
    backward skips DDP's all-reduce.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        every: int,
        world_size: int,
        loader: DataLoader[Any] | None = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"every={every!r} must be a positive int: the number of micro-batches per "
                "optimizer step, e.g. ctx.accumulate(model, every=4)."
            )
        if isinstance(loader, StreamLoader):
            raise TypeError(
                "loader= is ctx.dataloader's loader over a stream (an IterableDataset), whose "
                "number of batches per epoch is not known ahead, so the epoch's last "
                "micro-batches cannot be told apart. Leave loader= out: micro-batches are then "
                "counted from the start, and an epoch's last partial group is stepped by you."
            )
        if loader is not None and not isinstance(loader, ShardLoader):
            raise TypeError(
                f"loader= must be a loader made by ctx.dataloader, got "
                f"{type(loader).__name__}; pass ctx.dataloader(...)'s result, or leave "
                "loader= out to count micro-batches from the start."
            )
        self.every = every
        self.model = model
        self.world_size = world_size
        self.loader: ShardLoader | None = loader
        self.count = 0
        self.sync = True
        self._skip: contextlib.AbstractContextManager[Any] | None = None

    def _is_sync_step(self) -> bool:
        if self.loader is None:
            self.count += 1
            return self.count % self.every == 0
        batch, last = self.loader.batch_numbers()
        return batch % self.every == 0 or batch >= last

    def __enter__(self) -> bool:
        if self._skip is not None:  # the outer block's no_sync would never be left
            raise RuntimeError(
                "ctx.accumulate(...) is already inside `with accumulation as sync:`; one block "
                "wraps one micro-batch and cannot be nested (the outer one would leave DDP "
                "skipping its all-reduce for good). Close the outer block before the next "
                "micro-batch."
            )
        self.sync = self._is_sync_step()
        self._skip = no_sync(self.model, not self.sync, self.world_size)
        self._skip.__enter__()
        return self.sync

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        skip, self._skip = self._skip, None
        if skip is not None:
            skip.__exit__(exc_type, exc, tb)
