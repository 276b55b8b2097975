"""``on_hang="raise"`` and a rank that comes back: every rank raises the one real report.

``hang_comes_back.py SECONDS WHEN``: rank 1 holds the GIL in native code (it opens a
FIFO for reading) while the others wait in a barrier; a thread of rank 0 opens the FIFO
for writing once the report is in the job's store (``WHEN=reported``), or once the
incident is open and rank 0 has answered it, before the report (``WHEN=opened``): then
the waits complete and every rank leaves the block while the report is being collected.
Each rank prints ``RAISED <rank> <crc32 of the report> <report ok>`` or ``NOT-RAISED <rank>``.
"""

import ctypes
import os
import shutil
import sys
import tempfile
import threading
import time
import zlib

import torch.distributed as dist
from torch.distributed import distributed_c10d

from ddpctx import HangError, distributed
from ddpctx.hang.report import PREFIX
from tests.helpers import store_sync

seconds, when = float(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])


def open_once_reported(fifo: str) -> None:
    store = distributed_c10d._get_default_store()
    give_up = time.monotonic() + 120
    key = f"{PREFIX}1/report" if when == "reported" else f"{PREFIX}1/rank0"
    while not store.check([key]) and time.monotonic() < give_up:
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
    ok = report.startswith("ddpctx hang report:") and "no rank sent a report" not in report
    if when == "reported":  # rank 1 stayed silent until the report was made
        ok = ok and "rank 1: not answering" in report
    print(f"RAISED {rank} {zlib.crc32(report.encode())} {ok}", flush=True)
    if not ok:
        print(report, file=sys.stderr, flush=True)
