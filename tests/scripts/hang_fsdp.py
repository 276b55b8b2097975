"""A rank skips backward under ctx.shard: ``hang_fsdp.py CASE SECONDS`` (``SECONDS``: hang_timeout).

Cases: ``backward`` (rank 1 sleeps before ``backward()``; the others wait in FSDP2's
backward collectives) and ``forward`` (rank 1 sleeps before the forward pass; the others
wait in its all-gather). Rank 1 comes back after ``4 * SECONDS + 4`` s, so the job ends
successfully. Lines the tests look for end in a ``# <NAME>`` marker.
"""

import sys
import time

import torch
from torch import nn

from ddpctx import distributed

case, seconds = sys.argv[1], float(sys.argv[2])
late = 4 * seconds + 4

with distributed(hang_timeout=seconds, timeout=120) as ctx:
    model = ctx.shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)), blocks=[nn.Linear])
    ctx.barrier()
    if case == "forward" and ctx.rank == 1:
        time.sleep(late)  # SKIP-FORWARD
    loss = model(torch.ones(2, 4)).sum()  # FORWARD
    if case == "backward" and ctx.rank == 1:
        time.sleep(late)  # SKIP-BACKWARD
    loss.backward()  # BACKWARD
    ctx.print("JOB-DONE")
