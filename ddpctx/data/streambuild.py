"""Building ``ctx.dataloader``'s loader for an ``IterableDataset``: arguments checked, split chosen.

Which split a stream gets (see :mod:`ddpctx.data.streamsplit`):

- a dataset with ``splits_itself = "ranks"`` yields only this rank's
  samples; ddpctx splits them between the workers;
- ``splits_itself = "ranks_and_workers"``: it splits between workers too
  (reading ``torch.utils.data.get_worker_info()``); ddpctx splits nothing;
- a Hugging Face ``datasets.IterableDataset`` is split by
  ``datasets.distributed.split_dataset_by_node`` (unless it already was),
  which deals whole files to ranks when it can; ``datasets`` splits its
  shards between workers itself, and its ``state_dict()`` resumes it;
- anything else gets ddpctx's own split.

Example:
    >>> class Numbers(torch.utils.data.IterableDataset):
    ...     def __iter__(self):
    ...         return iter(range(6))
    >>> loader = make_stream_loader(
    ...     Numbers(), 2, shuffle=False, shuffle_buffer=None, pad=True, base_seed=0, rank=1,
    ...     world_size=2, loader_kwargs={}, device=None, name=None, agree=None)
    >>> [batch.tolist() for batch in loader]
    [[1, 3], [5]]
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import IterableDataset

from ddpctx.data.generators import warn_private_generators
from ddpctx.data.streamloader import StreamLoader
from ddpctx.data.streamsplit import StreamShard

#: What a dataset may declare in ``splits_itself``.
DECLARED_SPLITS = ("ranks", "ranks_and_workers")


def split_of(dataset: Any, rank: int, world_size: int) -> tuple[Any, str]:
    """The dataset to read (a Hugging Face one split by node) and how it is split."""
    declared = getattr(dataset, "splits_itself", None)
    if declared is not None:
        if declared not in DECLARED_SPLITS:
            raise ValueError(
                f"{type(dataset).__name__}.splits_itself={declared!r}: must be 'ranks' (it "
                "yields only this rank's samples; ddpctx splits them between workers) or "
                "'ranks_and_workers' (it also splits between DataLoader workers). Leave it "
                "out to let ddpctx split the stream."
            )
        return dataset, str(declared)
    hugging_face = sys.modules.get("datasets")
    if hugging_face is not None and isinstance(dataset, hugging_face.IterableDataset):
        if getattr(dataset, "_distributed", None) is None and world_size > 1:
            split = importlib.import_module("datasets.distributed").split_dataset_by_node
            dataset = split(dataset, rank=rank, world_size=world_size)
        return dataset, "ranks_and_workers"
    return dataset, "ddpctx"


def _buffer(shuffle: bool, shuffle_buffer: object) -> int:
    if shuffle_buffer is None:
        shuffle_buffer = 0
    if type(shuffle_buffer) is not int or shuffle_buffer < 0:
        raise ValueError(
            f"ctx.dataloader(shuffle_buffer={shuffle_buffer!r}): must be a non-negative int, "
            "the number of samples held to shuffle a stream (e.g. shuffle_buffer=1000), or None."
        )
    if shuffle and shuffle_buffer == 0:
        raise ValueError(
            "ctx.dataloader(stream, shuffle=True): a stream has no order to permute; it is "
            "shuffled through a buffer of samples. Pass shuffle_buffer=N (e.g. 1000: more "
            "shuffles better and holds more samples in memory per worker), or shuffle=False."
        )
    return shuffle_buffer


def make_stream_loader(
    dataset: IterableDataset[Any],
    batch_size: int,
    *,
    shuffle: bool,
    shuffle_buffer: int | None,
    pad: bool,
    base_seed: int,
    rank: int,
    world_size: int,
    loader_kwargs: dict[str, Any],
    device: torch.device | None,
    name: str | None,
    agree: Callable[[int], int] | None,
) -> StreamLoader:
    """A :class:`StreamLoader` over this rank's share of ``dataset``.

    ``agree(count)`` is the minimum of ``count`` over the ranks (one
    collective); with ``pad=True`` and more than one rank the loader uses it
    to end the epoch on every rank at the same step.
    """
    buffer = _buffer(shuffle, shuffle_buffer)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive int, e.g. 64.")
    if name is not None and not (isinstance(name, str) and name):
        raise ValueError(f"name={name!r} must be a non-empty str (e.g. name='train'), or None.")
    for own in ("sampler", "batch_sampler"):
        if loader_kwargs.get(own) is not None:
            raise ValueError(
                f"ctx.dataloader(stream, {own}=...): an IterableDataset is read in its own "
                f"order, so there is nothing for a {own} to choose. Drop {own}."
            )
    if loader_kwargs.get("persistent_workers"):
        raise ValueError(
            "ctx.dataloader(stream, persistent_workers=True): a stream's workers are told at "
            "the start of every pass which epoch to read and where a resumed epoch picks up, "
            "which workers kept from the last pass cannot be told. Drop persistent_workers "
            "(the workers of a stream start with each epoch)."
        )
    dataset, split = split_of(dataset, rank, world_size)
    if rank == 0:
        warn_private_generators(dataset, loader_kwargs.get("collate_fn"))
    shard = StreamShard(
        dataset,
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        drop_last=bool(loader_kwargs.pop("drop_last", False)),
        collate_fn=loader_kwargs.pop("collate_fn", None),
        split=split,
        shuffle_buffer=buffer,
        base_seed=base_seed,
    )
    for own in ("sampler", "batch_sampler", "persistent_workers"):
        loader_kwargs.pop(own, None)
    loader_kwargs.setdefault("pin_memory", device is not None and device.type == "cuda")
    loader_kwargs.setdefault("generator", torch.Generator().manual_seed(base_seed + rank))
    even = agree if pad and world_size > 1 else None
    return StreamLoader(shard, device, even, name, **loader_kwargs)
