"""Rank 1 is killed (``kill``: SIGKILL) or interrupted (``interrupt``: SIGINT) while it reads
its shards of a sharded load; every other rank writes what it raised to ``<out>/rank<R>.txt``.

Run one process per rank with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set (no launcher: torchrun
would stop the survivors as soon as rank 1 is gone, before they say anything).
"""

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ddpctx
from ddpctx.checkpoint import dcpread

out, how = Path(sys.argv[1]), sys.argv[2]
with ddpctx.distributed(timeout=600) as ctx:
    torch.manual_seed(0)
    model = ctx.shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)), blocks=[nn.Linear])
    ctx.save_checkpoint(out / "run", model=model, step=1)
    if ctx.rank == 1:

        def leave(*_: Any, **__: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGINT)
            time.sleep(5)  # the signal arrives at once

        dcpread.Reader.read_data = leave  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        ctx.load_checkpoint(out / "run", model=model)
    except BaseException as error:
        took = time.monotonic() - started
        said = f"{took:.1f}\n{type(error).__name__}: {error}"
        (out / f"rank{ctx.rank}.txt").write_text(said)
        raise
