"""The DataLoader ``ctx.dataloader`` returns: batches on the device, a position, seeded workers.

:class:`ShardLoader` is a ``torch.utils.data.DataLoader`` (``isinstance`` holds,
``len`` works) that adds three things to iteration:

- **Batches on the device.** Every tensor inside the batch (tuples, lists,
  dicts and other mappings, namedtuples, dataclasses) is moved to ``device``,
  ``non_blocking`` when pinned memory makes that safe; other leaves are left
  alone, and the user's own objects are shallow-copied, never rebuilt
  (:func:`to_device`).
- **A position.** It counts the batches it has handed out in the current pass,
  so a checkpoint can record how far the epoch got (:meth:`position`).
- **Per-batch worker seeds.** Each batch's index list carries a seed derived
  from (base seed, rank, epoch, batch position); a worker re-seeds
  ``random``, NumPy and torch from it before it reads the batch. A batch's
  augmentation therefore depends on which batch it is, not on which worker
  read it, how many batches that worker read before, or whether the workers
  are persistent -- which is what lets a resumed epoch, and
  ``persistent_workers=True``, give exactly the batches an uninterrupted run
  gives. Without workers nothing is re-seeded: the main process's generators
  (saved in every checkpoint) drive the dataset.

The re-seeding hooks the worker's iteration over the index list, which is how
torch's fetcher reads a batch (``[dataset[i] for i in indices]``). A dataset
with its own ``__getitems__`` that never iterates its argument is not
re-seeded per batch (its workers are still seeded per rank, worker and epoch).

Example:
    >>> from collections import namedtuple
    >>> Pair = namedtuple("Pair", "x y")
    >>> to_device(Pair(torch.ones(1), "label"), torch.device("cpu"), False)
    Pair(x=tensor([1.]), y='label')
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from ddpctx.data.sampling import Position, ShardSampler
from ddpctx.utils.forking import collector_frozen
from ddpctx.utils.seeding import seed_worker, worker_seed


def to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    """``batch`` with every tensor inside it moved to ``device``; user objects are never rebuilt.

    A container whose tensors are already there comes back as the same object.
    Otherwise a *shallow copy* gets the moved items: a dataclass keeps every
    attribute and is not constructed again (``__post_init__`` does not run
    twice); a ``dict`` subclass (``OrderedDict``, ``defaultdict``, EasyDict-style
    attribute dicts) and any other mutable mapping (``UserDict``, HuggingFace's
    ``BatchEncoding``) keep their type.
    """
    if type(batch) in _PLAIN_SEQUENCES:  # the usual batch: checked in 0.3 us, via .to() 3.6 us
        for item in batch:
            # Plain tensors only: a subclass (a Parameter, a user type) still gets its .to().
            if type(item) is not torch.Tensor or item.device != device:
                break
        else:
            return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        items = [to_device(item, device, non_blocking) for item in batch]
        return batch if _same(items, batch) else type(batch)(*items)
    if isinstance(batch, (list, tuple)):
        items = [to_device(item, device, non_blocking) for item in batch]
        if _same(items, batch):
            return batch
        if type(batch) in (list, tuple):
            return type(batch)(items)
        if isinstance(batch, list):  # a list subclass: keep it and its attributes
            moved_list = copy.copy(batch)
            moved_list[:] = items
            return moved_list
        return type(batch)(items)
    if isinstance(batch, MutableMapping):  # dict, its subclasses, UserDict, BatchEncoding
        moved = {key: to_device(value, device, non_blocking) for key, value in batch.items()}
        if all(moved[key] is value for key, value in batch.items()):
            return batch
        if type(batch) is dict:
            return moved
        target = copy.copy(batch)  # keeps the type and its attributes (Counter, defaultdict)
        for key, value in moved.items():
            target[key] = value
        return target
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = [field.name for field in dataclasses.fields(batch)]
        values = {name: to_device(getattr(batch, name), device, non_blocking) for name in fields}
        if all(values[name] is getattr(batch, name) for name in fields):
            return batch
        moved_instance = copy.copy(batch)
        for name, value in values.items():
            object.__setattr__(moved_instance, name, value)  # also for frozen dataclasses
        return moved_instance
    return batch


_PLAIN_SEQUENCES = (list, tuple)


def _same(items: list[Any], originals: Any) -> bool:
    return all(item is original for item, original in zip(items, originals, strict=True))


class SeededIndices(list[int]):
    """A batch's indices, carrying what a worker seeds itself from before reading them."""

    key: tuple[int, int, int, int] = (0, 0, 0, 0)  # (base seed, rank, first position, epoch)
    _applied: bool = False

    def __iter__(self) -> Iterator[int]:
        if not self._applied and get_worker_info() is not None:  # only ever inside a worker
            self._applied = True
            base, rank, first, epoch = self.key
            # "worker" slot 2**31 + first sample position: never equal to a worker-start seed.
            seed_worker(worker_seed(base, rank, 2**31 + first, epoch))
        return super().__iter__()


class SeededBatches(Sampler[list[int]]):
    """Batches of ``sampler``'s indices, each tagged with its per-batch seed.

    ``tagged = False`` yields plain lists: for a loader without workers, where
    nothing is re-seeded, so a tag would only cost time.
    """

    tagged = True

    def __init__(
        self, sampler: ShardSampler, batch_size: int, drop_last: bool, base_seed: int
    ) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.base_seed = base_seed

    def _tagged(self, indices: list[int], first: int) -> SeededIndices:
        batch = SeededIndices(indices)
        batch.key = (self.base_seed, self.sampler.rank, first, self.sampler.epoch)
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        indices = self.sampler.indices()
        size = self.batch_size
        starts = range(0, len(indices) - size + 1 if self.drop_last else len(indices), size)
        if not self.tagged:
            for start in starts:
                yield indices[start : start + size]
            return
        skipped = self.sampler.skip
        for start in starts:
            yield self._tagged(indices[start : start + size], skipped + start)

    def __len__(self) -> int:
        if self.drop_last:
            return len(self.sampler) // self.batch_size
        return -(-len(self.sampler) // self.batch_size)


@dataclasses.dataclass(slots=True)
class _PassState:
    """The pass under way, or the last one run; a plain object, not loader attributes.

    Counting a batch is then one slot store: an attribute of the loader goes
    through ``DataLoader.__setattr__``, a Python method, on every batch.
    """

    epoch: int = -1  # the epoch of the pass
    available: int = 0  # samples it has to hand out
    batches_out: int = 0  # batches it has handed out
    complete: bool = False
    running: bool = False


class ShardLoader(DataLoader[Any]):
    """A DataLoader over one rank's shard that moves batches and knows its position.

    ``len(loader)`` is always the number of batches of this rank's *whole*
    epoch, the same with and without a resume. :attr:`start` is how many of
    them a resumed epoch had already read (0 otherwise), so
    ``enumerate(loader, start=loader.start)`` numbers the batches as an
    uninterrupted run does.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batches: SeededBatches,
        device: torch.device | None,
        name: str | None = None,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__(dataset, batch_sampler=batches, **loader_kwargs)
        # DataLoader freezes these after __init__; they describe what the loader really does.
        object.__setattr__(self, "batch_size", batches.batch_size)
        object.__setattr__(self, "sampler", batches.sampler)
        object.__setattr__(self, "drop_last", batches.drop_last)
        self.shard: ShardSampler = batches.sampler
        self.batches = batches
        self.name = name
        self.target_device = device
        self._non_blocking = device is not None and device.type == "cuda" and self.pin_memory
        self._pass = _PassState()
        self.shard_batch_size = batches.batch_size
        #: Called once, when a pass resumed mid-epoch is about to read its first batch.
        self.before_resumed_pass: Callable[[], None] | None = None
        #: Wraps each pass's batch iterator (the step timings of ``distributed()``); None: none.
        self.timed: Callable[[Iterator[Any]], Iterator[Any]] | None = None

    @property
    def description(self) -> str:
        """What identifies this loader's data when no ``name`` is given."""
        shard = self.shard
        return (
            f"{type(self.dataset).__qualname__} of {shard.length} samples "
            f"(shuffle={shard.shuffle}, pad={shard.pad})"
        )

    @property
    def identity(self) -> str:
        """The key its position is saved under: ``name=...`` if given, else :attr:`description`."""
        return f"name={self.name!r}" if self.name is not None else self.description

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        hook = self.before_resumed_pass
        if hook is not None and 0 < self.start < len(self):  # a resumed epoch with batches left
            self.before_resumed_pass = None
            hook()
        state = self._pass  # one object, reset in place: iterators of the loader share it
        state.epoch = self.shard.epoch
        state.available = len(self.shard)  # before the pass consumes the resume point
        state.batches_out = 0
        state.complete = False
        state.running = True
        batches = self._start_pass()
        if self.timed is not None:
            batches = self.timed(batches)
        device, non_blocking = self.target_device, self._non_blocking
        try:
            for batch in batches:
                state.batches_out += 1
                yield batch if device is None else to_device(batch, device, non_blocking)
            state.complete = True
        finally:
            state.running = False

    def _start_pass(self) -> Iterator[Any]:
        """DataLoader's iterator; worker processes forked now never collect the rank's objects.

        A worker is a fork of the rank, which holds the process group's C++
        objects: a worker that finalized one aborts (``Fatal Python error:
        Aborted`` while ``Garbage-collecting``, seen under load). See
        :mod:`ddpctx.utils.forking`.
        """
        self.batches.tagged = self.num_workers > 0  # only workers re-seed per batch
        if self.num_workers == 0:
            return super().__iter__()
        with collector_frozen():
            return super().__iter__()

    def _plan(self) -> tuple[int, int, int]:
        """(samples skipped, samples dealt, positions done before the deal) of this pass.

        The pass under way, or else the next one.
        """
        if self._pass.running:
            skip, done = self.shard.skip, self.shard.done_bytes()
        else:
            skip, done = self.shard.plan()
        return skip, self.shard.deal_size(done), self.shard.done_count(done)

    @property
    def _handed_out(self) -> int:
        """Samples handed out by the pass (the last batch may be short)."""
        return min(self._pass.batches_out * self.shard_batch_size, self._pass.available)

    def _batches(self, samples: int) -> int:
        size = self.shard_batch_size
        return samples // size if self.drop_last else -(-samples // size)

    @property
    def start(self) -> int:
        """Batches of this epoch read before a resume; 0 in an epoch that was not resumed.

        After a resume on another world size: the samples the old ranks read,
        in batches of this world size (rounded up).
        """
        skip, _, done = self._plan()
        size = self.shard_batch_size
        return -(-skip // size) + -(-done // (size * self.shard.num_replicas))

    def __len__(self) -> int:
        """Batches in this rank's whole epoch: ``start`` + the batches a pass yields."""
        skip, dealt, _ = self._plan()
        return self.start + self._batches(dealt - skip)

    def position(self) -> tuple[int, int, bool, bytes]:
        """``(epoch, samples of this rank's deal consumed, pass complete, done mask)``.

        See :class:`~ddpctx.data.sampling.Position` for what the counts and mask mean.
        """
        if self._pass.epoch != self.shard.epoch:
            return self.shard.epoch, 0, False, b""  # this epoch's pass has not started
        consumed = self.shard.skip + self._handed_out
        return self.shard.epoch, consumed, self._pass.complete, self.shard.done_bytes()

    def batch_numbers(self) -> tuple[int, int]:
        """(number of the batch last handed out, batches in this epoch), counted from 1."""
        return self.start + self._batches_handed_out(), len(self)

    def _batches_handed_out(self) -> int:
        return -(-self._handed_out // self.shard_batch_size)

    def resume(self, position: Position) -> None:
        """Continue the next pass of ``position.epoch`` where it left off."""
        self.shard.resume(position)
