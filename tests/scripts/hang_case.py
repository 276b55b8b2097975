"""Ranks misbehave on purpose for the hang doctor: ``hang_case.py CASES SECONDS [ON_HANG]``.

``CASES`` is one case or several, comma-separated (``sleep,raw,ddp``): one job runs them in
turn, each its own incident (the n-th case's report is incident n's), so several cases pay
for one job's start. Cases (``SECONDS`` is ``hang_timeout``). A late rank comes back once
its case's hang report is published in the job's store -- an event it can observe, so the
job is neither slower than it needs to be on an idle machine nor too quick for the report
on a busy one -- so ``on_hang="report"`` jobs end successfully (a report that never comes
fails the job after ``GIVE_UP``):

- ``sleep``: rank 1 sleeps outside any collective; the others wait in ``ctx.barrier()``.
- ``diverge``: rank 0 waits in ``ctx.barrier()``, rank 1 in an ``@all_reduced`` function.
- ``raw``: rank 1 waits in a raw ``torch.distributed.all_reduce``; rank 0 sleeps.
- ``ddp``: rank 1 skips ``backward()`` for a while; the others wait in DDP's backward.
- ``slow_save``: rank 0's checkpoint write takes longer than ``hang_timeout``.
- ``p2p`` (3 ranks): rank 1 waits in ``recv`` from rank 0, which sleeps; rank 2 sleeps
  too, outside the pair.
- ``gil``: rank 0 holds the GIL in native code (its watchdog cannot run): it opens a FIFO
  for reading, which blocks until rank 1, waiting in a barrier, has seen the report
  (published by rank 1 as the stand-in) and opens the FIFO for writing.
- ``stopped``: rank 0 stops itself with SIGSTOP; rank 1 waits in a barrier and sends
  it SIGCONT once it has seen the report.

Lines the tests look for end in a ``# <NAME>`` marker.
"""

import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable

import torch
import torch._dynamo  # DDP's constructor imports it: before the ranks line up, not in a case
import torch.distributed as dist

from ddpctx import all_reduced, current, distributed, rank_zero_only
from ddpctx.hang.report import PREFIX
from tests.helpers import (
    hold_the_gil_until_opened,
    open_for_writing,
    shared_fifo,
    store_sync,
    stored,
)

cases, seconds = sys.argv[1], float(sys.argv[2])
on_hang = sys.argv[3] if len(sys.argv) > 3 else "report"
GIVE_UP_S = 120


class Reported(threading.Event):
    """Set once incident ``incident``'s report is published (by rank 0 or a stand-in).

    A thread polls the store: a wait on the store itself would hold its one connection,
    and this rank's watchdog could not answer. Under ``on_hang="raise"`` it is never set
    (the hang doctor ends the job). ``reported.wait()`` is a call into the standard
    library, so a report names the marked line that calls it. :meth:`close` before the
    store goes: a thread inside a store call when the process exits aborts it (SIGABRT).
    """

    def __init__(self, incident: int) -> None:
        super().__init__()
        self.incident = incident
        self.poller = threading.Thread(target=self._poll, daemon=True)
        if on_hang == "report":
            self.poller.start()

    def _poll(self) -> None:
        if stored(f"{PREFIX}{self.incident}/report", GIVE_UP_S):
            self.set()

    def close(self) -> None:
        if self.poller.is_alive():
            self.poller.join(GIVE_UP_S)


@all_reduced
def evaluate() -> float:
    return 1.0


@rank_zero_only(barrier=True)
def write_checkpoint() -> None:
    reported.wait(GIVE_UP_S)  # SLOW-WRITE


def once_reported(action: Callable[[], object]) -> None:
    """Run ``action`` in a thread once this case's report is out (or after ``GIVE_UP_S``)."""

    event = reported

    def wait_then_act() -> None:
        event.wait(GIVE_UP_S)
        action()

    threading.Thread(target=wait_then_act, daemon=True).start()


def run_case(case: str) -> None:
    ctx = current()
    assert ctx is not None
    if case == "sleep":
        if ctx.rank == 1:
            reported.wait(GIVE_UP_S)  # SLEEP
        ctx.barrier()  # BARRIER
    elif case == "diverge":
        if ctx.rank == 1:
            evaluate()  # EVALUATE
        else:
            ctx.barrier()  # DIVERGE-BARRIER
    elif case == "raw":
        if ctx.rank == 0:
            reported.wait(GIVE_UP_S)  # RAW-SLEEP
        dist.all_reduce(torch.ones(1))  # RAW
    elif case == "ddp":
        model = ctx.wrap(torch.nn.Linear(4, 1))
        loss = model(torch.ones(2, 4)).sum()
        if ctx.rank == 1:
            reported.wait(GIVE_UP_S)  # SKIP
        loss.backward()  # BACKWARD
    elif case == "slow_save":
        write_checkpoint()  # SAVE
    elif case == "p2p":
        data = torch.zeros(2)
        if ctx.rank == 0:
            reported.wait(GIVE_UP_S)  # P2P-SLEEP
            dist.send(data, dst=1)
        elif ctx.rank == 1:
            dist.recv(data, src=0)  # RECV
        else:
            reported.wait(GIVE_UP_S)  # BYSTANDER
        dist.barrier()
    elif case == "gil":
        fifo, folder = shared_fifo(ctx.rank, ctx.world_size)
        if ctx.rank == 0:
            hold_the_gil_until_opened(fifo)  # GIL
            shutil.rmtree(folder)
        else:
            once_reported(lambda: open_for_writing(fifo))
        dist.barrier()  # GIL-BARRIER
    elif case == "stopped":
        pids: list[object] = [None] * ctx.world_size
        dist.all_gather_object(pids, os.getpid())
        if ctx.rank == 0:
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            once_reported(lambda: os.kill(int(str(pids[0])), signal.SIGCONT))
        dist.barrier()  # STOPPED-BARRIER


with distributed(hang_timeout=seconds, on_hang=on_hang, timeout=120) as ctx:
    for incident, case in enumerate(cases.split(","), 1):
        reported = Reported(incident)
        # Lined up over the store, not in a collective: under load a rank may arrive
        # seconds late, and a wait that long in a collective is an incident of its own.
        store_sync(f"case{incident}", ctx.world_size)
        run_case(case)
        reported.close()
    ctx.print("JOB-DONE")
