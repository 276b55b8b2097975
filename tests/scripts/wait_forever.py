"""Every rank waits in a collective that never completes, until the job is signalled."""

import sys
import time
from pathlib import Path

from ddpctx import distributed

with distributed() as ctx:
    Path(sys.argv[1], f"ready{ctx.rank}").write_text("ready")
    if ctx.rank == 0:
        time.sleep(600)  # never joins, so the others wait in the barrier
    ctx.barrier()
