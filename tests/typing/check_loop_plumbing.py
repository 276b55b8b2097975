"""Checked by `mypy --strict` in CI (not run): the training-loop faces keep useful types."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from typing_extensions import assert_type

from ddpctx import DistContext


def loop(ctx: DistContext, model: torch.nn.Module, data: Any) -> None:
    loader = ctx.dataloader(data, batch_size=8, device=None)
    accumulation = ctx.accumulate(model, every=2, loader=loader)
    with accumulation as sync:
        assert_type(sync, bool)
    with ctx.rank_zero() as main:
        assert_type(main, bool)
    with ctx.atomic_dir("out") as folder:
        assert_type(folder, Path | None)
    path = ctx.save_checkpoint("ckpt", model=model, step=3, extra={"ema": model}, epoch=1)
    assert_type(path, Path)
    meta = ctx.load_checkpoint("ckpt", model=model, allow_world_size_change=True)
    assert_type(meta, dict[str, Any] | None)
    ctx.save_checkpoint("ckpt", model=model, step="3")  # type: ignore[arg-type]
