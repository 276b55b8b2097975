"""A rank skips backward under ctx.shard: ``hang_fsdp.py CASE SECONDS`` (``SECONDS``: hang_timeout).

Cases: ``backward`` (rank 1 sleeps before ``backward()``; the others wait in FSDP2's
backward collectives), ``forward`` (rank 1 sleeps before the forward pass; the others
wait in its all-gather), ``full_state_dict`` and ``clip`` (rank 1 sleeps before
``ctx.full_state_dict`` / ``ctx.clip_grad_norm_``; the others wait in their DTensor
all-gather / all-reduce, which torch makes through functional collectives). Rank 1
comes back once the hang report is published in the job's store (an event, not a
guessed sleep), so the job ends successfully. Lines the tests look for end in a
``# <NAME>`` marker.
"""

import sys
import threading
import time

import torch
import torch.distributed.fsdp  # imported before the ranks line up (ctx.shard imports it)
from torch import nn
from torch.distributed import distributed_c10d

from ddpctx import distributed
from ddpctx.hang.report import PREFIX
from tests.helpers import store_sync

case, seconds = sys.argv[1], float(sys.argv[2])
GIVE_UP_S = 120


def when_reported() -> tuple[threading.Event, threading.Thread]:
    """Set once the first incident's report is published (see hang_case.py's ``Reported``)."""
    event, store = threading.Event(), distributed_c10d._get_default_store()

    def poll() -> None:
        while not store.check([f"{PREFIX}1/report"]):
            time.sleep(0.05)
        event.set()

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    return event, poller


with distributed(hang_timeout=seconds, timeout=120) as ctx:
    # Lined up over the store, not in a collective: under load a rank may arrive seconds
    # late, and a wait that long in a collective is an incident of its own (hang_timeout).
    store_sync("lined-up", ctx.world_size)
    model = ctx.shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)), blocks=[nn.Linear])
    reported, poller = when_reported()
    store_sync("sharded", ctx.world_size)
    if case == "forward" and ctx.rank == 1:
        reported.wait(GIVE_UP_S)  # SKIP-FORWARD
    loss = model(torch.ones(2, 4)).sum()  # FORWARD
    if case == "backward" and ctx.rank == 1:
        reported.wait(GIVE_UP_S)  # SKIP-BACKWARD
    loss.backward()  # BACKWARD
    if case == "full_state_dict":
        if ctx.rank == 1:
            reported.wait(GIVE_UP_S)  # SKIP-FULL-STATE-DICT
        ctx.full_state_dict(model)  # FULL-STATE-DICT
    if case == "clip":
        if ctx.rank == 1:
            reported.wait(GIVE_UP_S)  # SKIP-CLIP
        ctx.clip_grad_norm_(model, max_norm=1.0)  # CLIP
    poller.join(GIVE_UP_S)  # out of the store before it goes (else SIGABRT at exit)
    ctx.print("JOB-DONE")
