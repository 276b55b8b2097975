"""ctx.dataloader over an IterableDataset: each sample read once, ranks ending together.

Resuming streams is in tests/test_stream_resume.py.
"""

from __future__ import annotations

import itertools
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import IterableDataset

from ddpctx import DistContext, distributed
from ddpctx.data.streamsplit import StreamShard, WorkerPlan
from tests.helpers import REPO, child_env, patience


class Numbered(IterableDataset[torch.Tensor]):
    """Samples 0..n-1, each a one-element float tensor carrying its number."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        for number in range(self.n):
            yield torch.tensor([float(number)])


class OwnShare(IterableDataset[torch.Tensor]):
    """Splits itself by rank: rank 0's share is 30% longer than the others'."""

    splits_itself = "ranks"

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self) -> Iterator[torch.Tensor]:
        count = 130 if self.rank == 0 else 100
        for number in range(count):
            yield torch.tensor([float(self.rank * 1000 + number)])


def numbers(batches: Any) -> list[int]:
    return [int(value) for batch in batches for value in batch.flatten().tolist()]


def train(ctx: DistContext, loader: Any, epochs: int) -> list[tuple[list[int], int]]:
    """DDP training over ``loader``; per epoch, the sample numbers read and the steps taken."""
    model = ctx.wrap(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    read = []
    for _ in ctx.epochs(epochs):
        mine, steps = [], 0
        for batch in loader:
            loss = model(batch).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            mine += numbers([batch])
            steps += 1
        read.append((mine, steps))
    return read


@pytest.mark.slow
@pytest.mark.distributed(world_size=3, timeout=120)
def test_1001_samples_on_3_ranks_and_2_workers_are_each_read_once_and_ranks_step_together(
    dist_ctx: DistContext,
) -> None:
    loader = dist_ctx.dataloader(Numbered(1001), batch_size=4, num_workers=2)
    for mine, steps in train(dist_ctx, loader, epochs=2):
        everyone = dist_ctx.all_gather((mine, steps))
        read = [number for numbers_read, _ in everyone for number in numbers_read]
        assert len(read) == len(set(read)), "a sample was read twice in one epoch"
        assert len(read) >= 1001 - dist_ctx.world_size * 4, "more than a batch per rank left out"
        assert set(read) <= set(range(1001))
        assert len({steps for _, steps in everyone}) == 1, f"steps differ: {everyone}"


@pytest.mark.slow
@pytest.mark.distributed(world_size=3, timeout=120)
def test_a_rank_whose_own_share_is_30_percent_longer_ends_the_epoch_with_the_others(
    dist_ctx: DistContext,
) -> None:
    loader = dist_ctx.dataloader(OwnShare(dist_ctx.rank), batch_size=8, num_workers=2)
    for mine, steps in train(dist_ctx, loader, epochs=1):  # a hang would fail by the timeout
        everyone = dist_ctx.all_gather((mine, steps))
        assert [steps for _, steps in everyone] == [13, 13, 13]  # 100 samples: 13 batches
        assert [len(mine) for mine, _ in everyone] == [104, 100, 100]  # rank 0's rest dropped


@pytest.mark.distributed(world_size=2, timeout=60)
def test_pad_false_reads_every_sample_and_lets_ranks_end_apart(dist_ctx: DistContext) -> None:
    loader = dist_ctx.dataloader(OwnShare(dist_ctx.rank), batch_size=8, pad=False)
    everyone = dist_ctx.all_gather(numbers(loader))
    assert [len(mine) for mine in everyone] == [130, 100]


def shard_batches(
    n: int, rank: int, world_size: int, batch_size: int, workers: int, drop_last: bool = False
) -> list[tuple[int, list[int]]]:
    """One rank's (batch index, numbers) as its workers read them, merged in batch order."""
    items = []
    for worker in range(workers):
        shard = StreamShard(
            range(n),
            rank=rank,
            world_size=world_size,
            batch_size=batch_size,
            drop_last=drop_last,
        )
        items += [
            (index, batch.tolist())
            for _, index, batch, _ in shard._rank_batches(worker, workers, WorkerPlan(), False)
        ]
    return sorted(items)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(0, 60),
    world_size=st.integers(1, 4),
    batch_size=st.integers(1, 7),
    workers=st.integers(1, 4),
)
def test_every_sample_goes_to_one_rank_and_worker_and_workers_change_nothing(
    n: int, world_size: int, batch_size: int, workers: int
) -> None:
    per_rank = [shard_batches(n, r, world_size, batch_size, workers) for r in range(world_size)]
    read = [number for rank in per_rank for _, batch in rank for number in batch]
    assert sorted(read) == list(range(n))  # each sample exactly once
    for rank, batches in enumerate(per_rank):
        assert [index for index, _ in batches] == list(range(len(batches)))
        assert batches == shard_batches(n, rank, world_size, batch_size, 1)  # as one worker
        expected = list(range(rank, n, world_size))  # the plain strided split, in order
        assert [number for _, batch in batches for number in batch] == expected
    counts = [len(batches) for batches in per_rank]
    assert max(counts) - min(counts) <= 1  # shares differ by one sample at most


class Noisy(IterableDataset[torch.Tensor]):
    """Draws from the global generators while streaming (augmentation-like)."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        for number in range(23):
            draws = [random.random(), np.random.random(), torch.rand(1).item()]
            yield torch.tensor([number, *draws])


def test_batches_and_their_random_draws_do_not_depend_on_num_workers() -> None:
    with distributed(seed=5) as ctx:
        without = list(ctx.dataloader(Noisy(), batch_size=4))
        with_two = list(ctx.dataloader(Noisy(), batch_size=4, num_workers=2))
    assert len(without) == len(with_two) == 6
    assert all(torch.equal(a, b) for a, b in zip(without, with_two, strict=True))


def test_reading_without_workers_leaves_the_training_random_stream_alone() -> None:
    with distributed(seed=5) as ctx:
        loader = ctx.dataloader(Noisy(), batch_size=4)
        random.seed(1)
        np.random.seed(1)
        torch.manual_seed(1)
        for _ in loader:
            pass
        after = (random.random(), np.random.random(), torch.rand(1).item())
        random.seed(1)
        np.random.seed(1)
        torch.manual_seed(1)
        assert after == (random.random(), np.random.random(), torch.rand(1).item())


def test_the_shuffle_buffer_shuffles_each_epoch_anew_and_keeps_every_sample() -> None:
    with distributed(seed=2) as ctx:
        loader = ctx.dataloader(Numbered(50), batch_size=5, shuffle=True, shuffle_buffer=16)
        orders = [numbers(loader) for _ in ctx.epochs(2)]
        again = ctx.dataloader(Numbered(50), batch_size=5, shuffle_buffer=16, num_workers=2)
        assert [numbers(again) for _ in ctx.epochs(2)] == orders  # seeded, workers or not
    assert all(sorted(order) == list(range(50)) for order in orders)
    assert orders[0] != orders[1] != list(range(50))


def test_a_hugging_face_style_declared_split_and_drop_last_are_honoured() -> None:
    class Halves(IterableDataset[int]):
        splits_itself = "ranks_and_workers"

        def __iter__(self) -> Iterator[int]:
            info = torch.utils.data.get_worker_info()
            worker = info.id if info is not None else 0
            return iter(range(worker * 100, worker * 100 + 9))

    with distributed() as ctx:
        loader = ctx.dataloader(Halves(), batch_size=4, num_workers=2, drop_last=True)
        assert numbers(loader) == [0, 1, 2, 3, 100, 101, 102, 103, 4, 5, 6, 7, 104, 105, 106, 107]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"shuffle": True}, "Pass shuffle_buffer=N"),
        ({"shuffle_buffer": -1}, r"shuffle_buffer=-1\): must be a non-negative int"),
        ({"shuffle_buffer": 2.5}, r"shuffle_buffer=2.5\): must be a non-negative int"),
        ({"persistent_workers": True, "num_workers": 1}, "Drop persistent_workers"),
        ({"sampler": [0]}, "nothing for a sampler to choose"),
    ],
)
def test_stream_arguments_that_cannot_work_are_refused(
    arguments: dict[str, Any], message: str
) -> None:
    with distributed() as ctx, pytest.raises(ValueError, match=message):
        ctx.dataloader(Numbered(3), batch_size=2, **arguments)


def test_an_unknown_declared_split_and_a_buffer_for_a_map_dataset_are_refused() -> None:
    stream = Numbered(3)
    stream.splits_itself = "nodes"  # type: ignore[attr-defined]
    with distributed() as ctx:
        with pytest.raises(ValueError, match=r"splits_itself='nodes': must be 'ranks'"):
            ctx.dataloader(stream, batch_size=2)
        with pytest.raises(ValueError, match="the buffer shuffles streams"):
            ctx.dataloader([1, 2, 3], batch_size=2, shuffle_buffer=4)


def test_a_stream_is_read_lazily_in_batches() -> None:
    endless = itertools.count()

    class Endless(IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return endless

    with distributed() as ctx:
        loader = iter(ctx.dataloader(Endless(), batch_size=3))
        assert [next(loader).tolist() for _ in range(2)] == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.slow
def test_the_streaming_guide_example_runs_and_says_what_the_guide_says() -> None:
    guide = (REPO / "docs" / "guides" / "streaming-data.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", guide, re.DOTALL | re.MULTILINE)
    assert blocks
    result = subprocess.run(
        [sys.executable, "-c", blocks[0]],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=patience(120),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "epoch 1: 251 steps" in result.stdout


@pytest.mark.slow
def test_the_stream_benchmark_runs() -> None:
    command = [sys.executable, "benchmarks/bench_stream.py", "--rounds", "1", "--samples", "256"]
    result = subprocess.run(
        command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=patience(120)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("| ddpctx, ") == 4


@pytest.mark.parametrize("workers", [0, 2])
def test_empty_short_and_dict_streams_give_what_a_plain_dataloader_gives(workers: int) -> None:
    class Records(IterableDataset[dict[str, Any]]):
        def __init__(self, count: int) -> None:
            self.count = count

        def __iter__(self) -> Iterator[dict[str, Any]]:
            for n in range(self.count):
                yield {"id": n, "name": f"n{n}", "x": torch.ones(2) * n}

    with distributed() as ctx:
        for count, batch_size in ((0, 4), (3, 10), (9, 4)):
            ours = list(ctx.dataloader(Records(count), batch_size=batch_size, num_workers=workers))
            plain = list(torch.utils.data.DataLoader(Records(count), batch_size=batch_size))
            assert [batch["id"].tolist() for batch in ours] == [b["id"].tolist() for b in plain]
            assert [batch["name"] for batch in ours] == [batch["name"] for batch in plain]
