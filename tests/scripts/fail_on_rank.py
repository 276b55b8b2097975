"""Rank 1 raises while rank 0 waits in a collective."""

import time

import torch.distributed as dist

from ddpctx import distributed


def load_batch(rank: int) -> None:
    raise ValueError(f"boom from rank {rank}")


with distributed() as ctx:
    ctx.barrier()
    if ctx.rank == 1:
        time.sleep(0.5)
        load_batch(ctx.rank)
    dist.barrier()  # rank 0 waits here for a peer that is gone
