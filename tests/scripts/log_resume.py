"""Log ``step + rank`` every step, checkpoint every 10; rank 1 is SIGKILLed on the first attempt.

Run as ``torchrun --max-restarts=1 log_resume.py LOG_DIR CHECKPOINT_DIR STEPS``. The
killed attempt logs a few steps past its last checkpoint (and its rank 0 flushes them
when torchrun stops it); the restart loads the checkpoint and logs on from there.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from ddpctx import distributed

log_dir, checkpoints, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
loggers = tuple(os.environ.get("LOGGERS", "jsonl,csv,tensorboard").split(","))

with distributed(seed=0, log_dir=log_dir, loggers=loggers) as ctx:
    model = ctx.wrap(torch.nn.Linear(2, 1))
    ctx.log_config({"steps": steps, "lr": 0.1})
    meta = ctx.load_checkpoint(checkpoints, model=model)
    start = 0 if meta is None else meta["step"] + 1
    for step in range(start, steps):
        ctx.log({"value": step + ctx.rank})  # step=None: the one after the last logged
        if step % 10 == 9:
            ctx.save_checkpoint(checkpoints, model=model, step=step)
        if ctx.restart_count == 0 and step == steps - 6 and ctx.rank == 1:
            time.sleep(1.0)  # rank 0's writer has the points after the checkpoint by now
            os.kill(os.getpid(), signal.SIGKILL)
