"""``on_hang="raise"`` and a rank that comes back: every rank raises the one real report.

``hang_comes_back.py SECONDS WHEN``: rank 1 holds the GIL in native code (it opens a
FIFO for reading) while the others wait in a barrier; a thread of rank 0 opens the FIFO
for writing once the report is in the job's store (``WHEN=reported``), or once the
incident is open and rank 0 has answered it, before the report (``WHEN=opened``): then
the waits complete and every rank leaves the block while the report is being collected.
Each rank prints ``RAISED <rank> <crc32 of the report> <report ok>`` or ``NOT-RAISED <rank>``.
"""

import os
import shutil
import sys
import threading
import zlib

from ddpctx import HangError, distributed
from ddpctx.hang.report import PREFIX
from tests.helpers import (
    hold_the_gil_until_opened,
    open_for_writing,
    shared_fifo,
    store_sync,
    stored,
)

seconds, when = float(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])


def open_once_reported(fifo: str) -> None:
    stored(f"{PREFIX}1/report" if when == "reported" else f"{PREFIX}1/rank0")
    open_for_writing(fifo)


try:
    with distributed(hang_timeout=seconds, on_hang="raise", timeout=120) as ctx:
        fifo, folder = shared_fifo(rank, ctx.world_size)
        if rank == 0:
            threading.Thread(target=open_once_reported, args=(fifo,), daemon=True).start()
        store_sync("lined-up", ctx.world_size)
        if rank == 1:
            hold_the_gil_until_opened(fifo)  # GIL
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
