"""Enter and leave ``distributed()`` with the hang doctor on, ``sys.argv[1]`` times.

Prints ``CYCLES threads=<before>,<after> fds=<before>,<after>`` per rank (the
first cycle is a warm-up: torch opens its own files and threads once). The
last group's connections are closed by torch's reaper threads, in their own
time: on a loaded machine the count is read again, for at most 10 s, until
it is back (a leak of one thread or fd per cycle never is).
"""

import os
import sys
import threading
import time

from ddpctx import distributed


def counts() -> tuple[int, int]:
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


cycles = int(sys.argv[1])
for cycle in range(cycles):
    if cycle == 1:
        before = counts()
    with distributed(hang_timeout=30) as ctx:
        ctx.barrier()
after, deadline = counts(), time.monotonic() + 10
while after != before and time.monotonic() < deadline:
    time.sleep(0.2)
    after = counts()
print(f"CYCLES threads={before[0]},{after[0]} fds={before[1]},{after[1]}", flush=True)
