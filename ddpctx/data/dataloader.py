"""Sharded data loading and the epoch loop.

Three rules that hand-written DDP loops get wrong, kept here:

- The sampler's shuffle is seeded with the **base** seed, identical on every
  rank, so the ranks' shards are disjoint pieces of one permutation. (The
  per-rank seed ``seed + rank`` would give every rank its own permutation:
  shards overlap and some samples are never seen.)
- ``set_epoch`` is called every epoch (by :func:`epochs`), so the order
  changes between epochs and is the same for the same seed.
- DataLoader workers are seeded per (rank, worker, epoch) when they start,
  and every batch they read is seeded per (rank, epoch, batch), so
  augmentations differ everywhere they should and a resumed epoch (or
  ``persistent_workers=True``) reads exactly what an uninterrupted one reads
  (see :mod:`ddpctx.data.loader`).

``pad=True`` deals shards exactly as torch's ``DistributedSampler`` does (it
repeats a few samples so every rank gets the same number: right for
training, where ranks must take the same number of steps). ``pad=False``
gives uneven shards without repeats, so evaluation sums and counts are exact.
Both are :class:`~ddpctx.data.sampling.ShardSampler`, which can resume mid-epoch.

Example:
    >>> sampler = ShardSampler(10, num_replicas=3, rank=2, shuffle=False)
    >>> list(sampler)
    [2, 5, 8]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from ddpctx.data.generators import warn_private_generators
from ddpctx.data.loader import SeededBatches, ShardLoader
from ddpctx.data.sampling import ShardSampler
from ddpctx.data.streambuild import make_stream_loader
from ddpctx.data.streamloader import StreamLoader
from ddpctx.utils.seeding import seed_worker, worker_seed

__all__ = ["SeedWorkers", "ShardSampler", "epochs", "make_dataloader"]


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


def loader_device(device: torch.device | str) -> torch.device:
    """``ctx.dataloader``'s ``device=`` as a ``torch.device``, refused at once if unusable.

    A CUDA device on a machine without CUDA (or past its last GPU) would
    otherwise fail at the first batch, inside torch, without naming ``device=``.

    >>> loader_device("cpu")
    device(type='cpu')
    >>> loader_device("gpu")
    Traceback (most recent call last):
    ...
    ValueError: ctx.dataloader(device='gpu'): not a torch device (...). ...
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"ctx.dataloader(device={device!r}): not a torch device ({error}). Leave it out "
            "(batches go to ctx.device), or pass e.g. 'cpu', 'cuda', or None to leave them alone."
        ) from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"ctx.dataloader(device={device!r}): CUDA is not available here "
                "(torch.cuda.is_available() is False). Leave device out (batches go to "
                "ctx.device, the CPU here), or pass device=None to leave them where they are."
            )
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(
                f"ctx.dataloader(device={device!r}): this machine has {count} CUDA device(s), "
                f"cuda:0 to cuda:{count - 1}. Leave device out (batches go to ctx.device, "
                "this rank's GPU)."
            )
    return parsed


def _flag(name: str, value: object) -> bool:
    """``shuffle`` / ``pad`` as a bool; a string or None is refused (``"no"`` is truthy)."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"ctx.dataloader({name}={value!r}): must be True or False.")


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
    device: torch.device | None = None,
    name: str | None = None,
    shuffle_buffer: int | None = None,
    agree: Callable[[int], int] | None = None,
) -> ShardLoader | StreamLoader:
    """A DataLoader over this rank's shard; its ``shard`` is what :func:`epochs` advances.

    An ``IterableDataset`` gets a :class:`~ddpctx.data.streamloader.StreamLoader`
    (:mod:`ddpctx.data.streambuild`); ``shuffle_buffer`` and ``agree`` are for it.

    ``device``: move every batch there (None: leave batches where the dataset
    put them). ``pin_memory`` defaults to True only when ``device`` is CUDA.
    ``name``: the key its position is saved under (see :mod:`ddpctx.data.book`).
    On rank 0, private random generators in the dataset or ``collate_fn`` are
    named in a warning (see :mod:`ddpctx.data.generators`).
    """
    shuffle, pad = _flag("shuffle", shuffle), _flag("pad", pad)
    if isinstance(dataset, IterableDataset):
        return make_stream_loader(
            dataset,
            batch_size,
            shuffle=shuffle,
            shuffle_buffer=shuffle_buffer,
            pad=pad,
            base_seed=base_seed,
            rank=rank,
            world_size=world_size,
            loader_kwargs=loader_kwargs,
            device=device,
            name=name,
            agree=agree,
        )
    if shuffle_buffer is not None:
        raise ValueError(
            f"ctx.dataloader(shuffle_buffer={shuffle_buffer!r}) got a map-style "
            f"{type(dataset).__name__}: the buffer shuffles streams (IterableDataset). Use "
            "shuffle=True, which permutes the whole dataset, and drop shuffle_buffer."
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
    if pad and len(dataset) == 0:
        raise ValueError(
            f"ctx.dataloader() got an empty {type(dataset).__name__} (len 0) with pad=True: "
            "there is no sample to repeat, and every epoch would run 0 steps on every rank. "
            "Check how the dataset was built; for an evaluation split that may be empty, "
            "pass pad=False (then @all_reduced(weight='count') gives NaN, not 0)."
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive int, e.g. 64.")
    if name is not None and not (isinstance(name, str) and name):
        raise ValueError(f"name={name!r} must be a non-empty str (e.g. name='train'), or None.")
    if rank == 0:
        warn_private_generators(dataset, loader_kwargs.get("collate_fn"))
    drop_last = bool(loader_kwargs.pop("drop_last", False))
    fill = batch_size if drop_last else 1  # a resized epoch then drops no sample (sampling.py)
    sampler = ShardSampler(
        len(dataset), world_size, rank, shuffle=shuffle, seed=base_seed, pad=pad, fill=fill
    )
    batches = SeededBatches(sampler, batch_size, drop_last, base_seed)
    init = SeedWorkers(base_seed, rank, sampler, loader_kwargs.pop("worker_init_fn", None))
    loader_kwargs.setdefault("pin_memory", device is not None and device.type == "cuda")
    # Its own generator: a new iterator then never draws from torch's global one, so
    # the global stream (saved in checkpoints) is the same with and without a resume.
    loader_kwargs.setdefault("generator", torch.Generator().manual_seed(base_seed + rank))
    return ShardLoader(dataset, batches, device, name, worker_init_fn=init, **loader_kwargs)


def epochs(
    n: int, start: int, set_epoch: Callable[[int], None], barrier: Callable[[], None]
) -> Iterator[int]:
    """Yield ``start .. n-1``; ``set_epoch`` before each (every loader's), barrier after each."""
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
        set_epoch(epoch)
        yield epoch
        barrier()
