"""Enter and leave ``distributed()`` with the hang doctor on, ``sys.argv[1]`` times.

Prints ``CYCLES threads=<before>,<after> fds=<before>,<after>`` per rank (the
first cycle is a warm-up: torch opens its own files and threads once).
"""

import os
import sys
import threading

from ddpctx import distributed


def counts() -> tuple[int, int]:
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


cycles = int(sys.argv[1])
for cycle in range(cycles):
    if cycle == 1:
        before = counts()
    with distributed(hang_timeout=30) as ctx:
        ctx.barrier()
after = counts()
print(f"CYCLES threads={before[0]},{after[0]} fds={before[1]},{after[1]}", flush=True)
