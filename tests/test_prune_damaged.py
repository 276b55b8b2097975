"""Pruning never deletes a checkpoint that loads to keep one that does not.

With ``keep=2``, a damaged (corrupt or torn) newest checkpoint used to count
as one of the two kept: the resumed run's next save deleted the good older
checkpoint, the one it had just resumed from, and kept the damaged one.
Real ranks (the plugin's pool, a real gloo group) and real files.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpctx import current, distributed
from tests.helpers import checkpoint_names


def tiny_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def damage(checkpoint: Path, how: str) -> None:
    """Flip a byte (corrupt) or cut a file to half (torn): of the .pt, or of rank 1's shard."""
    target = checkpoint / "__1_0.distcp" if checkpoint.is_dir() else checkpoint
    data = bytearray(target.read_bytes())
    if how == "corrupt":
        data[len(data) // 2] ^= 0x40
    else:
        del data[len(data) // 2 :]
    target.write_bytes(bytes(data))


def save(folder: str, shard: bool, seed: int, step: int) -> str:
    ctx = current()
    assert ctx is not None
    model = tiny_model(seed)
    model = ctx.shard(model, blocks=[nn.Linear]) if shard else ctx.wrap(model)
    return ctx.save_checkpoint(folder, model=model, step=step, keep=2).name


def resume_and_save(folder: str, shard: bool) -> dict[str, Any]:
    """Load the newest checkpoint that loads, then save once more (keep=2)."""
    ctx = current()
    assert ctx is not None
    model = tiny_model(7)
    model = ctx.shard(model, blocks=[nn.Linear]) if shard else ctx.wrap(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        meta = ctx.load_checkpoint(folder, model=model)
    saved = ctx.save_checkpoint(folder, model=model, step=30, keep=2).name
    return {"meta": meta, "saved": saved}


def load_step(folder: str, shard: bool) -> int:
    ctx = current()
    assert ctx is not None
    model = tiny_model(8)
    model = ctx.shard(model, blocks=[nn.Linear]) if shard else ctx.wrap(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        meta = ctx.load_checkpoint(folder, model=model)
    assert meta is not None
    return int(meta["step"])


@pytest.mark.parametrize("how", ["corrupt", "torn"])
@pytest.mark.parametrize("shard", [False, True], ids=["ddp", "sharded"])
def test_a_damaged_newest_checkpoint_never_pushes_the_good_one_out(
    run_distributed: Any, tmp_path: Path, shard: bool, how: str
) -> None:
    folder = str(tmp_path)
    first = run_distributed(save, folder, shard, 0, 10, world_size=2)[0]
    second = run_distributed(save, folder, shard, 1, 20, world_size=2)[0]
    damage(tmp_path / second, how)
    result = run_distributed(resume_and_save, folder, shard, world_size=2)[0]
    assert result["meta"]["step"] == 10  # the damaged newest was skipped
    names = checkpoint_names(tmp_path)
    # keep=2 counts checkpoints that load: the new one and the one resumed from.
    assert first in names, names
    assert result["saved"] in names, names
    # Were the new one damaged too, the run still resumes from a good one.
    damage(tmp_path / result["saved"], how)
    assert run_distributed(load_step, folder, shard, world_size=2)[0] == 10


def test_a_load_past_a_damaged_newest_prunes_by_the_checkpoints_that_load(
    tmp_path: Path,
) -> None:
    # The load prunes too (by the chosen checkpoint's keep): 1 and 2 saved with keep=2, 3 with
    # keep=3 and then damaged. Loading chooses 2; keep=2 must count 2 and 1, never 3.
    with distributed(seed=0) as ctx:
        model = ctx.wrap(tiny_model(0))
        paths = [ctx.save_checkpoint(tmp_path, model=model, step=s, keep=2) for s in (1, 2)]
        paths.append(ctx.save_checkpoint(tmp_path, model=model, step=3, keep=3))
    damage(paths[2], "corrupt")
    with distributed(seed=0) as ctx, pytest.warns(RuntimeWarning, match="damaged"):
        meta = ctx.load_checkpoint(tmp_path, model=ctx.wrap(tiny_model(0)))
    assert meta is not None
    assert meta["step"] == 2
    assert checkpoint_names(tmp_path) == [path.name for path in paths]
