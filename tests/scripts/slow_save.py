"""Rank 0 writes a checkpoint whose pickling never ends, so a test can kill it mid-write."""

import sys
import time
from pathlib import Path

import torch

from ddpctx import distributed


class Endless:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        Path(sys.argv[1], "writing").write_text("now")
        time.sleep(600)
        return (Endless, ())


class Blocker:  # extra state whose pickling never ends (meta would refuse it up front)
    def state_dict(self):  # type: ignore[no-untyped-def]
        return {"endless": Endless()}

    def load_state_dict(self, state):  # type: ignore[no-untyped-def]
        pass


with distributed() as ctx:
    model = torch.nn.Linear(4, 1)
    ctx.save_checkpoint(sys.argv[1], model=model, epoch=1)  # a good one first
    ctx.save_checkpoint(sys.argv[1], model=model, epoch=2, extra={"blocker": Blocker()})
