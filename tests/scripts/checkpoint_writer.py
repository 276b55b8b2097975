"""A job that saves into a checkpoint directory, then holds it until told to go on.

argv: folder, kind ("ddp", "shard" or "shard-async"), signals folder. Rank 0 writes
``saved`` (its pid) after the first save; every rank waits for ``release``
(at most 120 s), then saves again. Under torchrun with restarts, the first
attempt's rank 1 SIGKILLs itself after the first save; the restart resumes.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

from ddpctx import distributed

folder, kind, signals = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
with distributed() as ctx:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    model = ctx.shard(model, blocks=[nn.Linear]) if kind != "ddp" else ctx.wrap(model)
    async_save = kind == "shard-async"
    if ctx.restart_count > 0:
        meta = ctx.load_checkpoint(folder, model=model)
        ctx.save_checkpoint(folder, model=model, epoch=meta["epoch"] + 1, restarted=True)
        sys.exit(0)
    ctx.save_checkpoint(folder, model=model, epoch=0, async_save=async_save)
    ctx.finish_checkpoint()
    if ctx.rank == 0:
        (signals / "saved").write_text(str(os.getpid()))
    if os.environ.get("DIE_ON_FIRST_ATTEMPT") and ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not (signals / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    ctx.save_checkpoint(folder, model=model, epoch=1, async_save=async_save)
