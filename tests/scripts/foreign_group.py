"""The decorators under a process group that the user formed without ddpctx."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from ddpctx import all_reduced, current, rank_zero_only

dist.init_process_group("gloo")
rank = dist.get_rank()
record = {
    "context": current() is not None,
    "mean": all_reduced(lambda: float(rank))(),
    "broadcast": rank_zero_only(broadcast=True)(lambda: rank + 100)(),
    "plain": rank_zero_only(lambda: "ran")(),
}
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(record))
dist.destroy_process_group()
