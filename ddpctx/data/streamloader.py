"""The DataLoader ``ctx.dataloader`` returns for a stream: workers merged in order, even ends.

:class:`StreamLoader` is a ``torch.utils.data.DataLoader`` over a
:class:`~ddpctx.data.streamsplit.StreamShard`. On top of torch's iteration it
adds three things:

- **One order.** Batches are handed out round-robin over the workers (worker
  0's first batch, worker 1's first, ...), skipping a worker whose share has
  ended, whatever order they arrive in. With ddpctx's own split that is
  simply batch 0, 1, 2, ... of the rank, so a resumed pass (which starts the
  workers anew) reads on in exactly the order of an uninterrupted one.
- **Even ends** (``pad=True``, the default). Ranks may hold different numbers
  of batches; a rank that ran out while the others go on would leave them
  waiting in the gradient all-reduce until the timeout. So the ranks agree,
  in one tiny ``min`` all-reduce, on how many batches all of them can still
  hand out; each reads ahead up to that many (1, then 2, 4, up to
  :data:`LOOKAHEAD` batches: one collective per 8 batches in the steady
  state). The epoch ends for every rank at the same step: the step where the
  first rank runs out. **The remainder rule**: what the other ranks hold
  beyond that step is dropped -- with ddpctx's own split, ranks' shares
  differ by at most one sample, so at most one batch (of one sample) per
  rank; with a dataset that splits itself, whatever its longer shards hold.
  ``pad=False`` reads every sample and lets ranks end apart (evaluation).
- **A position.** It records, per worker, the batches handed out and the last
  one's state, so a checkpoint saves where the pass got (:meth:`position`)
  and :meth:`resume` plans the next pass of that epoch from there.

Example:
    >>> from ddpctx.data.streamsplit import StreamShard
    >>> shard = StreamShard(range(5), rank=0, world_size=1, batch_size=2)
    >>> loader = StreamLoader(shard, device=None, agree=None)
    >>> [batch.tolist() for batch in loader]
    [[0, 1], [2, 3], [4]]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from ddpctx.data.loader import to_device
from ddpctx.data.streamsplit import (
    Item,
    PassPlan,
    StreamShard,
    WorkerPlan,
    fingerprint,
)
from ddpctx.utils.forking import collector_frozen
from ddpctx.utils.warn import warn_user

#: The most batches a rank reads ahead to agree with the others on the epoch's end.
LOOKAHEAD = 8


class StreamReplayWarning(UserWarning):
    """A stream resumed mid-epoch is read again from the start of the epoch (a cost, said once)."""


def _keep(item: Any) -> Any:
    """The DataLoader's ``collate_fn``: items are batched by :class:`StreamShard` already."""
    return item


@dataclass(slots=True)
class _Pass:
    """The pass under way (or the last one run): what it handed out, per worker slot."""

    epoch: int = -1
    running: bool = False
    complete: bool = False
    batches: int = 0  # batches of the epoch handed out, counting those of a resumed start
    start: int = 0  # batches a resumed pass started after
    consumed: list[int] = field(default_factory=list)  # per worker
    last_index: list[int] = field(default_factory=list)  # index of its last batch, -1: none
    states: list[Any] = field(default_factory=list)
    last: list[Any] = field(default_factory=list)  # the last batch itself, for its fingerprint
    last_worker: int = -1
    history: list[tuple[int, list[int], int]] = field(default_factory=list)


@dataclass(frozen=True)
class SavedStream:
    """A stream loader's pass as a checkpoint recorded it, every rank's position in ``ranks``."""

    key: str
    description: str
    epoch: int
    world_size: int
    workers: int
    split: str
    ranks: tuple[dict[str, Any], ...]
    complete: bool

    @property
    def position(self) -> dict[str, Any] | None:
        """Rank 0's position, or None when the pass was complete or not started."""
        dealt_anew = bool(self.ranks[0].get("history"))
        if self.complete or not (dealt_anew or any(rank["batches"] for rank in self.ranks)):
            return None
        return self.ranks[0]


class StreamLoader(DataLoader[Any]):
    """A DataLoader over a stream's share for this rank; ``stream`` is the user's dataset.

    ``len()`` is refused as for any iterable dataset; :attr:`start` is how many
    batches a resumed epoch had already read (0 otherwise).
    """

    def __init__(
        self,
        shard: StreamShard,
        device: torch.device | None,
        agree: Callable[[int], int] | None,
        name: str | None = None,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__(shard, batch_size=None, collate_fn=_keep, **loader_kwargs)
        object.__setattr__(self, "batch_size", shard.batch_size)
        object.__setattr__(self, "drop_last", shard.drop_last)
        self.shard = shard
        self.stream = shard.dataset
        self.name = name
        self.target_device = device
        self._non_blocking = device is not None and device.type == "cuda" and self.pin_memory
        self._agree = agree
        self.epoch = 0
        self._pass = _Pass()
        self._plan: PassPlan | None = None  # a resumed pass, waiting for its epoch
        self._replay_note: str | None = None
        #: Called once, when a pass resumed mid-epoch is about to read its first batch.
        self.before_resumed_pass: Callable[[], None] | None = None
        self.timed: Callable[[Iterator[Any]], Iterator[Any]] | None = None  # the step timings

    @property
    def slots(self) -> int:
        """Worker slots merged: ``num_workers``, or 1 without workers."""
        return max(1, self.num_workers)

    @property
    def description(self) -> str:
        """What identifies this loader's data when no ``name`` is given."""
        shard = self.shard
        return (
            f"{type(shard.dataset).__qualname__} stream (batch_size={shard.batch_size}, "
            f"shuffle_buffer={shard.shuffle_buffer}, drop_last={shard.drop_last})"
        )

    @property
    def identity(self) -> str:
        """The key its position is saved under: ``name=...`` if given, else :attr:`description`."""
        return f"name={self.name!r}" if self.name is not None else self.description

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next pass reads (``ctx.epochs`` calls it)."""
        self.epoch = epoch

    @property
    def start(self) -> int:
        """Batches of this epoch read before a resume; 0 in an epoch that was not resumed."""
        plan = self._plan
        if plan is not None and plan.epoch == self.epoch:
            return plan.rank_start
        return self._pass.start if self._pass.epoch == self.epoch else 0

    def __len__(self) -> int:
        raise TypeError(
            f"len() of ctx.dataloader's loader over a stream ({self.description}): a stream's "
            "number of batches is not known before it is read. Count batches as they come "
            "(enumerate(loader, start=loader.start)), or give the data __len__ and "
            "__getitem__ to make it a map-style dataset."
        )

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        plan = self._plan if self._plan is not None and self._plan.epoch == self.epoch else None
        self._plan = None
        if plan is not None and self._replay_note is not None:  # said at the user's loop,
            if self.shard.rank == 0:  # once for the job
                warn_user(self._replay_note, StreamReplayWarning)
            self._replay_note = None
        batches = self._pass_batches(plan)
        return batches if self.timed is None else self.timed(batches)

    def _pass_batches(self, plan: PassPlan | None) -> Iterator[Any]:
        if plan is not None and self.before_resumed_pass is not None:
            self.before_resumed_pass()
            self.before_resumed_pass = None
        plan = plan or PassPlan(epoch=self.epoch)
        state = self._pass
        slots = self.slots
        state.epoch, state.running, state.complete = self.epoch, True, False
        state.batches = state.start = plan.rank_start
        state.consumed = [0] * slots
        state.last_index, state.states, state.last = [-1] * slots, [None] * slots, [None] * slots
        state.last_worker = -1
        state.history = plan.history
        turn = plan.turn if self.shard.split == "ranks_and_workers" else plan.rank_start % slots
        self.shard.plan = plan
        source = self._start_pass()
        device, non_blocking = self.target_device, self._non_blocking
        try:
            for worker, index, batch, batch_state in self._even(_merged(source, slots, turn)):
                state.batches += 1
                state.consumed[worker] += 1
                state.last_index[worker], state.states[worker] = index, batch_state
                state.last[worker], state.last_worker = batch, worker
                yield batch if device is None else to_device(batch, device, non_blocking)
            state.complete = True
        finally:
            state.running = False
            shutdown = getattr(source, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()

    def _start_pass(self) -> Iterator[Item]:
        """DataLoader's iterator, forked with the collector frozen (see ShardLoader._start_pass).

        Without workers and pinning, the shard is read directly: DataLoader's own
        iterator would only pass each batch through (10-20 us a batch).
        """
        if self.num_workers == 0 and not self.pin_memory:
            return iter(self.shard)
        if self.num_workers == 0:
            return super().__iter__()
        with collector_frozen():
            return super().__iter__()

    def _even(self, merged: Iterator[Item]) -> Iterator[Item]:
        """``merged``, ended at the step where the first rank runs out (``pad=True``)."""
        agree = self._agree
        if agree is None:
            yield from merged
            return
        ahead: deque[Item] = deque()
        chunk, granted, final, exhausted = 1, 0, False, False
        while True:
            if granted == 0:
                if final:
                    return
                while not exhausted and len(ahead) < chunk:
                    exhausted = _pull(merged, ahead)
                granted = agree(min(len(ahead), chunk))
                final = granted < chunk
                if granted == 0:
                    return
                chunk = min(2 * chunk, LOOKAHEAD)
            item = ahead.popleft()
            granted -= 1
            if not exhausted and len(ahead) < chunk:  # read on as batches are used: no stall
                exhausted = _pull(merged, ahead)
            yield item

    def position(self) -> dict[str, Any]:
        """This rank's place in the epoch: plain values, saved by ``save_checkpoint``."""
        state = self._pass
        started = state.epoch == self.epoch and (state.batches > 0 or bool(state.history))
        replayed = not self.shard.stateful
        return {
            "epoch": self.epoch,
            "batches": state.batches if started else 0,
            "complete": bool(started and state.complete and not state.running),
            "consumed": list(state.consumed) if started else [],
            "last_index": list(state.last_index) if started else [],
            "turn": (state.last_worker + 1) % self.slots if started else 0,
            "states": list(state.states) if started else [],
            "prints": [
                fingerprint(batch) if replayed and batch is not None else ""
                for batch in (state.last if started else [])
            ],
            "history": [[world, list(read), size] for world, read, size in state.history]
            if started
            else [],
        }

    def resume(self, saved: SavedStream, rank: int, world_size: int) -> None:
        """Plan the next pass of ``saved.epoch`` to read on where the saving run stopped."""
        where = f"the loader {self.identity}"
        mine = saved.ranks[rank if saved.world_size == world_size else 0]
        layers = mine.get("history", [])
        history = [(int(w), [int(r) for r in read], int(b)) for w, read, b in layers]
        if saved.world_size != world_size:
            self._deal_anew(saved, world_size, history, where)
            return
        if saved.split == "ranks_and_workers" and saved.workers != self.slots:
            raise ValueError(
                f"{where} was saved reading with {saved.workers} worker(s) (num_workers=0 counts "
                f"as one) and now has num_workers={self.num_workers}; its dataset splits itself "
                "between workers, so each worker's position belongs to that worker. Resume with "
                "the same num_workers."
            )
        start = int(mine["batches"])
        plan = PassPlan(epoch=saved.epoch, rank_start=start, history=history)
        self.epoch = saved.epoch
        if start == 0:  # this rank had read nothing yet (pad=False lets ranks differ)
            self._plan = plan
            return
        last_index, states, prints = mine["last_index"], mine["states"], mine["prints"]
        if saved.split == "ranks_and_workers":
            for worker in range(saved.workers):
                index = int(last_index[worker])
                plan.workers[worker] = WorkerPlan(
                    start=index + 1,
                    state=states[worker],
                    check=(index, prints[worker]) if prints[worker] and index >= 0 else None,
                )
            plan.turn = int(mine["turn"])
        else:
            last = next(w for w, index in enumerate(last_index) if int(index) == start - 1)
            resumed = WorkerPlan(
                start=start,
                state=states[last],
                check=(start - 1, prints[last]) if prints[last] else None,
            )
            plan.workers = {worker: resumed for worker in range(self.slots)}
        self._plan = plan
        if not self.shard.stateful:
            samples = start * self.shard.batch_size
            self._replay_note = (
                f"ctx.dataloader resumes {type(self.shard.dataset).__name__} mid-epoch "
                f"{saved.epoch} by reading its stream again from the start of the epoch and "
                f"skipping the {start} batches (about {samples} samples) rank 0 had read (every "
                "rank skips its own); each worker reads them again. "
                + (
                    "It has no state_dict()/load_state_dict(); give it both (the torchdata "
                    "Stateful protocol) to resume from its saved state instead."
                    if not self.shard.shuffle_buffer
                    else "With a shuffle buffer the buffer's contents are rebuilt this way."
                )
            )

    def _deal_anew(
        self, saved: SavedStream, world_size: int, history: list[Any], where: str
    ) -> None:
        """Resume on another world size: the samples no old rank read, dealt to the new ranks."""
        if saved.split != "ddpctx" or self.shard.shuffle_buffer:
            why = (
                "its dataset splits itself between ranks, so which samples each old rank "
                "had read is known only to the dataset"
                if saved.split != "ddpctx"
                else "the old ranks' shuffle buffers held samples read but not yet handed out, "
                "and their contents are not saved"
            )
            raise ValueError(
                f"{where} was saved mid-epoch {saved.epoch} by {saved.world_size} ranks; this "
                f"run has {world_size}, and the epoch cannot be dealt anew exactly: {why}. "
                f"Resume on {saved.world_size} ranks, or from a checkpoint saved at the end of "
                "an epoch (save_checkpoint after the epoch's loop)."
            )
        read = [int(rank["batches"]) for rank in saved.ranks]
        layer = (saved.world_size, read, self.shard.batch_size)
        self._plan = PassPlan(epoch=saved.epoch, history=[*history, layer])
        self.epoch = saved.epoch
        self._replay_note = (
            f"ctx.dataloader resumes {type(self.shard.dataset).__name__} mid-epoch "
            f"{saved.epoch}, saved by {saved.world_size} ranks, on {world_size}: the stream is "
            "read again from the start of the epoch, the samples the old ranks had read "
            f"({sum(read)} batches of {self.shard.batch_size}) are left out and the rest "
            "dealt to the new ranks, so no sample is read twice or skipped."
        )


def _pull(merged: Iterator[Item], ahead: deque[Item]) -> bool:
    """Move one batch from ``merged`` into ``ahead``; True when ``merged`` has ended."""
    try:
        ahead.append(next(merged))
    except StopIteration:
        return True
    return False


def _merged(source: Iterator[Item], slots: int, turn: int) -> Iterator[Item]:
    """The workers' batches round-robin from ``turn``, a worker skipped once its share ended."""
    pending: list[deque[Item]] = [deque() for _ in range(slots)]
    ended = [False] * slots
    while not all(ended):
        if ended[turn]:
            turn = (turn + 1) % slots
            continue
        if not pending[turn]:
            try:
                item = next(source)
            except StopIteration:
                return  # every worker's end marker was read: nothing is left
            pending[item[0]].append(item)
            continue
        item = pending[turn].popleft()
        if item[1] < 0:
            ended[turn] = True
        turn = (turn + 1) % slots
        if item[1] >= 0:
            yield item
