"""Checkpoints on a read-only file system: ``save DIR`` writes three, ``probe DIR`` reads them.

Run by tests/test_checkpoint_state.py between mounting a tmpfs and remounting it read-only.
"""

import sys

import torch

from ddpctx import distributed

action, folder = sys.argv[1], sys.argv[2]
with distributed() as ctx:
    model = torch.nn.Linear(1, 1)
    if action == "save":
        for epoch in range(3):
            ctx.save_checkpoint(folder, model=model, epoch=epoch, keep=2)
    else:
        print("loaded", ctx.load_checkpoint(folder, model=model))
        try:
            ctx.save_checkpoint(folder, model=model, epoch=3)
        except OSError as error:
            print("refused", error)
