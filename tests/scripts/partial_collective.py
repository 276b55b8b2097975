"""A collective that not every rank issues, or that ranks issue with different shapes.

``python partial_collective.py {some-ranks|shapes}`` under torchrun or any env://
launcher: rank 1 finishes its block while rank 0 waits on it.
"""

import sys

import torch
import torch.distributed as dist

from ddpctx import distributed

case = sys.argv[1]
with distributed() as ctx:
    dist.all_reduce(torch.ones(1))  # one matching collective first: counts start equal
    if case == "some-ranks" and ctx.rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 leaves its block instead
    if case == "shapes":
        dist.all_reduce(torch.ones(2 if ctx.rank == 0 else 3))  # rank 0 returns garbage
print(f"rank {ctx.rank} left its block", flush=True)
