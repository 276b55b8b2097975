"""A rank to be sent SIGTERM while it is blocked.

argv: folder mode
- ``collective`` (torchrun, 2 ranks): rank 0 waits in a barrier that rank 1
  never joins; rank 0 writes ``ready0`` with its pid just before.
- ``loader`` (one process): iterates a slow DataLoader with 2 workers; writes
  ``ready0`` after the first batch and ``left`` with the time it left the block.
"""

import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ddpctx import distributed

folder, mode = Path(sys.argv[1]), sys.argv[2]


class Slow(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.5)
        return torch.zeros(1)


try:
    with distributed(timeout=300) as ctx:
        if mode == "collective":
            if ctx.rank == 1:
                time.sleep(600)
            (folder / "ready0").write_text(str(os.getpid()))
            ctx.barrier()
        else:
            for _ in ctx.dataloader(Slow(), batch_size=1, num_workers=2):
                (folder / "ready0").write_text(str(os.getpid()))
finally:
    (folder / "left").write_text(repr(time.time()))
