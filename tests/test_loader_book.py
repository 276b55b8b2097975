"""The context's loaders: freed when dropped, in the current epoch, matched to saved positions by
identity (not by the order they are made in), and the step numbers of a resumed epoch."""

from __future__ import annotations

import gc
import random
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import ConcatDataset, Dataset, Subset

from ddpctx import DistContext, distributed
from ddpctx.data.generators import PrivateGeneratorWarning, private_generators


class Numbers(Dataset[int]):
    def __init__(self, length: int) -> None:
        self.values = list(range(length))

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: int) -> int:
        return self.values[index]


class Validation(Numbers):
    """Another kind of data with the same length as the training data."""


def test_a_dropped_loader_and_its_dataset_are_freed() -> None:
    with distributed(seed=0) as ctx:
        alive = []
        for _ in ctx.epochs(3):
            dataset = Numbers(64)
            alive.append(weakref.ref(dataset))
            loader = ctx.dataloader(dataset, batch_size=8)
            assert sum(len(batch) for batch in loader) == 64
            del dataset, loader
            gc.collect()
        assert [ref() for ref in alive] == [None, None, None]


def test_a_loader_made_inside_the_epoch_loop_shuffles_anew_each_epoch() -> None:
    with distributed(seed=0) as ctx:
        before = ctx.dataloader(list(range(8)), batch_size=8, shuffle=True)
        inside, outside = [], []
        for _ in ctx.epochs(3):
            made_here = ctx.dataloader(list(range(8)), batch_size=8, shuffle=True)
            inside.append(next(iter(made_here)).tolist())
            outside.append(next(iter(before)).tolist())
    assert inside == outside
    assert len({tuple(order) for order in inside}) == 3


def run_with_validation_first(folder: str, resume: bool) -> dict[str, Any]:
    """Train on 16 samples, validate on 16 others; the resumed run makes its loaders in the
    opposite order. Returns what each loader read."""
    from ddpctx import current

    ctx = current()
    assert ctx is not None
    model = nn.Linear(1, 1)
    if resume:
        val = ctx.dataloader(Numbers(16), batch_size=2, shuffle=False)
        train = ctx.dataloader(Numbers(16), batch_size=2, shuffle=True)
        meta = ctx.load_checkpoint(folder, model=model)
        assert meta is not None
        start = meta["epoch"]
    else:
        train = ctx.dataloader(Numbers(16), batch_size=2, shuffle=True)
        val = ctx.dataloader(Numbers(16), batch_size=2, shuffle=False)
        start = 0
    read: dict[str, list[int]] = {"train": [], "val": []}
    for epoch in ctx.epochs(2, start=start):
        for step, batch in enumerate(train, start=train.start):
            read["train"] += batch.tolist()
            if not resume and epoch == 1 and step == 1:
                ctx.save_checkpoint(folder, model=model, epoch=epoch, step=step)
                return read
        for batch in val:
            read["val"] += batch.tolist()
    return read


@pytest.mark.distributed(world_size=2)
def test_positions_follow_the_loader_not_the_order_loaders_are_made_in(
    dist_ctx: DistContext, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = dist_ctx.broadcast(str(tmp_path_factory.mktemp("ckpt")) if dist_ctx.is_main else None)
    killed = run_with_validation_first(folder, resume=False)
    resumed = run_with_validation_first(folder, resume=True)
    everyone = dist_ctx.all_gather((killed, resumed))
    train = [i for k, r in everyone for i in k["train"][-4:] + r["train"]]  # epoch 1
    assert sorted(train) == list(range(16))  # each training sample once, none read twice
    assert sorted(i for _, r in everyone for i in r["val"]) == list(range(16))


@pytest.mark.distributed(world_size=2)
def test_two_look_alike_loaders_at_different_positions_must_be_named(
    dist_ctx: DistContext, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = dist_ctx.broadcast(str(tmp_path_factory.mktemp("ckpt")) if dist_ctx.is_main else None)
    first = dist_ctx.dataloader(Numbers(8), batch_size=2)
    second = dist_ctx.dataloader(Numbers(8), batch_size=2)
    for _ in dist_ctx.epochs(1):
        next(iter(first))
        with pytest.raises(ValueError, match=r"both Numbers of 8 samples .* Give them names"):
            dist_ctx.save_checkpoint(folder, model=nn.Linear(1, 1))
        named = [dist_ctx.dataloader(Numbers(8), batch_size=2, name=n) for n in ("a", "b")]
        next(iter(named[0]))
        del first, second
        dist_ctx.save_checkpoint(folder, model=nn.Linear(1, 1), epoch=0)
    assert [len(loader) for loader in named] == [2, 2]


def test_a_named_loader_whose_data_changed_is_refused_at_resume(tmp_path: Path) -> None:
    with distributed(seed=0) as ctx:
        loader = ctx.dataloader(Numbers(10), batch_size=2, name="train")
        for _ in ctx.epochs(1):
            next(iter(loader))
            ctx.save_checkpoint(tmp_path, model=nn.Linear(1, 1), epoch=0)
    with distributed(seed=0) as ctx:
        ctx.load_checkpoint(tmp_path, model=nn.Linear(1, 1))
        with pytest.raises(ValueError, match=r"name='train' reads Numbers of 12 samples.*10"):
            ctx.dataloader(Numbers(12), batch_size=2, name="train")
        with pytest.raises(ValueError, match=r"Numbers of 11 samples.*data changed length"):
            ctx.dataloader(Numbers(11), batch_size=2)


def test_len_is_the_whole_epoch_and_start_numbers_a_resumed_one(tmp_path: Path) -> None:
    with distributed(seed=3) as ctx:
        loader = ctx.dataloader(Numbers(20), batch_size=2, shuffle=True)
        uninterrupted = []
        for _ in ctx.epochs(1):
            for step, batch in enumerate(loader, start=loader.start):
                uninterrupted.append((step, len(loader), batch.tolist()))
                if step == 3:
                    ctx.save_checkpoint(tmp_path, model=nn.Linear(1, 1), epoch=0, step=step)
    with distributed(seed=3) as ctx:
        ctx.load_checkpoint(tmp_path, model=nn.Linear(1, 1))
        loader = ctx.dataloader(Numbers(20), batch_size=2, shuffle=True)
        assert (len(loader), loader.start) == (10, 4)
        resumed = [
            (step, len(loader), batch.tolist())
            for _ in ctx.epochs(1)
            for step, batch in enumerate(loader, start=loader.start)
        ]
        assert (len(loader), loader.start) == (10, 0)  # a pass done: the next epoch is whole
    assert resumed == uninterrupted[4:]


def test_len_and_start_describe_the_resumed_epoch_right_after_load_checkpoint(
    tmp_path: Path,
) -> None:
    with distributed(seed=3) as ctx:
        loader = ctx.dataloader(Numbers(20), batch_size=2, shuffle=True)
        for epoch in ctx.epochs(2):
            for step, _ in enumerate(loader, start=loader.start):
                if (epoch, step) == (1, 6):
                    ctx.save_checkpoint(tmp_path, model=nn.Linear(1, 1), epoch=1, step=16)
    with distributed(seed=3) as ctx:
        loader = ctx.dataloader(Numbers(20), batch_size=2, shuffle=True)  # made before the load
        assert (len(loader), loader.start) == (10, 0)
        meta = ctx.load_checkpoint(tmp_path, model=nn.Linear(1, 1))
        assert meta is not None
        assert (len(loader), loader.start) == (10, 7)  # epoch 1, before ctx.epochs sets it
        steps = [step for _ in ctx.epochs(2, start=1) for step, _ in enumerate(loader, 7)]
    assert steps == [7, 8, 9]


class Windows(Dataset[torch.Tensor]):
    """Kronos-style: draws its sample from a private generator, ignoring the index."""

    def __init__(self) -> None:
        self.py_rng = random.Random(0)
        self.settings = {"noise": np.random.default_rng(1)}

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(self.py_rng.randint(0, 100))


def test_private_generators_are_named_with_their_path_and_the_fix() -> None:
    with distributed() as ctx, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx.dataloader(ConcatDataset([Numbers(2), Subset(Windows(), [0, 1])]), batch_size=2)
    messages = [str(w.message) for w in caught if w.category is PrivateGeneratorWarning]
    assert len(messages) == 2
    assert messages[0].startswith("ctx.dataloader: dataset.datasets[1].dataset.py_rng is a ")
    assert "random.randint(...) instead of self.rng.randint(...)" in messages[0]
    # Saving it through rank_state= is named too (the attack saw the warning claim it
    # could not be saved while rank_state= restored it exactly).
    assert "rank_state={'rng': dataset.datasets[1].dataset.py_rng}" in messages[0]
    assert "dataset.datasets[1].dataset.settings['noise'] is a private numpy" in messages[1]


def test_the_search_finds_torch_generators_in_collate_functions_and_skips_global_ones() -> None:
    class Collate:
        def __init__(self) -> None:
            self.generator = torch.Generator()
            self.global_random = random  # the module: ddpctx seeds and saves it

        def __call__(self, batch: list[Any]) -> Any:
            return batch

    assert private_generators(Collate(), "collate_fn") == [
        ("collate_fn.generator", "torch.Generator")
    ]
    assert private_generators(Collate().__call__, "collate_fn") == [
        ("collate_fn.__self__.generator", "torch.Generator")
    ]
    assert private_generators(Numbers(3), "dataset") == []


def test_the_search_finds_what_a_lambda_or_nested_function_closes_over() -> None:
    # Before: a collate lambda closing over a random.Random got no warning.
    rng = random.Random(0)
    assert private_generators(lambda batch: rng.shuffle(batch) or batch, "collate_fn") == [
        ("collate_fn.<closure rng>", "random.Random")
    ]

    def augment(x: Any, noise: Any = np.random.default_rng(1)) -> Any:  # noqa: B008 (the case)
        return x

    class Augmented(Numbers):
        transform = None

    dataset = Augmented(3)
    dataset.transform = augment  # type: ignore[assignment]
    assert private_generators(dataset, "dataset") == [
        ("dataset.transform.__defaults__[0]", "numpy.random.Generator")
    ]
    assert private_generators(lambda batch: random.shuffle(batch), "collate_fn") == []
