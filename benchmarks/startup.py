"""Under torchrun: forming and destroying the process group, raw vs `with distributed()`.

Run by benchmarks/run.py as: torchrun --standalone --nproc_per_node=N benchmarks/startup.py ROUNDS
Rank 0 prints "MEDIAN raw=<s>" and "MEDIAN ddpctx=<s>". Both do a rendezvous through
torchrun's store each round; the raw path prefixes its keys per round, as ddpctx does, since
torch cannot otherwise form a default group twice on the same store.
"""

import statistics
import sys
import time

import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.rendezvous import rendezvous

from ddpctx import distributed

rounds = int(sys.argv[1])
raw: list[float] = []
ours: list[float] = []
rank = 0
for index in range(rounds):
    started = time.perf_counter()
    store, rank, world_size = next(rendezvous("env://"))
    prefixed = PrefixStore(f"raw/{index}/", store)
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world_size)
    dist.barrier()
    dist.destroy_process_group()
    raw.append(time.perf_counter() - started)
    started = time.perf_counter()
    with distributed() as ctx:
        ctx.barrier()
    ours.append(time.perf_counter() - started)
if rank == 0:
    print(f"MEDIAN raw={statistics.median(raw)}")
    print(f"MEDIAN ddpctx={statistics.median(ours)}")
