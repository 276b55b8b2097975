"""Form, use and destroy the process group several times in one torchrun job."""

import torch
import torch.distributed as dist

from ddpctx import distributed

for attempt in range(4):
    with distributed() as ctx:
        value = torch.tensor([float(ctx.rank + attempt)])
        dist.all_reduce(value)
        ctx.print(f"formation {attempt}: sum {value.item()}")
