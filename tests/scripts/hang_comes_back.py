"""``on_hang="raise"`` and a rank that comes back: every rank raises the one real report.

``hang_comes_back.py SECONDS``: rank 1 holds the GIL in native code (it opens a FIFO
for reading) while rank 0 waits in a barrier; rank 0 reports, and a thread of rank 0
opens the FIFO for writing once the report is in the job's store, so rank 1 comes back
at once and the barrier completes. Each rank prints ``RAISED <rank> <report ok>`` or
``NOT-RAISED <rank>``.
"""

import ctypes
import os
import shutil
import sys
import tempfile
import threading
import time

import torch.distributed as dist
from torch.distributed import distributed_c10d

from ddpctx import HangError, distributed
from ddpctx.hang.report import PREFIX
from tests.helpers import store_sync

seconds = float(sys.argv[1])
rank = int(os.environ["RANK"])


def open_once_reported(fifo: str) -> None:
    store = distributed_c10d._get_default_store()
    give_up = time.monotonic() + 120
    while not store.check([f"{PREFIX}1/report"]) and time.monotonic() < give_up:
        time.sleep(0.05)
    os.close(os.open(fifo, os.O_WRONLY))


try:
    with distributed(hang_timeout=seconds, on_hang="raise", timeout=120) as ctx:
        folder = tempfile.mkdtemp() if rank == 0 else ""
        fifo = os.path.join(folder, "resume")
        if rank == 0:
            os.mkfifo(fifo)
            threading.Thread(target=open_once_reported, args=(fifo,), daemon=True).start()
        fifos: list[object] = [None] * ctx.world_size
        dist.all_gather_object(fifos, fifo)
        store_sync("lined-up", ctx.world_size)
        if rank == 1:
            os.close(ctypes.PyDLL(None).open(str(fifos[0]).encode(), os.O_RDONLY))  # GIL
        ctx.barrier()  # BARRIER
        if rank == 0:
            shutil.rmtree(folder)
    print(f"NOT-RAISED {rank}", flush=True)
except HangError as error:
    report = str(error)
    ok = "rank 1: not answering" in report and "no rank sent a report" not in report
    print(f"RAISED {rank} {ok}", flush=True)
    if not ok:
        print(report, file=sys.stderr, flush=True)
