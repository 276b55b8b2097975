"""A job that hangs on purpose, to show the hang doctor's report.

The classic mistake: a collective called on rank 0 only. ``evaluate`` is an
``@all_reduced`` function (one all-reduce on every rank that calls it), but it
is called inside ``if ctx.is_main:``, so rank 0 waits in its all-reduce while
the other ranks wait at the barrier after it -- forever, without a watchdog.

    torchrun --standalone --nproc_per_node=2 examples/hang.py

With ``hang_timeout=3`` (or ``DDPCTX_HANG_TIMEOUT``) rank 0 prints the hang
report a few seconds in, and ``on_hang="raise"`` then ends the job with
``HangError`` as torchrun's root cause. The fix is in the comment below.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ddpctx import all_reduced, distributed


@all_reduced(op="mean", weight="count")
def evaluate(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        loss = nn.functional.mse_loss(model(inputs), targets, reduction="sum")
    return {"loss": loss.item() / len(inputs), "count": len(inputs)}


def main() -> None:
    hang_timeout = None if os.environ.get("DDPCTX_HANG_TIMEOUT") else 3.0
    with distributed(seed=0, hang_timeout=hang_timeout, on_hang="raise") as ctx:
        model = ctx.wrap(nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        inputs, targets = torch.randn(64, 8), torch.randn(64, 1)
        for _ in range(3):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
        if ctx.is_main:  # the bug: evaluate() all-reduces, so every rank must call it
            print("validation:", evaluate(model, inputs, targets))
        ctx.barrier()
        # The fix: call it on every rank, print on one.
        #     metrics = evaluate(model, inputs, targets)
        #     ctx.print("validation:", metrics)


if __name__ == "__main__":
    main()
