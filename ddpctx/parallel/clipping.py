"""Gradient clipping by the norm of the *whole* model's gradient, for DDP and sharded models.

Under DDP every rank holds the full, already averaged gradient, so the local
norm is the global one. Under FSDP2 each rank holds a shard of each gradient
(a ``DTensor``); torch's ``clip_grad_norm_`` then reduces the shards' norms
across the mesh and returns the total as a ``DTensor``. Either way
:func:`clip_grad_norm` returns the norm the unsharded model would have, as a
float, and scales every gradient (every shard) by the same factor.

Under tensor parallel (:mod:`ddpctx.parallel.tensorparallel`) the gradients
live on two meshes -- the planned layers' on ``("dp", "tp")``, the others' on
``"dp"`` -- and torch's ``clip_grad_norm_`` refuses to stack norms from
different meshes. Then each mesh's gradients give their own total norm (a
``DTensor``, made whole), and the totals combine as the norms of disjoint
parts do: ``(sum of norm ** p) ** (1 / p)``.

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

import math

import torch
import torch.distributed as dist
from torch import nn

from ddpctx.parallel.sharding import dtensor_type


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
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    dtensor = dtensor_type()  # the class, or () while none can exist
    if math.isinf(norm_type) and norm_type > 0 and any(isinstance(g, dtensor) for g in grads):
        return _clip_by_largest(grads, float(max_norm), error_if_nonfinite)
    if len({id(g.device_mesh) for g in grads if isinstance(g, dtensor)}) > 1:
        return _clip_across_meshes(grads, float(max_norm), float(norm_type), error_if_nonfinite)
    total = torch.nn.utils.clip_grad_norm_(
        model.parameters(), max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
    )
    if isinstance(total, dtensor):
        total = total.full_tensor()
    return float(total)


def _clip_across_meshes(
    grads: list[torch.Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> float:
    """The ``norm_type`` norm of gradients on several meshes: each mesh's part, then combined."""
    from torch.nn.utils import get_total_norm

    dtensor = dtensor_type()
    parts: dict[int, list[torch.Tensor]] = {}
    for grad in grads:  # a plain tensor (no mesh) is whole on every rank: a part of its own
        parts.setdefault(id(grad.device_mesh) if isinstance(grad, dtensor) else 0, []).append(grad)
    total = 0.0
    for part in parts.values():
        norm = get_total_norm(part, norm_type, error_if_nonfinite=False)
        whole = norm.full_tensor() if isinstance(norm, dtensor) else norm
        total += float(whole.double()) ** norm_type
    total = float(total ** (1.0 / norm_type))
    local = [grad.to_local() if isinstance(grad, dtensor) else grad for grad in grads]
    return _scaled(local, total, max_norm, norm_type, error_if_nonfinite)


def _clip_by_largest(grads: list[torch.Tensor], max_norm: float, error_if_nonfinite: bool) -> float:
    """The infinity norm of sharded gradients, where a rank's shard may be empty.

    torch's own computation takes the largest element of every local shard,
    and a shard with no elements (a 1-row layer split over 2 ranks) has none:
    it raises. Here an empty shard counts as 0, and the largest element is
    agreed over every dimension of each gradient's mesh (a maximum taken
    twice is the same maximum, so replicated dimensions do no harm).
    """
    dtensor = dtensor_type()
    local = [g.to_local() if isinstance(g, dtensor) else g for g in grads]
    peak = torch.zeros((), dtype=torch.float32, device=local[0].device)
    for tensor in local:
        if tensor.numel():
            peak = torch.maximum(peak, tensor.detach().abs().max().to(peak.dtype))
    meshes = {id(g.device_mesh): g.device_mesh for g in grads if isinstance(g, dtensor)}
    for mesh in meshes.values():
        for dim in range(mesh.ndim):
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return _scaled(local, float(peak), max_norm, math.inf, error_if_nonfinite)


def _scaled(
    local: list[torch.Tensor],
    total: float,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
) -> float:
    """Scale the local gradients by ``max_norm / total`` where that is below 1; ``total``.

    A non-finite ``total`` is refused when ``error_if_nonfinite``, as torch's own does.
    """
    if error_if_nonfinite and not math.isfinite(total):
        order = "inf" if norm_type == math.inf else f"{norm_type:g}"
        raise RuntimeError(
            f"The total norm of order {order} of the gradients is {total}, so they cannot "
            "be clipped. Pass error_if_nonfinite=False to clip anyway, or find the inf/NaN "
            "gradient (e.g. torch.autograd.set_detect_anomaly(True))."
        )
    scale = min(1.0, max_norm / (total + 1e-6))
    if scale < 1.0:
        with torch.no_grad():
            for tensor in local:
                tensor.mul_(scale)
    return total
