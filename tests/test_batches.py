"""The batches a rank's loader deals, fast: the same indices, seeds and devices as before.

Issue 23 made a batch a slice of the epoch's index list (no per-sample
iterator), a loader without workers yield plain lists (nothing re-seeds
there), and ``to_device`` return a list or tuple of tensors already on the
device without calling ``.to``. The reference below is the algorithm those
replaced: each dealt order position looked up one by one, batches cut by
``islice``.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpctx import distributed
from ddpctx.data.loader import SeededBatches, SeededIndices, to_device
from ddpctx.data.sampling import Position, ShardSampler, deal, deal_length, done_mask


def reference_batches(
    sampler: ShardSampler, batch_size: int, drop_last: bool
) -> list[tuple[list[int], int]]:
    """(indices, first sample position) of each batch the next pass deals, the old way."""
    skip, packed = sampler.plan()
    order = sampler.order()
    done = done_mask(sampler.length, packed)
    spots = deal(sampler.length, sampler.num_replicas, sampler.rank, sampler.pad, done)
    indices = iter([order[spot] for spot in spots[skip:]])
    batches: list[tuple[list[int], int]] = []
    first = skip
    while True:
        batch = list(itertools.islice(indices, batch_size))
        if not batch or (drop_last and len(batch) < batch_size):
            return batches
        batches.append((batch, first))
        first += len(batch)


@settings(max_examples=300, deadline=None)
@given(
    length=st.integers(1, 70),
    world_size=st.integers(1, 5),
    saved_world_size=st.integers(1, 5),
    batch_size=st.integers(1, 12),
    drop_last=st.booleans(),
    pad=st.booleans(),
    shuffle=st.booleans(),
    tagged=st.booleans(),
    resumed=st.booleans(),
    data=st.data(),
)
def test_sliced_batches_equal_the_per_sample_ones_for_any_shard_and_resume_point(
    length: int,
    world_size: int,
    saved_world_size: int,
    batch_size: int,
    drop_last: bool,
    pad: bool,
    shuffle: bool,
    tagged: bool,
    resumed: bool,
    data: st.DataObject,
) -> None:
    position = None
    if resumed:  # a checkpoint of epoch 3 taken on saved_world_size ranks
        consumed = tuple(
            data.draw(st.integers(0, deal_length(length, saved_world_size, rank, pad, length)))
            for rank in range(saved_world_size)
        )
        position = Position(3, saved_world_size, consumed)
    for rank in range(world_size):
        sampler = ShardSampler(length, world_size, rank, shuffle=shuffle, seed=7, pad=pad)
        sampler.set_epoch(3)
        if position is not None:
            sampler.resume(position)
        expected = reference_batches(sampler, batch_size, drop_last)
        batches = SeededBatches(sampler, batch_size, drop_last, base_seed=7)
        batches.tagged = tagged
        got = list(batches)
        assert got == [indices for indices, _ in expected]
        for batch, (_, first) in zip(got, expected, strict=True):
            if tagged:
                assert type(batch) is SeededIndices
                assert batch.key == (7, rank, first, 3)
            else:
                assert type(batch) is list
        assert len(got) == len(batches) or position is not None  # len is the unresumed count


def test_a_loader_tags_its_batches_with_seeds_only_when_workers_read_them() -> None:
    with distributed(seed=0) as ctx:
        plain = ctx.dataloader(list(range(8)), batch_size=4, device=None, collate_fn=list)
        plain.batches.tagged = True
        without_workers = list(plain)
        assert not plain.batches.tagged  # no workers: plain lists, nothing re-seeded
        assert all(type(batch) is list for batch in plain.batches)
        read = ctx.dataloader(list(range(8)), batch_size=4, collate_fn=list, num_workers=1)
        assert list(read) == without_workers  # the same indices, read by a worker
        assert read.batches.tagged


def test_a_list_or_tuple_of_tensors_already_there_is_the_same_object() -> None:
    cpu = torch.device("cpu")
    pair = [torch.ones(2), torch.zeros(1)]
    assert to_device(pair, cpu, non_blocking=False) is pair
    as_tuple = tuple(pair)
    assert to_device(as_tuple, cpu, non_blocking=False) is as_tuple
    triple = (torch.ones(1), torch.ones(1), torch.ones(1))
    assert to_device(triple, cpu, non_blocking=False) is triple
    assert to_device([], cpu, non_blocking=False) == []


def test_a_list_with_one_tensor_elsewhere_is_moved_and_keeps_its_type() -> None:
    meta = torch.device("meta")
    moved = to_device([torch.empty(1, device="meta"), torch.ones(1)], meta, non_blocking=False)
    assert type(moved) is list
    assert [item.device.type for item in moved] == ["meta", "meta"]
    moved_tuple = to_device((torch.ones(1), "label"), meta, non_blocking=False)
    assert type(moved_tuple) is tuple
    assert moved_tuple[0].device.type == "meta"
    assert moved_tuple[1] == "label"


class Recorded(torch.Tensor):
    """A tensor subclass whose own ``to`` must still be called, also when nothing moves."""

    calls = 0

    def to(self, *args: Any, **kwargs: Any) -> Any:
        Recorded.calls += 1
        return super().to(*args, **kwargs)


def test_a_tensor_subclass_still_goes_through_its_own_to() -> None:
    Recorded.calls = 0
    batch = [torch.ones(1).as_subclass(Recorded), torch.ones(1)]
    assert to_device(batch, torch.device("cpu"), non_blocking=False) is batch
    assert Recorded.calls == 1
    parameter = torch.nn.Parameter(torch.ones(1))
    params = [parameter]
    assert to_device(params, torch.device("cpu"), non_blocking=False) is params
