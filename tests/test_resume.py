"""Mid-epoch resume: the same world size continues bit-identically, another one reads each
remaining sample exactly once. Real ranks (the plugin's pool), real checkpoints on disk."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import Dataset

from ddpctx import DistContext, current, distributed
from ddpctx.data.loader import SeededBatches
from ddpctx.data.sampling import Position, ShardSampler


def context() -> DistContext:
    ctx = current()
    assert ctx is not None
    return ctx


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """Index, an input with random "augmentation" noise (drawn where the item is read), a target."""

    def __init__(self, length: int = 37) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        noise = torch.rand(4) * 0.1 + float(np.random.rand()) * 0.01 + random.random() * 0.01
        x = torch.full((4,), float(index) / self.length) + noise
        return torch.tensor(index), x, x.sum(0, keepdim=True)


def train(
    folder: str,
    epochs: int,
    save_at: int | None,
    resume: bool,
    workers: int,
    find_unused_parameters: bool = False,
) -> dict[str, Any]:
    """Train; save at global step ``save_at``; with ``resume``, load first and go on from there.

    Returns every (epoch, step, indices, loss) after the save point and the final weights.
    """
    ctx = context()
    torch.manual_seed(1000 + ctx.rank if resume else ctx.rank)  # a restart starts elsewhere
    # Parameters of several sizes, so DDP's initial and rebuilt bucket layouts differ.
    layers = [nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8), nn.Dropout(0.3), nn.Linear(8, 1)]
    wrap_kwargs = {"find_unused_parameters": True} if find_unused_parameters else {}
    model = ctx.wrap(nn.Sequential(*layers), **wrap_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = ctx.dataloader(Augmented(), batch_size=4, shuffle=True, num_workers=workers)
    start, step = 0, 0
    if resume:
        meta = ctx.load_checkpoint(folder, model=model, optimizer=optimizer)
        assert meta is not None
        start, step = meta["epoch"], meta["step"]
    trace = []
    for epoch in ctx.epochs(epochs, start=start):
        for index, x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if save_at is not None and step == save_at:
                ctx.save_checkpoint(
                    folder, model=model, optimizer=optimizer, epoch=epoch, step=step
                )
            if save_at is None or step > save_at:
                trace.append((epoch, step, index.tolist(), round(loss.item(), 7)))
    weights = [p.detach().clone() for p in model.parameters()]
    return {"trace": trace, "weights": weights}


@pytest.mark.parametrize(
    ("world_size", "workers"),
    [
        (2, 0),
        (3, 0),
        pytest.param(4, 0, marks=pytest.mark.slow),
        pytest.param(2, 2, marks=pytest.mark.slow),
    ],
    ids=["2-ranks", "3-ranks", "4-ranks", "2-ranks-2-workers"],
)
def test_a_mid_epoch_resume_continues_bit_identically(
    run_distributed: Any, tmp_path: Path, world_size: int, workers: int
) -> None:
    # Default ctx.wrap kwargs: from 3 ranks gloo sums a gradient element in an order set by its
    # place in DDP's bucket, and DDP rebuilds its buckets after the first iteration, so this
    # holds only because the checkpoint hands the rebuilt layout to the resumed model.
    steps_per_epoch = -(-37 // (4 * world_size))
    save_at = steps_per_epoch + 2  # in the middle of epoch 1
    folder = str(tmp_path)
    whole = run_distributed(train, folder, 3, save_at, False, workers, world_size=world_size)
    resumed = run_distributed(train, folder, 3, None, True, workers, world_size=world_size)
    for uninterrupted, again in zip(whole, resumed, strict=True):
        assert again["trace"][0][:2] == (1, save_at + 1)  # picked up at the next batch
        assert again["trace"] == uninterrupted["trace"]
        for mine, theirs in zip(again["weights"], uninterrupted["weights"], strict=True):
            assert torch.equal(mine, theirs)


@pytest.mark.parametrize("world_size", [3, 4])
def test_a_3_or_4_rank_resume_is_bit_identical_when_ddp_keeps_its_first_bucket_layout(
    run_distributed: Any, tmp_path: Path, world_size: int
) -> None:
    # DDP never rebuilds its buckets with find_unused_parameters=True, so every step of both
    # runs reduces the same buffer layout (and the checkpoint records none).
    save_at = -(-37 // (4 * world_size)) + 2
    folder = str(tmp_path)
    whole = run_distributed(train, folder, 2, save_at, False, 0, True, world_size=world_size)
    resumed = run_distributed(train, folder, 2, None, True, 0, True, world_size=world_size)
    for uninterrupted, again in zip(whole, resumed, strict=True):
        assert again["trace"] == uninterrupted["trace"]
        for mine, theirs in zip(again["weights"], uninterrupted["weights"], strict=True):
            assert torch.equal(mine, theirs)


def layered_run(
    folder: str, save_at: int | None, variant: str, save_again: bool = False
) -> list[torch.Tensor]:
    """Six steps of a 4-layer MLP; save at ``save_at``, or (None) resume and finish.

    ``save_again``: resume, save at once (before any step) and stop.
    """
    ctx = context()
    torch.manual_seed(7)
    layers = [nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 3)]
    module: nn.Module = nn.Sequential(*layers, nn.Tanh(), nn.Linear(3, 1))
    kwargs: dict[str, Any] = {
        "several-buckets": {"bucket_cap_mb": 0.002},
        "static-graph": {"static_graph": True},
        "grads-as-bucket-views": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.002},
    }.get(variant, {})
    if variant == "frozen-layer":  # the reducer holds only parameters that need gradients
        module[2].weight.requires_grad_(False)
    model = ctx.wrap(module, **kwargs)
    if variant == "comm-hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    # nanoGPT's shape: the script keeps raw_model = model.module and checkpoints that
    saved = ctx.unwrap(model) if variant == "raw-model" else model
    data = torch.Generator().manual_seed(ctx.rank)
    inputs = [torch.randn(5, 6, generator=data) for _ in range(6)]
    start = 0
    if save_at is None:
        meta = ctx.load_checkpoint(folder, model=saved, optimizer=optimizer)
        assert meta is not None
        start = meta["step"]
        if save_again:
            ctx.save_checkpoint(folder, model=saved, optimizer=optimizer, step=start)
            return []
    elif save_at == 0:
        ctx.save_checkpoint(folder, model=saved, optimizer=optimizer, step=0)
    for step in range(start, 6):
        loss = model(inputs[step]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step + 1 == save_at:
            ctx.save_checkpoint(folder, model=saved, optimizer=optimizer, step=step + 1)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("variant", "save_at"),
    [
        ("default", 1),  # DDP has not rebuilt yet: the save rebuilds as the next forward would
        ("default", 3),
        ("default", 0),  # before any step: nothing to record, both runs start alike
        ("several-buckets", 1),
        ("several-buckets", 3),
        ("static-graph", 2),  # a static graph rebuilds only at the third forward (docstring)
        ("static-graph", 4),
        ("grads-as-bucket-views", 1),
        ("grads-as-bucket-views", 3),
        ("comm-hook", 3),
        ("frozen-layer", 1),
        ("frozen-layer", 3),
        ("resumed-twice", 3),
        ("raw-model", 1),  # the bare module saved before DDP rebuilt, and loaded
        ("raw-model", 3),
    ],
)
def test_a_3_rank_ddp_resume_is_bit_identical_whatever_its_bucket_options(
    run_distributed: Any, tmp_path: Path, variant: str, save_at: int
) -> None:
    folder = str(tmp_path)
    whole = run_distributed(layered_run, folder, save_at, variant, world_size=3)
    if variant == "resumed-twice":  # resume, save at once (no step), resume from that save
        run_distributed(layered_run, folder, None, variant, save_again=True, world_size=3)
    resumed = run_distributed(layered_run, folder, None, variant, world_size=3)
    for uninterrupted, again in zip(whole, resumed, strict=True):
        for mine, theirs in zip(again, uninterrupted, strict=True):
            assert torch.equal(mine, theirs)


def seen_in_epoch(
    folder: str,
    epochs: int,
    save_at: int | None,
    resume: bool,
    pad: bool,
    stop_after: int,
    length: int = 36,
    batch_size: int = 5,
    drop_last: bool = False,
) -> dict[str, Any]:
    """Indices this rank read per epoch; stops ``stop_after`` steps past the save (a kill)."""
    ctx = context()
    model = nn.Linear(4, 1)  # not DDP: uneven unpadded shards take different step counts
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # 36 samples: even shards on 2 and 3 ranks, so the killed run saves in lockstep; batches
    # of 5 leave uneven remainders after the resume.
    loader = ctx.dataloader(
        Augmented(length), batch_size=batch_size, shuffle=True, pad=pad, drop_last=drop_last
    )
    start, step = 0, 0
    if resume:
        meta = ctx.load_checkpoint(
            folder, model=model, optimizer=optimizer, allow_world_size_change=True
        )
        assert meta is not None
        start, step = meta["epoch"], meta["step"]
    seen: dict[int, list[int]] = {}
    for epoch in ctx.epochs(epochs, start=start):
        for index, x, y in loader:
            model(x).sub(y).pow(2).mean().backward()
            optimizer.step()
            step += 1
            seen.setdefault(epoch, []).extend(index.tolist())
            if save_at is not None and step == save_at:
                ctx.save_checkpoint(
                    folder, model=model, optimizer=optimizer, epoch=epoch, step=step
                )
                seen[epoch].append(-1)  # marks "saved here"
            if save_at is not None and step == save_at + stop_after:
                return {"seen": seen, "finished": False}
    return {"seen": seen, "finished": True}


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2)], ids=["2-to-3", "3-to-2"])
def test_a_resume_on_another_world_size_reads_each_sample_of_the_epoch_once(
    run_distributed: Any, tmp_path: Path, before: int, after: int
) -> None:
    folder = str(tmp_path)
    save_at = -(-(36 // before) // 5) + 1  # after the first batch of epoch 1
    killed = run_distributed(seen_in_epoch, folder, 3, save_at, False, False, 2, world_size=before)
    resumed = run_distributed(seen_in_epoch, folder, 3, None, True, False, 0, world_size=after)
    assert all(rank["finished"] for rank in resumed)
    assert sorted(resumed[0]["seen"]) == [1, 2]
    before_save = []
    for rank in killed:
        read = rank["seen"][1]
        before_save += read[: read.index(-1)]  # what the killed run read up to its save
    after_save = [i for rank in resumed for i in rank["seen"][1]]
    assert sorted(before_save + after_save) == list(range(36))  # exactly once, none skipped
    assert sorted(i for rank in resumed for i in rank["seen"][2]) == list(range(36))


@pytest.mark.parametrize(
    ("before", "after", "into"), [(2, 3, 4), (3, 2, 5)], ids=["2-to-3", "3-to-2"]
)
def test_a_resize_under_drop_last_reads_every_sample_the_epoch_had_left(
    run_distributed: Any, tmp_path: Path, before: int, after: int, into: int
) -> None:
    # 320 samples in batches of 8, saved ``into`` batches per rank into epoch 1. 2 -> 3 ranks
    # left 256 samples, 86 per new rank (padded), and drop_last dropped 6 of each: 16 of the
    # epoch's samples were never read; 3 -> 2 left 200, and 8 were never read.
    folder = str(tmp_path)
    per_epoch = -(-320 // before) // 8
    shape = {"length": 320, "batch_size": 8, "drop_last": True}
    killed = run_distributed(
        seen_in_epoch, folder, 3, per_epoch + into, False, True, 1, **shape, world_size=before
    )
    resumed = run_distributed(
        seen_in_epoch, folder, 3, None, True, True, 0, **shape, world_size=after
    )
    before_save = []
    for rank in killed:
        read = rank["seen"][1]
        before_save += read[: read.index(-1)]
    after_save = [i for rank in resumed for i in rank["seen"][1]]
    left = set(range(320)) - set(before_save)
    assert set(after_save) == left  # none of the epoch's samples left is dropped
    assert len(after_save) - len(left) < after * 8  # repeats only to fill the last step
    assert len({len(rank["seen"][1]) for rank in resumed}) == 1  # every rank in step


@settings(max_examples=200, deadline=None)
@given(
    length=st.integers(1, 60),
    first=st.integers(1, 5),
    second=st.integers(1, 5),
    third=st.integers(1, 5),
    pad=st.booleans(),
    data=st.data(),
)
def test_any_chain_of_world_sizes_reads_each_sample_of_the_epoch(
    length: int, first: int, second: int, third: int, pad: bool, data: st.DataObject
) -> None:
    """Unpadded: each index exactly once. Padded: none skipped, repeats only to even out."""
    read: list[int] = []
    position: Position | None = None
    for world_size in (first, second, third):
        samplers = [
            ShardSampler(length, world_size, rank, shuffle=True, seed=5)
            for rank in range(world_size)
        ]
        consumed = []
        for sampler in samplers:
            sampler.set_epoch(2)
            if position is not None:
                sampler.resume(position)
            shard = list(sampler)
            taken = data.draw(st.integers(0, len(shard)))
            read += shard[:taken]
            consumed.append(sampler.skip + taken)
        position = Position(2, world_size, tuple(consumed), samplers[0].done_bytes())
    finishing = [ShardSampler(length, 2, rank, shuffle=True, seed=5, pad=pad) for rank in range(2)]
    for sampler in finishing:
        sampler.set_epoch(2)
        assert position is not None
        sampler.resume(position)
        read += list(sampler)
    if not pad:
        assert sorted(read) == list(range(length))
    else:
        assert set(read) == set(range(length))
        assert len(read) - length < first + second + third + 2  # padding, per deal < its size


@settings(max_examples=100, deadline=None)
@given(length=st.integers(1, 50), world_size=st.integers(1, 6), pad=st.booleans())
def test_shards_match_torchs_distributed_sampler_when_padded(
    length: int, world_size: int, pad: bool
) -> None:
    for rank in range(world_size):
        ours = ShardSampler(length, world_size, rank, shuffle=True, seed=3, pad=pad)
        ours.set_epoch(4)
        assert len(list(ours)) == len(ours)
        if pad:
            theirs = torch.utils.data.DistributedSampler(
                range(length), num_replicas=world_size, rank=rank, shuffle=True, seed=3
            )
            theirs.set_epoch(4)
            assert list(ours) == list(theirs)


def test_loaders_made_after_load_checkpoint_resume_too(tmp_path: Path) -> None:
    with distributed(seed=1) as ctx:
        loader = ctx.dataloader(list(range(20)), batch_size=3, shuffle=True, drop_last=True)
        first = []
        for _ in ctx.epochs(1):
            for batch in loader:
                first.append(batch.tolist())
                if len(first) == 2:
                    ctx.save_checkpoint(tmp_path, model=nn.Linear(1, 1), epoch=0)
    with distributed(seed=1) as ctx:
        assert ctx.load_checkpoint(tmp_path, model=nn.Linear(1, 1)) == {"epoch": 0}
        loader = ctx.dataloader(list(range(20)), batch_size=3, shuffle=True, drop_last=True)
        assert (len(loader), loader.start) == (6, 2)  # the whole epoch; 2 read before
        rest = [batch.tolist() for _ in ctx.epochs(1) for batch in loader]
    assert rest == first[2:]
    assert len(first) == 6  # drop_last: 20 // 3


def reference_resized_epoch(
    length: int,
    batch_size: int,
    before: int,
    after: int,
    pad: bool,
    drop_last: bool,
    batches_read: list[int],
) -> tuple[list[int], list[list[list[int]]]]:
    """Plain Python: what ``before`` ranks read, then each of ``after`` ranks' batches.

    The old ranks read ``batches_read[r]`` batches of their torch-style deal. The positions
    they did not read are dealt to the new ranks round-robin; under ``drop_last`` with
    ``pad`` they are first repeated up to whole batches on every rank, without ``pad`` they
    are dealt in runs of a batch.
    """
    order = torch.randperm(length, generator=torch.Generator().manual_seed(9 + 4)).tolist()
    spots = list(range(length))
    if pad:
        total = -(-length // before) * before
        spots = (spots * 2 * before)[:total]
    read, done = [], set()
    for rank in range(before):
        mine = spots[rank::before]
        usable = len(mine) // batch_size * batch_size if drop_last else len(mine)
        taken = mine[: min(batches_read[rank] * batch_size, usable)]
        read += [order[spot] for spot in taken]
        done |= set(taken)
    left = [spot for spot in range(length) if spot not in done]
    batches = []
    for rank in range(after):
        if drop_last and not pad:
            runs = [left[i : i + batch_size] for i in range(0, len(left), batch_size)]
            mine = [spot for run in runs[rank::after] for spot in run]
        else:
            unit = after * batch_size if drop_last else after
            padded = left
            if pad and left:
                total = -(-len(left) // unit) * unit
                padded = (left * total)[:total]
            mine = padded[rank::after]
        cut = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
        if drop_last:
            cut = [batch for batch in cut if len(batch) == batch_size]
        batches.append([[order[spot] for spot in batch] for batch in cut])
    return read, batches


@settings(max_examples=400, deadline=None)
@given(
    length=st.integers(1, 80),
    batch_size=st.integers(1, 9),
    before=st.integers(1, 5),
    after=st.integers(1, 5),
    pad=st.booleans(),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_a_resized_epoch_reads_every_sample_left_once_also_under_drop_last(
    length: int,
    batch_size: int,
    before: int,
    after: int,
    pad: bool,
    drop_last: bool,
    data: st.DataObject,
) -> None:
    fill = batch_size if drop_last else 1  # what ctx.dataloader(drop_last=...) sets
    old = [
        SeededBatches(
            ShardSampler(length, before, rank, seed=9, pad=pad, fill=fill), batch_size, drop_last, 9
        )
        for rank in range(before)
    ]
    batches_read, consumed, read = [], [], []
    for batches in old:
        batches.sampler.set_epoch(4)
        everything = list(batches)
        count = data.draw(st.integers(0, len(everything)))
        batches_read.append(count)
        taken = [index for batch in everything[:count] for index in batch]
        read += taken
        consumed.append(len(taken))
    position = Position(4, before, tuple(consumed))
    expected_read, expected = reference_resized_epoch(
        length, batch_size, before, after, pad, drop_last, batches_read
    )
    assert sorted(read) == sorted(expected_read)
    new = []
    for rank in range(after):
        sampler = ShardSampler(length, after, rank, seed=9, pad=pad, fill=fill)
        sampler.set_epoch(4)
        sampler.resume(position)
        batches = SeededBatches(sampler, batch_size, drop_last, 9)
        announced = len(batches)  # before the pass: after it, len is the next (whole) pass's
        got = [list(batch) for batch in batches]
        if before != after:  # the same world size continues each rank's own deal
            assert got == expected[rank]
        assert len(got) == announced
        new.append(got)
    after_read = [index for got in new for batch in got for index in batch]
    unread = set(range(length)) - set(read)
    if before == after:
        return
    if pad or not drop_last:  # every sample left is read, repeats only to even out the ranks
        assert set(after_read) == unread
        repeats = len(after_read) - len(unread)
        assert 0 <= repeats < after * (batch_size if drop_last else 1)
    else:  # no repeats; drop_last drops only the last short run of the samples left
        assert len(after_read) == len(set(after_read))
        assert set(after_read) <= unread
        assert len(unread) - len(after_read) == len(unread) % batch_size
    if pad:  # the ranks stay in step
        assert len({len(got) for got in new}) == 1


@settings(max_examples=200, deadline=None)
@given(
    length=st.integers(1, 60),
    batch_size=st.integers(1, 6),
    sizes=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    pad=st.booleans(),
    data=st.data(),
)
@pytest.mark.slow  # over 2 s: out of the quick tier
def test_any_chain_of_world_sizes_under_drop_last_leaves_less_than_a_batch_unread(
    length: int, batch_size: int, sizes: list[int], pad: bool, data: st.DataObject
) -> None:
    """drop_last loaders resized again and again (same sizes too): padded, every sample of the
    epoch is read; unpadded, none twice and fewer than one batch never. (Never resized, the
    epoch's one deal drops each rank's short last batch, as torch's drop_last does.)"""
    assume(any(before != after for before, after in itertools.pairwise(sizes)))
    read: list[int] = []
    position: Position | None = None
    for turn, world_size in enumerate(sizes):
        last = turn == len(sizes) - 1
        consumed = []
        for rank in range(world_size):
            sampler = ShardSampler(length, world_size, rank, seed=2, pad=pad, fill=batch_size)
            sampler.set_epoch(1)
            if position is not None:
                sampler.resume(position)
            batches = list(SeededBatches(sampler, batch_size, True, 2))
            taken = len(batches) if last else data.draw(st.integers(0, len(batches)))
            read += [index for batch in batches[:taken] for index in batch]
            consumed.append(sampler.skip + taken * batch_size)
            done = sampler.done_bytes()
        position = Position(1, world_size, tuple(consumed), done, batch_size)
    if pad:
        assert set(read) == set(range(length))
    else:
        assert len(read) == len(set(read))
        assert length - len(read) < batch_size


def saved_between_backward_and_step(folder: str, save: bool, view: bool) -> list[torch.Tensor]:
    """Four SGD-with-momentum steps; with ``save``, a checkpoint after the first backward."""
    ctx = context()
    torch.manual_seed(3)
    layers = [nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 1)]
    model = ctx.wrap(nn.Sequential(*layers), gradient_as_bucket_view=view, bucket_cap_mb=0.002)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(ctx.rank)
    for step in range(4):
        optimizer.zero_grad(set_to_none=False)  # gradients live in (or beside) the buckets
        model(torch.randn(5, 6, generator=data)).pow(2).mean().backward()
        if save and step == 0:  # DDP has not rebuilt yet: the save rebuilds its buckets
            ctx.save_checkpoint(folder, model=model, optimizer=optimizer, step=1)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("view", [False, True], ids=["grads-apart", "grads-as-bucket-views"])
def test_a_save_between_backward_and_step_leaves_the_run_unchanged(
    run_distributed: Any, tmp_path: Path, view: bool
) -> None:
    folder = str(tmp_path)
    plain = run_distributed(saved_between_backward_and_step, folder, False, view, world_size=3)
    saving = run_distributed(saved_between_backward_and_step, folder, True, view, world_size=3)
    for mine, theirs in zip(saving, plain, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
