"""What every rank sees under a multi-node (or SLURM / MPI) launch; writes <out>/rank<R>.json."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ddpctx import all_reduced, distributed, rank_zero_first, rank_zero_only
from tests.helpers import listening_addresses

out = Path(sys.argv[1])
with distributed(seed=0) as ctx:
    marker = out / f"node{ctx.node_rank}-local-main-ran"

    @rank_zero_only(local=True, barrier=True)
    def once_per_node() -> None:
        with open(out / f"node{ctx.node_rank}-count", "a") as handle:
            handle.write("x")

    once_per_node()
    with rank_zero_first(local=True):
        first_seen = marker.exists()  # only each node's local rank 0 sees it missing
        if ctx.local_rank == 0:
            marker.write_text("done")
    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total)
    record = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "local_rank": ctx.local_rank,
        "local_world_size": ctx.local_world_size,
        "node_rank": ctx.node_rank,
        "launcher": ctx.launcher,
        "marker_existed": first_seen,
        "sum": total.item(),
        "mean": all_reduced(lambda: float(ctx.rank))(),
        "listening": listening_addresses(os.getpid()),
    }
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(record))
