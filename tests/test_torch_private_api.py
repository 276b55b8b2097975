"""What ddpctx takes from torch's private API degrades to torch's defaults, never to a crash.

The DDP bucket layout a checkpoint carries is installed through DDP's private reducer API,
and an async save reads DCP's newer answer type. A torch that lacks either (simulated here
on real ranks by removing what an older torch lacks, or by a ``Reducer`` with another
signature) loads with a warning and DDP's default layout, and saves asynchronously all the
same; a layout that cannot be a DDP bucket layout is not installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import state_dict_saver

from ddpctx import DistContext, current
from ddpctx.parallel.buckets import _unsupported, install_bucket_layout

UNSUPPORTED = r"cannot be given the saved DDP gradient-bucket layout"


def context() -> DistContext:
    ctx = current()
    assert ctx is not None
    return ctx


def step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    model(inputs).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def reducer_of_another_torch(params: Any, buckets: Any, limits: Any, group: Any, *rest: Any) -> Any:
    raise AssertionError("called positionally: its arguments could be misread")


def save_then_load(folder: str, how: str) -> list[torch.Tensor]:
    """Two steps and a save; then a fresh model on a torch simulated older loads and steps."""
    ctx = context()
    _unsupported.cache_clear()  # warned once per process: this pool process may have warned
    torch.manual_seed(0)
    model = ctx.wrap(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        step(model, optimizer, ctx.rank)
    ctx.save_checkpoint(folder, model=model, optimizer=optimizer, step=2)
    torch.manual_seed(1)
    fresh = ctx.wrap(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1)
    with pytest.MonkeyPatch.context() as patch:
        if how == "no-batched-grad-copy":  # DDP before torch 2.13
            patch.delattr(fresh, "batched_grad_copy")
        else:  # a Reducer whose arguments are named otherwise
            patch.setattr(dist, "Reducer", reducer_of_another_torch)
        with pytest.warns(RuntimeWarning, match=UNSUPPORTED):
            meta = ctx.load_checkpoint(folder, model=fresh, optimizer=fresh_optimizer)
    assert meta is not None
    assert meta["step"] == 2
    step(fresh, fresh_optimizer, ctx.rank)  # DDP's own reducer still averages the gradients
    return [parameter.detach().clone() for parameter in fresh.parameters()]


@pytest.mark.parametrize("how", ["no-batched-grad-copy", "another-reducer-signature"])
def test_a_ddp_checkpoint_loads_with_a_warning_where_ddps_private_api_differs(
    run_distributed: Any, tmp_path: Path, how: str
) -> None:
    first, second = run_distributed(save_then_load, str(tmp_path), how, world_size=2)
    for mine, theirs in zip(first, second, strict=True):
        assert torch.equal(mine, theirs)  # the step after the load was reduced on both ranks


class Mixed(nn.Module):
    """Parameters 0 (float32), 1 (float64) and 2 (an embedding with sparse gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow = nn.Parameter(torch.ones(3))
        self.wide = nn.Parameter(torch.ones(3, dtype=torch.float64))
        self.table = nn.Embedding(5, 3, sparse=True)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        looked_up: torch.Tensor = self.table(index)
        return looked_up.sum() * self.narrow.sum() + self.wide.sum().float()


@pytest.mark.distributed(world_size=2, timeout=120)
@pytest.mark.parametrize(
    ("layout", "why"),
    [
        ([[0, 1], [2]], r"bucket \[0, 1\] mixes .*float32.*float64"),
        ([[0, 2], [1]], "sparse-gradient parameter 2"),
    ],
    ids=["mixed-dtypes", "sparse-with-others"],
)
def test_a_layout_no_ddp_bucket_can_have_is_not_installed(
    dist_ctx: DistContext, layout: list[list[int]], why: str
) -> None:
    model = dist_ctx.wrap(Mixed())
    with pytest.warns(RuntimeWarning, match=f"does not fit this model.*{why}"):
        assert install_bucket_layout(model, layout) is False
    model(torch.tensor([dist_ctx.rank])).backward()  # DDP's own reducer is intact
    assert model.module.narrow.grad is not None
    assert torch.equal(model.module.wide.grad, torch.full((3,), 1.0, dtype=torch.float64))


def async_save_on_older_torch(folder: str, missing: str) -> str:
    ctx = context()
    torch.manual_seed(0)
    model = ctx.shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)), blocks=[nn.Linear])
    with pytest.MonkeyPatch.context() as patch:
        patch.delattr(state_dict_saver, missing)
        try:
            ctx.save_checkpoint(folder, model=model, async_save=True, step=1)
        except RuntimeError as error:
            return str(error)
        published = ctx.finish_checkpoint()
    assert published is not None
    return published.name


@pytest.mark.parametrize("missing", ["AsyncSaveResponse", "async_save"])
def test_an_async_save_needs_only_async_save_from_torch(
    run_distributed: Any, tmp_path: Path, missing: str
) -> None:
    said = run_distributed(async_save_on_older_torch, str(tmp_path), missing, world_size=2)
    if missing == "AsyncSaveResponse":  # a torch whose async_save answers a Future
        assert said == ["checkpoint-000001-step1.dcp"] * 2
    else:
        for text in said:
            assert "save_checkpoint(async_save=True) needs" in text, text
            assert "async_save=False" in text, text
