"""A rank misbehaves on purpose for the hang doctor: ``hang_case.py CASE SECONDS [ON_HANG]``.

Cases (``SECONDS`` is ``hang_timeout``; a late rank comes back after ``4 * SECONDS + 4`` s,
so ``on_hang="report"`` jobs end successfully):

- ``sleep``: rank 1 sleeps outside any collective; the others wait in ``ctx.barrier()``.
- ``diverge``: rank 0 waits in ``ctx.barrier()``, rank 1 in an ``@all_reduced`` function.
- ``raw``: rank 1 waits in a raw ``torch.distributed.all_reduce``; rank 0 sleeps.
- ``ddp``: rank 1 skips ``backward()`` for a while; the others wait in DDP's backward.
- ``slow_save``: rank 0's checkpoint write takes longer than ``hang_timeout``.
- ``p2p`` (3 ranks): rank 1 waits in ``recv`` from rank 0, which sleeps; rank 2 sleeps
  too, outside the pair.
- ``gil``: rank 0 holds the GIL in native code (its watchdog cannot run) for
  ``8 * SECONDS + 4`` s; rank 1 waits in a barrier.
- ``stopped``: rank 0 stops itself with SIGSTOP; rank 1 waits in a barrier and sends
  it SIGCONT after ``8 * SECONDS + 4`` s.

Lines the tests look for end in a ``# <NAME>`` marker.
"""

import ctypes
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from ddpctx import all_reduced, distributed, rank_zero_only

case, seconds = sys.argv[1], float(sys.argv[2])
on_hang = sys.argv[3] if len(sys.argv) > 3 else "report"
late = 4 * seconds + 4


@all_reduced
def evaluate() -> float:
    return 1.0


@rank_zero_only(barrier=True)
def write_checkpoint() -> None:
    time.sleep(late)  # SLOW-WRITE


with distributed(hang_timeout=seconds, on_hang=on_hang, timeout=120) as ctx:
    ctx.barrier()
    if case == "sleep":
        if ctx.rank == 1:
            time.sleep(late)  # SLEEP
        ctx.barrier()  # BARRIER
    elif case == "diverge":
        if ctx.rank == 1:
            evaluate()  # EVALUATE
        else:
            ctx.barrier()  # DIVERGE-BARRIER
    elif case == "raw":
        if ctx.rank == 0:
            time.sleep(late)  # RAW-SLEEP
        dist.all_reduce(torch.ones(1))  # RAW
    elif case == "ddp":
        model = ctx.wrap(torch.nn.Linear(4, 1))
        loss = model(torch.ones(2, 4)).sum()
        if ctx.rank == 1:
            time.sleep(late)  # SKIP
        loss.backward()  # BACKWARD
    elif case == "slow_save":
        write_checkpoint()  # SAVE
    elif case == "p2p":
        data = torch.zeros(2)
        if ctx.rank == 0:
            time.sleep(late)  # P2P-SLEEP
            dist.send(data, dst=1)
        elif ctx.rank == 1:
            dist.recv(data, src=0)  # RECV
        else:
            time.sleep(late)  # BYSTANDER
        dist.barrier()
    elif case == "gil":
        if ctx.rank == 0:
            ctypes.PyDLL(None).sleep(int(8 * seconds + 4))  # GIL
        dist.barrier()  # GIL-BARRIER
    elif case == "stopped":
        pids: list[object] = [None] * ctx.world_size
        dist.all_gather_object(pids, os.getpid())
        if ctx.rank == 0:
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            resume = threading.Timer(8 * seconds + 4, os.kill, (pids[0], signal.SIGCONT))
            resume.start()
        dist.barrier()  # STOPPED-BARRIER
    ctx.print("JOB-DONE")
