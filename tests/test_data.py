"""ctx.dataloader and ctx.epochs on real ranks: shards, shuffles, worker seeds."""

from __future__ import annotations

import collections
import dataclasses
import gc
import math
import os
import random
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from ddpctx import DistContext, distributed
from ddpctx.data.loader import to_device

RANKS = pytest.mark.distributed(world_size=[2, 3], timeout=60)


def epoch_indices(ctx: DistContext, loader: Any) -> list[int]:
    return [int(i) for batch in loader for i in batch]


@RANKS
def test_unpadded_shards_cover_the_dataset_exactly_once_every_epoch(dist_ctx: DistContext) -> None:
    loader = dist_ctx.dataloader(list(range(11)), batch_size=3, shuffle=True, pad=False)
    orders = []
    for _ in dist_ctx.epochs(3):
        mine = epoch_indices(dist_ctx, loader)
        everyone = dist_ctx.all_gather(mine)
        assert sorted(i for shard in everyone for i in shard) == list(range(11))
        assert max(map(len, everyone)) - min(map(len, everyone)) <= 1  # uneven, not padded
        orders.append(mine)
    assert orders[0] != orders[1]  # a new shuffle each epoch


@RANKS
def test_padded_shards_follow_torchs_padding_rule(dist_ctx: DistContext) -> None:
    n, world = 11, dist_ctx.world_size
    loader = dist_ctx.dataloader(list(range(n)), batch_size=4, shuffle=True)
    for _ in dist_ctx.epochs(2):
        everyone = dist_ctx.all_gather(epoch_indices(dist_ctx, loader))
        per_rank = math.ceil(n / world)
        assert [len(shard) for shard in everyone] == [per_rank] * world
        flat = [i for shard in everyone for i in shard]
        assert set(flat) == set(range(n))
        assert len(flat) - n == per_rank * world - n  # the few repeated to even the shards


@RANKS
def test_the_order_is_the_same_for_the_same_seed(dist_ctx: DistContext) -> None:
    first = dist_ctx.dataloader(list(range(20)), batch_size=5, shuffle=True, pad=False)
    second = dist_ctx.dataloader(list(range(20)), batch_size=5, shuffle=True, pad=False)
    for _ in dist_ctx.epochs(2):
        assert epoch_indices(dist_ctx, first) == epoch_indices(dist_ctx, second)


def test_a_different_seed_gives_a_different_order() -> None:
    orders = []
    for seed in (1, 2):
        with distributed(seed=seed) as ctx:
            loader = ctx.dataloader(list(range(50)), batch_size=50, shuffle=True)
            orders.append(epoch_indices(ctx, loader))
    assert orders[0] != orders[1]


class Draws(Dataset[tuple[int, int, float, float, int]]):
    """Each item reports its worker, three random draws made in the worker, and a flag."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[int, int, float, float, int]:
        info = get_worker_info()
        worker = info.id if info is not None else -1
        flag = int(getattr(np, "user_init_ran", 0))
        return worker, random.getrandbits(31), float(np.random.rand()), torch.rand(1).item(), flag


def user_init(worker_id: int) -> None:
    np.user_init_ran = 1  # type: ignore[attr-defined]


@RANKS
def test_workers_are_seeded_per_rank_worker_and_epoch_and_user_init_still_runs(
    dist_ctx: DistContext,
) -> None:
    loader = dist_ctx.dataloader(
        Draws(), batch_size=1, shuffle=False, pad=False, num_workers=2, worker_init_fn=user_init
    )
    firsts: dict[tuple[int, int, int], tuple[int, float, float]] = {}
    for epoch in dist_ctx.epochs(2):
        for worker, py, numpy_draw, torch_draw, flag in loader:
            assert int(flag) == 1
            key = (dist_ctx.rank, int(worker), epoch)
            firsts.setdefault(key, (int(py), float(numpy_draw), float(torch_draw)))
    everyone = {k: v for shard in dist_ctx.all_gather(firsts) for k, v in shard.items()}
    assert len(everyone) == dist_ctx.world_size * 2 * 2  # ranks x workers x epochs
    for position in range(3):  # python, numpy and torch draws all distinct
        assert len({draws[position] for draws in everyone.values()}) == len(everyone)


def test_dataloader_refuses_what_it_cannot_shard() -> None:
    class Stream(IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(3))

    with distributed() as ctx:
        with pytest.raises(ValueError, match="nothing for a sampler to choose"):
            ctx.dataloader(Stream(), batch_size=2, sampler=[0, 1])
        with pytest.raises(ValueError, match=r"got sampler=\.\.\.; it makes its own"):
            ctx.dataloader([1, 2], batch_size=1, sampler=[0, 1])
        with pytest.raises(ValueError, match=r"batch_size=0 must be a positive int"):
            ctx.dataloader([1, 2], batch_size=0)


def test_epochs_validates_its_range() -> None:
    with distributed() as ctx:
        assert list(ctx.epochs(3, start=3)) == []
        with pytest.raises(ValueError, match=r"start=4 is past n=3"):
            list(ctx.epochs(3, start=4))
        with pytest.raises(ValueError, match=r"n=-1 must be a non-negative int"):
            list(ctx.epochs(-1))


@RANKS
def test_persistent_workers_are_seeded_per_epoch_like_fresh_ones(dist_ctx: DistContext) -> None:
    """A persistent worker's epoch-1 draws equal a fresh worker's: resume-safe (issue 11.3)."""
    persistent = dist_ctx.dataloader(
        Draws(), batch_size=2, shuffle=True, pad=False, num_workers=2, persistent_workers=True
    )
    fresh = dist_ctx.dataloader(Draws(), batch_size=2, shuffle=True, pad=False, num_workers=2)
    draws: dict[str, list[list[float]]] = {"persistent": [], "fresh": []}
    for epoch in dist_ctx.epochs(2):
        draws["persistent"].append(
            [float(v) for _, _, numpy_draws, _, _ in persistent for v in numpy_draws]
        )
        if epoch == 1:
            draws["fresh"].append(
                [float(v) for _, _, numpy_draws, _, _ in fresh for v in numpy_draws]
            )
    assert draws["persistent"][1] == draws["fresh"][0]
    assert draws["persistent"][0] != draws["persistent"][1]


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    name: str


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def test_batches_arrive_on_the_device_inside_any_container() -> None:
    moved = to_device(
        {"a": [Pair(torch.ones(1), torch.zeros(1))], "b": (Sample(torch.ones(2), "s"), 3)},
        torch.device("meta"),
        non_blocking=False,
    )
    assert moved["a"][0].x.device.type == "meta"
    assert isinstance(moved["a"][0], Pair)
    assert moved["b"][0].x.device.type == "meta"
    assert moved["b"][0].name == "s"
    assert moved["b"][1] == 3


def test_the_loader_moves_batches_to_the_device_unless_told_not_to() -> None:
    with distributed() as ctx:
        default = ctx.dataloader(list(range(4)), batch_size=2)
        assert all(batch.device == ctx.device for batch in default)
        assert not default.pin_memory  # pinned memory only with CUDA: no warning on CPU
        meta = ctx.dataloader(list(range(4)), batch_size=2, device="meta")
        assert all(batch.device.type == "meta" for batch in meta)
        untouched = ctx.dataloader([torch.ones(1)] * 2, batch_size=2, device=None)
        assert [batch.device.type for batch in untouched] == ["cpu"]
        assert isinstance(default, DataLoader)
        assert (default.batch_size, len(default)) == (2, 2)


@dataclasses.dataclass
class Scaled:
    """A batch whose __post_init__ transforms its input: rebuilding it would apply it twice."""

    x: torch.Tensor
    scale: float = 10.0

    def __post_init__(self) -> None:
        self.x = self.x * self.scale - 10


class AttributeDict(dict[str, Any]):
    """EasyDict-style: keys are attributes too."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Encoding(collections.UserDict[str, Any]):
    """Like HuggingFace's BatchEncoding: a UserDict with its own attributes."""

    def __init__(self, data: dict[str, Any], note: str) -> None:
        super().__init__(data)
        self.note = note


def collate_scaled(items: list[float]) -> Scaled:
    batch = Scaled(torch.tensor(items) / 10 + 1)  # __post_init__ makes it items * 1.0
    batch.split = "train"  # type: ignore[attr-defined]  # set after construction
    return batch


@pytest.mark.parametrize("device", [None, "cpu", "meta"], ids=["as-is", "cpu", "meta"])
def test_a_dataclass_batch_is_moved_not_rebuilt(device: str | None) -> None:
    with distributed() as ctx:
        loader = ctx.dataloader([0.0, 10.0], batch_size=2, collate_fn=collate_scaled, device=device)
        (batch,) = list(loader)
    assert isinstance(batch, Scaled)
    assert batch.split == "train"  # type: ignore[attr-defined]
    assert batch.x.device.type == (device or "cpu")
    if device != "meta":
        assert batch.x.tolist() == [0.0, 10.0]  # __post_init__ ran once


def test_mapping_batches_keep_their_type_and_attributes_and_are_moved() -> None:
    meta = torch.device("meta")
    attributes = to_device(AttributeDict(x=torch.ones(1), label="a"), meta, non_blocking=False)
    assert type(attributes) is AttributeDict
    assert attributes.x.device.type == "meta"
    assert attributes.label == "a"
    encoding = to_device(Encoding({"ids": torch.ones(2)}, note="n"), meta, non_blocking=False)
    assert type(encoding) is Encoding
    assert encoding.note == "n"
    assert encoding["ids"].device.type == "meta"
    counts = to_device(collections.Counter(a=1), meta, non_blocking=False)
    assert counts == collections.Counter(a=1)
    factory = to_device(collections.defaultdict(list, x=torch.ones(1)), meta, non_blocking=False)
    assert isinstance(factory, collections.defaultdict)
    assert factory["missing"] == []
    assert factory["x"].device.type == "meta"


def test_a_batch_already_on_the_device_is_the_same_object() -> None:
    batch = {"x": torch.ones(1), "rows": [Scaled(torch.ones(1))]}
    assert to_device(batch, torch.device("cpu"), non_blocking=False) is batch


def test_an_empty_dataset_is_refused_with_pad_and_gives_no_batches_without() -> None:
    with distributed() as ctx:
        with pytest.raises(ValueError, match=r"empty list \(len 0\) with pad=True"):
            ctx.dataloader([], batch_size=2)
        loader = ctx.dataloader([], batch_size=2, pad=False)
        assert (len(loader), [batch for _ in ctx.epochs(1) for batch in loader]) == (0, [])


@pytest.mark.distributed(world_size=3)
def test_fewer_samples_than_ranks_pad_to_one_each_or_leave_some_ranks_empty(
    dist_ctx: DistContext,
) -> None:
    padded = [b.tolist() for b in dist_ctx.dataloader([10, 11], batch_size=4)]
    exact = [b.tolist() for b in dist_ctx.dataloader([10, 11], batch_size=4, pad=False)]
    assert padded == [[[10], [11], [10]][dist_ctx.rank]]  # as torch's DistributedSampler pads
    assert dist_ctx.all_gather(exact) == [[[10]], [[11]], []]


class _Finalized:
    """Part of a reference cycle; records which process finalized it."""

    def __init__(self, record: str) -> None:
        self.record = record
        self.cycle = self

    def __del__(self) -> None:
        with open(self.record, "a") as out:
            out.write(f"{os.getpid()}\n")


class _CollectsInWorkers(Dataset[int]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        gc.collect()  # what an allocation-heavy worker does on its own, sooner or later
        return index


def test_a_worker_never_finalizes_what_the_rank_left_for_its_collector(tmp_path: Any) -> None:
    """A forked worker collecting the rank's uncollected cycles aborted in gloo's destructors."""
    record = str(tmp_path / "finalized")
    with distributed(seed=0) as ctx:
        loader = ctx.dataloader(_CollectsInWorkers(), batch_size=2, num_workers=2)
        gc.disable()
        try:
            _Finalized(record)  # garbage the rank has not collected when the workers fork
            assert [int(i) for batch in loader for i in batch] != []
        finally:
            gc.enable()
        gc.collect()
    with open(record) as finalized:
        assert finalized.read().split() == [str(os.getpid())]
