"""Each rank writes <out>/rank<N>.json describing what distributed() gave it."""

import json
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ddpctx import distributed, reduce_tensor

with distributed(seed=42) as ctx:
    value = torch.tensor([float(ctx.rank + 1)])
    total = value.clone()
    dist.all_reduce(total)
    mean = reduce_tensor(value)
    record = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "local_rank": ctx.local_rank,
        "local_world_size": ctx.local_world_size,
        "node_rank": ctx.node_rank,
        "launcher": ctx.launcher,
        "backend": ctx.backend,
        "device": str(ctx.device),
        "seed": ctx.seed,
        "draw": random.random(),
        "sum": total.item(),
        "mean": mean.item(),
        "input_after_reduce": value.item(),
    }
    Path(sys.argv[1], f"rank{ctx.rank}.json").write_text(json.dumps(record))
    ctx.barrier()
    ctx.print("PRINTED-BY-MAIN-ONLY")
print(f"GROUP-ALIVE-AFTER-EXIT {dist.is_initialized()}", flush=True)
