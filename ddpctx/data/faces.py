"""Data's face on :class:`~ddpctx.DistContext`: ``ctx.dataloader`` and ``ctx.epochs``.

:class:`DataFaces` is mixed into ``DistContext``. Its
:class:`~ddpctx.data.book.LoaderBook` holds every loader it made weakly (their
positions are what a checkpoint saves), the current epoch, and the positions a
checkpoint restored for loaders not made yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ddpctx.data.book import LoaderBook
from ddpctx.data.dataloader import epochs, loader_device, make_dataloader


class DataFaces:
    """``ctx.dataloader`` and ``ctx.epochs``."""

    rank: int
    world_size: int
    device: torch.device
    base_seed: int | None
    barrier: Callable[[], None]
    all_reduce: Callable[..., Any]
    _loader_book: LoaderBook
    #: Wraps every pass's batch iterator (the session's step timings); None: untimed.
    _timed: Callable[[Iterator[Any]], Iterator[Any]] | None = None

    def dataloader(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        shuffle: bool = False,
        pad: bool = True,
        device: torch.device | str | None = "auto",
        name: str | None = None,
        shuffle_buffer: int | None = None,
        tp_size: int | None = None,
        **loader_kwargs: Any,
    ) -> DataLoader[Any]:
        """A DataLoader over this rank's shard of ``dataset`` (see :mod:`ddpctx.data.dataloader`).

        The sampler is seeded with the base seed (the same on every rank, so
        shards are disjoint); :meth:`epochs` advances it. ``pad=False`` gives
        uneven shards without repeated samples (for exact evaluation).
        Batches arrive on ``device`` (default :attr:`device`; None leaves them
        where the dataset put them). Workers are seeded per (rank, worker,
        epoch) and each batch per (rank, epoch, batch); your
        ``worker_init_fn`` still runs after that. Its position within the
        epoch is saved by :meth:`save_checkpoint` and resumed by
        :meth:`load_checkpoint`, matched by ``name`` or else by a description
        of the data (see :mod:`ddpctx.data.book`); ``len(loader)`` counts the
        whole epoch and ``loader.start`` the batches a resumed epoch had
        already read. Made inside ``for epoch in ctx.epochs(n)``, it starts
        at that epoch. The context holds it weakly: dropping it frees it.

        >>> from ddpctx import distributed
        >>> with distributed(seed=0) as ctx:
        ...     loader = ctx.dataloader(list(range(10)), batch_size=4, shuffle=True)
        ...     [len(batch) for batch in loader]
        [4, 4, 2]

        An ``IterableDataset`` (a stream) is split between ranks and workers so
        each sample of an epoch is read by one of them, and every rank ends
        the epoch at the same step (``pad=True``; the remainder rule and
        ``shuffle_buffer=N`` are in the "Streaming data" guide). Its position
        is checkpointed too.

        >>> from torch.utils.data import IterableDataset
        >>> class Lines(IterableDataset):
        ...     def __iter__(self):
        ...         return iter(range(5))
        >>> with distributed(seed=0) as ctx:
        ...     [batch.tolist() for batch in ctx.dataloader(Lines(), batch_size=2)]
        [[0, 1], [2, 3], [4]]

        ``tp_size=N`` (tensor parallel, ``ctx.shard(..., tp_size=N)``): the
        ``N`` ranks of a tensor-parallel group (ranks ``k*N .. k*N+N-1``) read
        the same batches, seeded alike; the data is split over the
        ``world_size // N`` groups.

        >>> with distributed(seed=0) as ctx:
        ...     len(ctx.dataloader(list(range(10)), batch_size=4, tp_size=1))
        3
        """
        rank, world_size = _data_place(self.rank, self.world_size, tp_size)
        if world_size != self.world_size and isinstance(dataset, IterableDataset):
            raise ValueError(
                f"ctx.dataloader(tp_size={tp_size}) got a stream ({type(dataset).__name__}, an "
                "IterableDataset): tensor-parallel groups reading one stream are not supported "
                "yet. Use a map-style dataset (__len__ and __getitem__), or read the stream "
                "on each group's first rank and broadcast the batch over the group."
            )
        target = self.device if isinstance(device, str) and device == "auto" else device
        loader = make_dataloader(
            dataset,
            batch_size,
            shuffle=shuffle,
            pad=pad,
            base_seed=self.base_seed or 0,
            rank=rank,
            world_size=world_size,
            loader_kwargs=loader_kwargs,
            device=None if target is None else loader_device(target),
            name=name,
            shuffle_buffer=shuffle_buffer,
            agree=self._fewest,
        )
        loader.timed = self._timed
        self._loader_book.add(loader)
        return loader

    def _fewest(self, count: int) -> int:
        """The smallest ``count`` over the ranks: how many batches every rank can still read."""
        return int(self.all_reduce(count, op="min"))

    def epochs(self, n: int, start: int = 0) -> Iterator[int]:
        """Epochs ``start .. n-1``; ``set_epoch`` on every loader before each, a barrier after.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     list(ctx.epochs(3, start=1))
        [1, 2]
        """
        return epochs(n, start, self._loader_book.set_epoch, self.barrier)


def _data_place(rank: int, world_size: int, tp_size: object) -> tuple[int, int]:
    """``(data rank, data ranks)`` of ``rank`` when ``tp_size`` ranks share each batch."""
    if tp_size is None:
        return rank, world_size
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(
            f"ctx.dataloader(tp_size={tp_size!r}): must be a positive int, the tp_size given "
            "to ctx.shard (the ranks that share each batch), or None."
        )
    if world_size % tp_size:
        raise ValueError(
            f"ctx.dataloader(tp_size={tp_size}) does not divide the world size {world_size}: "
            "pass the tp_size given to ctx.shard, one that divides the world size."
        )
    return rank // tp_size, world_size // tp_size
