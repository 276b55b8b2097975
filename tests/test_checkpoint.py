"""ctx.save / ctx.load and training checkpoints, on real ranks where it matters."""

from __future__ import annotations

import os
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ddpctx import DistContext, RankZeroError, distributed
from ddpctx.checkpoint import atomic_save, training_state

RANKS = pytest.mark.distributed(world_size=[2, 3], timeout=60)


@RANKS
def test_save_writes_once_and_every_rank_loads_it(dist_ctx: DistContext, tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    dist_ctx.save({"weights": torch.arange(4.0), "step": 7}, path)
    assert path.exists()  # every rank waited for rank 0's write
    loaded = dist_ctx.load(path)
    assert loaded["step"] == 7
    assert loaded["weights"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert loaded["weights"].device == dist_ctx.device
    assert list(tmp_path.glob(".*.tmp")) == []  # no temporary file left


@RANKS
def test_a_failed_write_raises_on_every_rank(dist_ctx: DistContext, tmp_path: Path) -> None:
    target = tmp_path / "missing-directory" / "state.pt"
    if dist_ctx.rank == 0:
        with pytest.raises(FileNotFoundError, match=r"does not exist\. Create it first"):
            dist_ctx.save({"x": 1}, target)
    else:
        with pytest.raises(RankZeroError, match=r"rank 0 raised FileNotFoundError"):
            dist_ctx.save({"x": 1}, target)


def test_a_temporary_file_left_by_a_killed_writer_is_removed_by_the_next_save(
    tmp_path: Path,
) -> None:
    stale = tmp_path / ".state.pt.4242.deadbeef.tmp"
    stale.write_bytes(b"half a checkpoint")
    atomic_save({"x": torch.ones(1)}, tmp_path / "state.pt")
    assert not stale.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def test_saved_files_follow_the_process_umask(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        atomic_save({"x": 1}, tmp_path / "state.pt")
    finally:
        os.umask(previous)
    assert (tmp_path / "state.pt").stat().st_mode & 0o777 == 0o640


def test_load_refuses_pickled_code_unless_asked(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"run": os.system}, path)
    with distributed() as ctx:
        with pytest.raises(RuntimeError, match=r"weights_only=True refuses to run"):
            ctx.load(path)
        assert ctx.load(path, weights_only=False)["run"] is os.system


def test_load_names_a_missing_file(tmp_path: Path) -> None:
    with (
        distributed() as ctx,
        pytest.raises(FileNotFoundError, match=r"nothing\.pt' does not exist"),
    ):
        ctx.load(tmp_path / "nothing.pt")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(x)
        return out


def train_steps(ctx: DistContext, model: nn.Module, optimizer: Any, scheduler: Any, n: int) -> None:
    for _ in range(n):
        inputs = torch.randn(16, 4)  # global RNG: must continue exactly after a resume
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def fresh(ctx: DistContext) -> tuple[nn.Module, Any, Any]:
    model = ctx.wrap(Net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    return model, optimizer, scheduler


def snapshot(model: nn.Module) -> tuple[list[list[float]], float, float, float]:
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    return params, random.random(), float(np.random.rand()), torch.rand(1).item()


@RANKS
def test_a_resumed_run_continues_exactly_like_an_uninterrupted_one(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    model, optimizer, scheduler = fresh(dist_ctx)
    train_steps(dist_ctx, model, optimizer, scheduler, 3)
    path = dist_ctx.save_checkpoint(
        tmp_path, model=model, optimizer=optimizer, scheduler=scheduler, epoch=3
    )
    assert path.name == "checkpoint-000001.pt"
    train_steps(dist_ctx, model, optimizer, scheduler, 3)
    uninterrupted = snapshot(model)

    torch.manual_seed(12345 + dist_ctx.rank)  # a restarted process starts elsewhere
    random.seed(999)
    model, optimizer, scheduler = fresh(dist_ctx)
    meta = dist_ctx.load_checkpoint(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert meta == {"epoch": 3}
    train_steps(dist_ctx, model, optimizer, scheduler, 3)
    assert snapshot(model) == uninterrupted
    assert scheduler.last_epoch == 6


@RANKS
def test_only_the_newest_checkpoints_are_kept(dist_ctx: DistContext, tmp_path: Path) -> None:
    model = dist_ctx.wrap(Net())
    for epoch in range(4):
        dist_ctx.save_checkpoint(tmp_path, model=model, keep=2, epoch=epoch)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["checkpoint-000003.pt", "checkpoint-000004.pt"]
    assert dist_ctx.load_checkpoint(tmp_path, model=model) == {"epoch": 3}


@RANKS
def test_a_torn_newest_checkpoint_is_skipped_with_a_warning(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    model = dist_ctx.wrap(Net())
    dist_ctx.save_checkpoint(tmp_path, model=model, epoch=1)
    if dist_ctx.rank == 0:
        (tmp_path / "checkpoint-000002.pt").write_bytes(b"PK\x03\x04 torn")
    dist_ctx.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = dist_ctx.load_checkpoint(tmp_path, model=model)
    assert meta == {"epoch": 1}
    if dist_ctx.rank == 0:  # rank 0 chooses; it is the one that warns
        assert any("checkpoint-000002.pt" in str(w.message) for w in caught)


def test_no_checkpoint_means_none(tmp_path: Path) -> None:
    with distributed() as ctx:
        assert ctx.load_checkpoint(tmp_path / "never-written", model=Net()) is None


def test_a_checkpoint_from_another_world_size_is_refused(tmp_path: Path) -> None:
    model = Net()
    atomic_save(
        training_state(model, None, None, {"epoch": 1}, 2, [{}, {}]),
        tmp_path / "checkpoint-000001.pt",
    )
    with (
        distributed() as ctx,
        pytest.raises(ValueError, match=r"world size 2, and this run has world size 1"),
    ):
        ctx.load_checkpoint(tmp_path, model=model)


@pytest.mark.parametrize("keep", [0, -1, 1.5])
def test_keep_must_be_positive(tmp_path: Path, keep: object) -> None:
    with distributed() as ctx, pytest.raises(ValueError, match=r"keep=.* must be a positive int"):
        ctx.save_checkpoint(tmp_path, model=Net(), keep=keep)  # type: ignore[arg-type]
