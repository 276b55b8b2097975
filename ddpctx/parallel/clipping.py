"""Gradient clipping by the norm of the *whole* model's gradient, for DDP and sharded models.

Under DDP every rank holds the full, already averaged gradient, so the local
norm is the global one. Under FSDP2 each rank holds a shard of each gradient
(a ``DTensor``); torch's ``clip_grad_norm_`` then reduces the shards' norms
across the mesh and returns the total as a ``DTensor``. Either way
:func:`clip_grad_norm` returns the norm the unsharded model would have, as a
float, and scales every gradient (every shard) by the same factor.

This module knows torch and nothing of the context.

Example:
    >>> import torch
    >>> layer = torch.nn.Linear(2, 1, bias=False)
    >>> layer.weight.grad = torch.tensor([[3.0, 4.0]])
    >>> clip_grad_norm(layer, max_norm=1.0)
    5.0
    >>> round(layer.weight.grad.norm().item(), 4)
    1.0
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def clip_grad_norm(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> float:
    """Scale ``model``'s gradients so their total norm is at most ``max_norm``; the norm before."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or max_norm < 0:
        raise ValueError(
            f"max_norm={max_norm!r} must be a non-negative number (the largest total gradient "
            "norm to allow), e.g. max_norm=1.0."
        )
    total = torch.nn.utils.clip_grad_norm_(
        model.parameters(), max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
    )
    if isinstance(total, DTensor):
        total = total.full_tensor()
    return float(total)
