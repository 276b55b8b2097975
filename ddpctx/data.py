"""Sharded data loading and the epoch loop.

Three rules that hand-written DDP loops get wrong, kept here:

- The sampler's shuffle is seeded with the **base** seed, identical on every
  rank, so the ranks' shards are disjoint pieces of one permutation. (The
  per-rank seed ``seed + rank`` would give every rank its own permutation:
  shards overlap and some samples are never seen.)
- ``set_epoch`` is called every epoch (by :func:`epochs`), so the order
  changes between epochs and is the same for the same seed.
- DataLoader workers are seeded per (rank, worker, epoch) for ``random``,
  NumPy and torch, so augmentations differ everywhere they should.

``pad=True`` uses torch's ``DistributedSampler`` (it repeats a few samples
so every rank gets the same number: right for training, where ranks must
take the same number of steps). ``pad=False`` uses :class:`ShardSampler`:
uneven shards, no repeats, so evaluation sums and counts are exact.

Example:
    >>> sampler = ShardSampler(10, num_replicas=3, rank=2, shuffle=False)
    >>> list(sampler)
    [2, 5, 8]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler

from ddpctx.seeding import seed_worker, worker_seed


class ShardSampler(Sampler[int]):
    """Rank ``rank``'s share of one (shuffled) permutation, without padding.

    The permutation is the one ``DistributedSampler`` would draw for the same
    ``seed`` and epoch; ranks get every ``num_replicas``-th index from
    ``rank`` on, so shard sizes differ by at most one.
    """

    def __init__(
        self, length: int, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0
    ) -> None:
        self.length = length
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=generator).tolist()
        else:
            order = list(range(self.length))
        return iter(order[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.num_replicas))


class SeedWorkers:
    """``worker_init_fn`` seeding each worker for its (rank, worker, epoch), then the user's."""

    def __init__(
        self, base_seed: int, rank: int, sampler: Any, then: Callable[[int], None] | None
    ) -> None:
        self.base_seed = base_seed
        self.rank = rank
        self.sampler = sampler
        self.then = then

    def __call__(self, worker_id: int) -> None:
        # Workers start when iteration starts, after set_epoch: the epoch is current.
        seed_worker(worker_seed(self.base_seed, self.rank, worker_id, self.sampler.epoch))
        if self.then is not None:
            self.then(worker_id)


_OWN_ARGUMENTS = ("sampler", "batch_sampler")


def make_dataloader(
    dataset: Dataset[Any],
    batch_size: int,
    *,
    shuffle: bool,
    pad: bool,
    base_seed: int,
    rank: int,
    world_size: int,
    loader_kwargs: dict[str, Any],
) -> tuple[DataLoader[Any], Any]:
    """A DataLoader over this rank's shard, and the sampler that :func:`epochs` must advance."""
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            "ctx.dataloader() shards map-style datasets (with __len__ and __getitem__); an "
            "IterableDataset must shard itself, e.g. by reading every ctx.world_size-th item "
            "from ctx.rank on."
        )
    if not isinstance(dataset, Sized):
        raise TypeError(
            f"ctx.dataloader() needs a dataset with __len__; got {type(dataset).__name__}. "
            "Give it __len__ and __getitem__ (a map-style Dataset), or shard it yourself."
        )
    clash = [name for name in _OWN_ARGUMENTS if name in loader_kwargs]
    if clash:
        raise ValueError(
            f"ctx.dataloader() got {clash[0]}=...; it makes its own distributed sampler. Drop "
            f"{clash[0]}, or build the DataLoader yourself with a DistributedSampler."
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive int, e.g. 64.")
    sampler: Any
    if pad:
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=base_seed
        )
    else:
        sampler = ShardSampler(len(dataset), world_size, rank, shuffle=shuffle, seed=base_seed)
    init = SeedWorkers(base_seed, rank, sampler, loader_kwargs.pop("worker_init_fn", None))
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, worker_init_fn=init, **loader_kwargs
    )
    return loader, sampler


def epochs(n: int, start: int, samplers: list[Any], barrier: Callable[[], None]) -> Iterator[int]:
    """Yield ``start .. n-1``; set every sampler's epoch before each, barrier after each."""
    for name, value in (("n", n), ("start", start)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"{name}={value!r} must be a non-negative int, e.g. ctx.epochs(10, start=0)."
            )
    if start > n:
        raise ValueError(
            f"start={start} is past n={n}: nothing would run. Resume with start <= n "
            "(e.g. start=meta['epoch'] + 1 from load_checkpoint)."
        )
    for epoch in range(start, n):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        yield epoch
        barrier()
