"""A streamed dataset's side of ``ctx.dataloader``: each worker's share, batched, seeded, resumable.

:class:`StreamShard` wraps the user's ``IterableDataset``; it is what the
DataLoader's workers (or, without workers, the rank itself) iterate. It yields
one :data:`Item` per batch, ``(worker, index, batch, state)``, and a last
``(worker, -1, None, None)`` when the worker's share ends, so the loader can
merge the workers in a fixed order (:mod:`ddpctx.data.streamloader`).

**Who reads what.** The split is one of three:

- ``"ddpctx"`` (any plain iterable): the rank keeps the stream's samples
  ``rank, rank + world_size, ...``; its *batch* ``k`` is read by worker
  ``k % num_workers``. Every worker iterates the whole stream and keeps its
  part, so the batches, their order and their random draws are the same
  whatever ``num_workers`` is -- and a resume may even change it. Reading is
  repeated in every worker of every rank: put expensive per-sample work in
  ``collate_fn`` (it runs after the split), or let the dataset split itself.
- ``"ranks"`` (``dataset.splits_itself = "ranks"``): the dataset yields only
  this rank's samples; workers take batches ``k % num_workers`` as above.
- ``"ranks_and_workers"`` (``splits_itself = "ranks_and_workers"``, and a
  Hugging Face ``datasets.IterableDataset``, split by
  ``datasets.distributed.split_dataset_by_node``): the dataset yields only
  this worker's samples; each worker batches its own.

**Seeds.** Before reading each batch the worker seeds ``random``, NumPy and
torch from (base seed, rank, epoch, batch), so a batch's random draws depend
only on which batch it is. Without workers the rank's own generators are put
aside while a batch is read and put back after: the training loop's random
stream is the same as without the dataset's draws, and the batches are the
ones workers would read. The optional shuffle buffer has its own generator,
seeded per (epoch, rank) -- per (epoch, rank, worker) when each worker reads
its own samples.

**Resume.** A :class:`WorkerPlan` says where a pass starts. A dataset with
``state_dict()``/``load_state_dict()`` (the torchdata ``Stateful`` protocol)
and no shuffle buffer is handed its saved state and reads on; any other is
read again from the start of the epoch, the batches already read skipped
without being collated. After a world-size change (``PassPlan.history``) the
samples the old ranks had read are left out and the rest dealt anew. The last
skipped batch is compared with the one
the saving run read (:func:`fingerprint`): a stream that gives other
samples when read again is not deterministic, and the worker raises
:class:`NotReplayable` naming it.

Example:
    >>> shard = StreamShard(range(10), rank=1, world_size=2, batch_size=2)
    >>> [(index, batch.tolist()) for _, index, batch, _ in shard if index >= 0]
    [(0, [1, 3]), (1, [5, 7]), (2, [9])]
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import pickle
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from ddpctx.data.streamseeds import CopiedState, batch_seed, numpy_state, python_state

#: ``(worker, batch index, batch, state)``; index -1 (batch and state None) ends the worker.
Item = tuple[int, int, Any, Any]
SPLITS = ("ddpctx", "ranks", "ranks_and_workers")


class NotReplayable(RuntimeError):
    """A stream read again gave other samples than the run that saved the checkpoint read."""


@dataclass(frozen=True)
class WorkerPlan:
    """Where one worker's pass starts.

    ``start``: the first batch it yields (a rank batch index for the
    ``"ddpctx"``/``"ranks"`` splits, the worker's own count otherwise).
    ``state``: what to ``load_state_dict`` before reading (then reading starts
    at ``start``), or None to read from the start and skip. ``check``: (batch
    index, fingerprint) of the last batch read before the save.
    """

    start: int = 0
    state: Any = None
    check: tuple[int, str] | None = None


@dataclass
class PassPlan:
    """The epoch of the next pass and, after a resume, each worker's :class:`WorkerPlan`."""

    epoch: int = 0
    workers: dict[int, WorkerPlan] = field(default_factory=dict)
    rank_start: int = 0  # batches of the epoch the rank had already read
    turn: int = 0  # the worker whose batch comes first (a dataset splitting between workers)
    #: Earlier deals of this epoch, oldest first: (world size, batches each rank had read,
    #: batch size). Their samples are left out and the rest dealt anew (see _unread).
    history: list[tuple[int, list[int], int]] = field(default_factory=list)


def fingerprint(batch: Any) -> str:
    """A stable hash of a batch's values (tensors by dtype, shape and bytes), hex.

    >>> fingerprint({"x": torch.ones(2)}) == fingerprint({"x": torch.ones(2)})
    True
    """
    digest = hashlib.blake2b(digest_size=16)
    _feed(digest, batch)
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{flat.dtype}{tuple(value.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    elif isinstance(value, np.ndarray):
        digest.update(f"A{value.dtype}{value.shape}".encode() + value.tobytes())
    elif isinstance(value, dict):
        digest.update(b"D")
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    elif value is None or isinstance(value, (str, bytes, int, float, bool)):
        digest.update(repr(value).encode())
    else:
        try:
            digest.update(pickle.dumps(value, protocol=4))
        except Exception:  # an unpicklable leaf is hashed by its repr
            digest.update(repr(value).encode())


def _unread(samples: Iterator[Any], world: int, read: list[int], size: int) -> Iterator[Any]:
    """The samples an earlier deal of the epoch had not handed out.

    That deal gave rank ``r`` of ``world`` the samples at positions ``r, r + world, ...``
    and rank ``r`` had handed out ``read[r]`` batches of ``size``: its first
    ``read[r] * size`` samples (a short last batch means its share was all read).
    """
    for position, sample in enumerate(samples):
        if position // world >= read[position % world] * size:
            yield sample


def is_stateful(dataset: object) -> bool:
    """Whether ``dataset`` has ``state_dict``/``load_state_dict`` (torchdata's ``Stateful``)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


class StreamShard(IterableDataset[Item]):
    """The user's stream as one worker reads it: its share, in batches, each tagged for merging."""

    def __init__(
        self,
        dataset: Iterable[Any],
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        split: str = "ddpctx",
        shuffle_buffer: int = 0,
        base_seed: int = 0,
    ) -> None:
        self.dataset = dataset
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.drop_last = batch_size, drop_last
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.split, self.shuffle_buffer, self.base_seed = split, shuffle_buffer, base_seed
        #: Resumed by its state, not by replay: Stateful, and no buffer whose contents it lacks.
        self.stateful = is_stateful(dataset) and shuffle_buffer == 0
        self.plan = PassPlan()
        self._globals: tuple[CopiedState, CopiedState] | None = None

    def __iter__(self) -> Iterator[Item]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        plan = self.plan.workers.get(worker, WorkerPlan())
        if self.split == "ranks_and_workers":
            yield from self._own_batches(worker, plan, info is None)
        else:
            yield from self._rank_batches(worker, workers, plan, info is None)
        yield worker, -1, None, None

    def _rank_batches(
        self, worker: int, workers: int, plan: WorkerPlan, isolate: bool
    ) -> Iterator[Item]:
        """Rank batches ``k`` with ``k % workers == worker``, from ``plan.start`` on."""
        upstream, index = 0, 0
        stateful = self.stateful and not self.plan.history  # a new deal is only replayed
        with self._seeded(-1, -2, isolate):  # what iter() draws is the same in every worker
            self._set_epoch(self.plan.epoch)  # before a load, which may set it again
            if stateful and plan.state is not None:
                self._load(plan.state["dataset"])
                upstream, index = int(plan.state["upstream"]), plan.start
            samples: Iterator[Any] = iter(self.dataset)
        for world, read, size in self.plan.history:  # after a world-size change
            samples = _unread(samples, world, read, size)
        stride = self.world_size if self.split == "ddpctx" else 1
        offset = (self.rank - upstream) % stride  # to this rank's first sample from here
        if stride > 1:  # islice reads no further than the sample it yields
            samples = itertools.islice(samples, offset, None, stride)
        kept = 0
        samples = self._shuffled(samples, worker=-1)
        while True:
            mine = index >= plan.start and index % workers == worker
            checked = plan.check is not None and plan.check[0] == index
            with self._seeded(-1, index, isolate):
                chunk = list(itertools.islice(samples, self.batch_size))
                if not chunk or (self.drop_last and len(chunk) < self.batch_size):
                    return
                kept += len(chunk)
                batch = self.collate_fn(chunk) if mine or checked else None
                if checked:
                    self._check(batch, plan, index)
                state = None
                if mine and stateful:  # the stream position after this batch's last sample
                    after = upstream + offset + stride * (kept - 1) + 1
                    state = {"dataset": self._state(), "upstream": after}
            if mine:
                yield worker, index, batch, state
            index += 1

    def _own_batches(self, worker: int, plan: WorkerPlan, isolate: bool) -> Iterator[Item]:
        """This worker's own samples (the dataset splits itself), batched and numbered."""
        index = 0
        with self._seeded(worker, -2, isolate):
            self._set_epoch(self.plan.epoch)
            if self.stateful and plan.state is not None:
                self._load(plan.state["dataset"])
                index = plan.start
            samples = self._shuffled(iter(self.dataset), worker=worker)
        while True:
            with self._seeded(worker, index, isolate):
                chunk = list(itertools.islice(samples, self.batch_size))
                if not chunk or (self.drop_last and len(chunk) < self.batch_size):
                    return
                mine = index >= plan.start
                checked = plan.check is not None and plan.check[0] == index
                batch = self.collate_fn(chunk) if mine or checked else None
                if checked:
                    self._check(batch, plan, index)
                state = {"dataset": self._state()} if mine and self.stateful else None
            if mine:
                yield worker, index, batch, state
            index += 1

    def _shuffled(self, samples: Iterator[Any], worker: int) -> Iterator[Any]:
        """``samples`` through the shuffle buffer (its own generator), or as they are."""
        size = self.shuffle_buffer
        if size <= 0:
            return samples
        rng = random.Random(batch_seed(self.base_seed, self.rank, self.plan.epoch, worker, -1))

        def buffered() -> Iterator[Any]:
            buffer: list[Any] = []
            for sample in samples:
                if len(buffer) < size:
                    buffer.append(sample)
                    continue
                slot = rng.randrange(size)
                yield buffer[slot]
                buffer[slot] = sample
            rng.shuffle(buffer)
            yield from buffer

        return buffered()

    @contextlib.contextmanager
    def _seeded(self, worker: int, index: int, isolate: bool) -> Iterator[None]:
        """Seed the global generators for one batch; without workers, put the rank's back after."""
        generator = torch.get_rng_state() if isolate else None
        if generator is not None:
            self._globals = self._globals or (python_state(), numpy_state())
            for state in self._globals:
                state.save()
            gauss = random._inst.gauss_next  # type: ignore[attr-defined]
        seed = batch_seed(self.base_seed, self.rank, self.plan.epoch, worker, index)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.default_generator.manual_seed(seed)
        try:
            yield
        finally:
            if generator is not None:
                for state in self._globals or ():
                    state.restore()
                random._inst.gauss_next = gauss  # type: ignore[attr-defined]
                torch.set_rng_state(generator)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_globals"] = None  # addresses in this process; workers make their own
        return state

    def _set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def _state(self) -> Any:
        return copy.deepcopy(self.dataset.state_dict())  # type: ignore[attr-defined]

    def _load(self, state: Any) -> None:
        self.dataset.load_state_dict(copy.deepcopy(state))  # type: ignore[attr-defined]

    def _check(self, batch: Any, plan: WorkerPlan, index: int) -> None:
        assert plan.check is not None
        if fingerprint(batch) == plan.check[1]:
            return
        raise NotReplayable(
            f"ctx.dataloader could not resume {type(self.dataset).__name__} exactly: read again "
            f"from the start of epoch {self.plan.epoch}, rank {self.rank}'s batch {index} holds "
            "other samples than the run that saved the checkpoint read there, so the stream is "
            "not deterministic (it depends on time, file listing order, another process, or a "
            "generator ddpctx does not seed). Make its order depend only on the epoch "
            "(sorted file lists, set_epoch(epoch), the global generators), or give it "
            "state_dict()/load_state_dict() so it resumes from its saved state instead of "
            "being read again."
        )
