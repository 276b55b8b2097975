"""Rank 1 never joins the collective; rank 0's timeout must end the wait."""

import sys
import time

from ddpctx import distributed
from tests.helpers import store_sync

with distributed(timeout=float(sys.argv[1])) as ctx:
    store_sync("lined-up", ctx.world_size)  # not a collective: the short timeout is for the next
    if ctx.rank == 1:
        time.sleep(60)
    started = time.monotonic()
    try:
        ctx.barrier()
    finally:
        print(f"RANK0-WAITED {time.monotonic() - started:.1f}", flush=True)
