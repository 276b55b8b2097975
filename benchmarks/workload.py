"""The small training step the step-time benchmarks share: one model, one loss, one reduction.

Contract: :func:`small_model` is the 32 -> 128 -> 1 MLP that sections 2 and 2b
of ``run.py``, ``bench_call.py``, ``bench_doctor.py`` and ``bench_watch.py``
train (batches of 64 of 32 features); :func:`seeded_model` builds it the same
on every rank (seed 0, ``ctx.wrap``: torch's own DDP) with its SGD optimizer;
:func:`train_step` is one step of it and :func:`loss_site` a new
``@all_reduced`` site that reduces a step's loss. Everything here runs inside
``distributed()`` (:func:`active` says so when it does not) and starts no
process or thread of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddpctx import all_reduced, current
from ddpctx.session.distcontext import DistContext

#: Features per sample and samples per batch of the shared model's data.
FEATURES, BATCH = 32, 64


def active() -> DistContext:
    """The active context; a rank function runs inside ``distributed()`` or ``launch()``."""
    ctx = current()
    if ctx is None:
        raise RuntimeError("this benchmark's rank function runs inside distributed() or launch()")
    return ctx


def small_model() -> nn.Sequential:
    """The benchmarks' model: ``Linear(32, 128)``, ``ReLU``, ``Linear(128, 1)``."""
    return nn.Sequential(nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, 1))


def seeded_model(ctx: DistContext) -> tuple[nn.Module, torch.optim.Optimizer]:
    """:func:`small_model` from seed 0 in DDP (``ctx.wrap``), and its SGD (lr 0.01)."""
    torch.manual_seed(0)
    model = ctx.wrap(small_model())
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """Forward, MSE loss, backward and optimizer step on ``(x, y)``; the loss.

    The loss comes back still attached: each caller detaches it on the side of its
    clock that its parts have always counted it on.
    """
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return loss


def loss_site(async_op: bool = False) -> Callable[[torch.Tensor], Any]:
    """A new ``@all_reduced`` site whose function returns the loss it is given (the mean).

    With ``async_op=True`` a call returns the reduction's handle (``.result()``).
    """
    if async_op:

        @all_reduced(async_op=True)
        def step_loss_async(loss: torch.Tensor) -> torch.Tensor:
            return loss

        return step_loss_async

    @all_reduced
    def step_loss(loss: torch.Tensor) -> torch.Tensor:
        return loss

    return step_loss
