"""Sharded training: ctx.shard (FSDP2), sharded checkpoints, clipping, precision, on real ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

from ddpctx import DistContext


def tiny_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 3)
    )


@pytest.mark.distributed(world_size=2, timeout=90)
def test_an_fsdp1_model_is_refused_at_save_and_nothing_is_written(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    model = FullyShardedDataParallel(tiny_model(), device_id=torch.device("cpu"))
    with pytest.raises(TypeError, match=r"FullyShardedDataParallel \(FSDP1\).*ctx\.shard"):
        dist_ctx.save_checkpoint(tmp_path, model=model, epoch=0)
    dist_ctx.barrier()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.distributed(world_size=2, timeout=90)
def test_a_user_sharded_model_is_never_saved_as_one_ranks_shard(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    model = tiny_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    with pytest.raises(TypeError, match=r"sharded model \(FSDP2"):
        dist_ctx.save_checkpoint(tmp_path, model=model, epoch=0)
    dist_ctx.barrier()
    assert list(tmp_path.iterdir()) == []
