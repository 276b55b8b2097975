"""Which samples each rank reads in an epoch, and where a resumed epoch picks up.

One epoch is one *order* of the dataset (a permutation seeded with the base
seed and the epoch, the one torch's ``DistributedSampler`` draws, or
``range`` without shuffling). Ranks are *dealt* positions of that order:
rank ``r`` of ``W`` gets positions ``r, r + W, r + 2W, ...``. With
``pad=True`` the order is first extended by repeating its start so every rank
gets the same count (torch's rule); with ``pad=False`` shards differ by at
most one and nothing repeats.

A mid-epoch position is saved as a :class:`Position`: per rank, how many
samples of its current deal were consumed, plus the positions already
consumed before that deal (``done``, a bit mask; empty unless the epoch was
itself resumed on another world size). Resuming:

- on the same world size, rank ``r`` skips exactly its first ``consumed[r]``
  samples, so the rest of the epoch is bit-identical to an uninterrupted run;
- on another world size, every consumed position is marked done and the
  positions left are dealt to the new ranks, so in that epoch no sample is
  repeated or skipped (``pad=True`` still pads the remainder so ranks stay in
  step; under ``drop_last`` it pads to whole batches, so none is dropped, and
  ``pad=False`` deals runs of a batch, so only the last short one is).

Skipping happens here, in the sampler: the skipped samples are never read.

Example:
    >>> sampler = ShardSampler(10, num_replicas=3, rank=2, shuffle=False)
    >>> list(sampler)
    [2, 5, 8]
    >>> sampler.resume(Position(epoch=0, world_size=3, consumed=(1, 1, 1)))
    >>> list(sampler)
    [5, 8]
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Sampler


@dataclass(frozen=True)
class Position:
    """How far an epoch got: ``consumed[r]`` samples of rank ``r``'s deal, after ``done``.

    ``done`` is a packed bit mask over the epoch's order positions (``np.packbits``),
    empty when the deal started at the beginning of the epoch.
    """

    epoch: int
    world_size: int
    consumed: tuple[int, ...]
    done: bytes = b""
    fill: int = 1  # the dealing sampler's fill (see ShardSampler), when ``done`` is not empty


def done_mask(length: int, packed: bytes) -> np.ndarray:
    """The boolean mask of consumed order positions (all False when ``packed`` is empty)."""
    if not packed:
        return np.zeros(length, dtype=bool)
    return np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=length).astype(bool)


def deal(
    length: int, world_size: int, rank: int, pad: bool, done: np.ndarray, fill: int = 1
) -> list[int]:
    """The order positions rank ``rank`` reads: the positions not ``done``, dealt round-robin.

    >>> deal(5, 2, 1, pad=True, done=np.zeros(5, dtype=bool))
    [1, 3, 0]
    """
    return share(np.flatnonzero(~done).tolist(), world_size, rank, pad, fill)


def share(items: list[int], world_size: int, rank: int, pad: bool, fill: int = 1) -> list[int]:
    """Rank ``rank``'s round-robin share of ``items``; ``pad`` first repeats their start.

    Dealing the order's samples gives what dealing its positions and then
    looking them up gives, without the lookup (an epoch's indices in one slice).
    ``fill > 1`` (a deal after a world-size change under ``drop_last``, with
    ``fill`` the batch size): with ``pad``, the items are repeated up to a
    multiple of ``world_size * fill``, so every rank gets whole batches and
    in the same number; without, they are dealt in runs of ``fill``, so only
    the last run can be short (the one batch ``drop_last`` drops).

    >>> share([7, 8, 9, 6, 5], 2, 1, pad=True)
    [8, 6, 7]
    >>> share([7, 8, 9, 6, 5], 2, 1, pad=True, fill=2)
    [8, 6, 7, 9]
    >>> share([7, 8, 9, 6, 5], 2, 1, pad=False, fill=2)
    [9, 6]
    """
    if fill > 1 and not pad:
        runs = [items[start : start + fill] for start in range(0, len(items), fill)]
        return [item for run in runs[rank::world_size] for item in run]
    if pad and items:
        total = math.ceil(len(items) / (world_size * fill)) * world_size * fill
        if total > len(items):
            items = (items * math.ceil(total / len(items)))[:total]
    return items[rank::world_size]


def deal_length(
    length: int, world_size: int, rank: int, pad: bool, left: int, fill: int = 1
) -> int:
    """``len(deal(...))`` without building it (``left``: positions not done)."""
    if pad:
        return math.ceil(left / (world_size * fill)) * fill if left else 0
    if fill == 1:
        return len(range(rank, left, world_size))
    runs = math.ceil(left / fill)
    mine = len(range(rank, runs, world_size))
    short = fill - left % fill if left % fill else 0  # the last run, if it is this rank's
    return mine * fill - (short if mine and (runs - 1) % world_size == rank else 0)


class ShardSampler(Sampler[int]):
    """Rank ``rank``'s share of one (shuffled) order of ``length`` samples, resumable.

    ``pad=True`` gives the shards torch's ``DistributedSampler`` gives (same
    order, same padding); ``pad=False`` gives uneven shards without repeats.
    ``fill``: the batch size when the loader drops short batches
    (``drop_last=True``), else 1. It shapes only the deal of what is left
    after a world-size change (see :func:`share`), so that ``drop_last``
    drops no sample of it (with ``pad``) or fewer than one batch (without).
    """

    def __init__(
        self,
        length: int,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        pad: bool = False,
        fill: int = 1,
    ) -> None:
        self.length = length
        self.fill = fill
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.pad = pad
        self.epoch = 0
        self._resume: Position | None = None  # applies to the next pass of its epoch only
        self.skip = 0  # samples of this rank's deal skipped by the pass under way
        self._done = b""  # the done mask of the pass under way

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume(self, position: Position) -> None:
        """Start the next pass of ``position.epoch`` where ``position`` left off.

        The sampler moves to that epoch at once, so ``len(loader)`` and
        ``loader.start`` describe the resumed epoch right after ``load_checkpoint``,
        before ``ctx.epochs`` calls :meth:`set_epoch` with it.
        """
        self.epoch = position.epoch
        same_deal = not position.done or position.fill == self.fill
        if position.world_size == self.num_replicas and same_deal:
            self._resume = position
            return
        started = done_mask(self.length, position.done)  # where that deal started
        fill = position.fill if position.done else 1  # an epoch's first deal is never filled
        done = started.copy()
        for rank, consumed in enumerate(position.consumed):
            dealt = deal(self.length, position.world_size, rank, self.pad, started, fill)
            for spot in dealt[:consumed]:
                done[spot] = True
        packed = np.packbits(done).tobytes()
        self._resume = Position(
            position.epoch, self.num_replicas, (0,) * self.num_replicas, packed, self.fill
        )

    def plan(self) -> tuple[int, bytes]:
        """(skip, done mask) for a pass starting now."""
        resume = self._resume
        if resume is None or resume.epoch != self.epoch:
            return 0, b""
        return resume.consumed[self.rank], resume.done

    def order(self) -> list[int]:
        """This epoch's order of sample indices (the same on every rank)."""
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def indices(self) -> list[int]:
        """Start a pass: the sample indices it reads, in order (what ``iter`` yields)."""
        self.skip, self._done = self.plan()
        self._resume = None  # a later pass of the same epoch (evaluation again) reads it all
        order = self.order()
        if self._done:  # only the samples at positions not done are dealt
            left = np.flatnonzero(~done_mask(self.length, self._done)).tolist()
            order = [order[spot] for spot in left]
        fill = self.fill if self._done else 1
        mine = share(order, self.num_replicas, self.rank, self.pad, fill)
        return mine[self.skip :] if self.skip else mine

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        skip, packed = self.plan()
        return max(self.deal_size(packed) - skip, 0)

    def done_count(self, packed: bytes) -> int:
        """How many order positions the packed ``done`` mask marks."""
        return int(done_mask(self.length, packed).sum()) if packed else 0

    def deal_size(self, packed: bytes) -> int:
        """How many samples this rank is dealt from the positions not ``done``."""
        left = self.length - self.done_count(packed)
        fill = self.fill if packed else 1
        return deal_length(self.length, self.num_replicas, self.rank, self.pad, left, fill)

    def done_bytes(self) -> bytes:
        """The done mask the pass under way started from."""
        return self._done
