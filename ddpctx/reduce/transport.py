"""How a wire's buffer crosses the ranks: torch's ``all_reduce``, or one ``all_gather``.

gloo's ``all_reduce`` latency grows with the element count in steps, where
its ``all_gather`` barely moves (torch 2.13 CPU, loopback, 2 ranks, float64,
median of 7 rounds of 200 calls each):

======================  =====  =====  ==========  ==========  ========
elements                1      2      3 - 256     512 - 8192  131,072
``all_reduce``          0.34   0.49   1.0 - 1.5   1.2 - 1.6   2.2 ms
``all_gather`` + sum    0.58   0.51   0.57 - 0.7  0.45 - 0.74 2.4 ms
======================  =====  =====  ==========  ==========  ========

So at 2 ranks a buffer of :data:`GATHER_FROM` elements or more, up to
:data:`GATHER_MAX_BYTES`, on a gloo group, is gathered and reduced here:
every rank adds the same two rows (or takes their max, min, product), and
``a + b == b + a`` exactly in IEEE arithmetic, so the result is bit for bit
the one torch's ``all_reduce`` gives, on every rank. Scalar metrics (32 of
them in 0.6 ms, not 1.1-1.4 ms) and ``ctx.log``'s dicts gain; a loss (one
element), a large tensor and NCCL keep torch's ``all_reduce``.

At 3 or more ranks the gather measured faster too (3 ranks, 8 to 256
elements: 2.0-2.1 against 2.6-3.9 ms; 4 ranks 3.9-4.1 against 6.5-6.7 ms, on
2 oversubscribed cores), but a sum in rank order is no longer the sum in
gloo's ring order, whose last bits differ where the values are not exact
in the wire's dtype; torch's ``all_reduce`` stays, so results stay torch's.

Both ways are one collective of the ``torch.distributed`` namespace, so the
hang doctor tracks either (a rank waiting in a gathered reduction is
reported "waiting in all_gather()"), and every rank takes the same way: the
protocol (:mod:`ddpctx.reduce.collectives`) has every rank send a buffer of
the agreed length.

Example:
    >>> import torch
    >>> buffer = torch.tensor([1.0, 2.0, 3.0])
    >>> all_reduce(buffer, "sum")  # no process group: nothing to do
    >>> buffer
    tensor([1., 2., 3.])
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

#: At 2 ranks on gloo, buffers of this many elements or more are gathered.
GATHER_FROM = 3
#: ... up to this many bytes (beyond about 256 KiB ``all_reduce`` catches up).
GATHER_MAX_BYTES = 64 * 1024

TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}
#: Per process group: whether it is a 2-rank group whose CPU tensors go through gloo.
_GLOO_PAIRS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def all_reduce(buffer: torch.Tensor, op: str, group: Any = None, async_op: bool = False) -> Any:
    """Reduce ``buffer`` in place across ``group`` with ``op`` ("sum", "max", "min", "prod").

    Returns None, or with ``async_op=True`` a handle whose ``wait()`` leaves the
    reduced values in ``buffer`` (``is_completed()`` as torch's handles).
    """
    if not dist.is_initialized():
        return None
    if not _gathered(buffer, group):
        return dist.all_reduce(buffer, op=TORCH_OPS[op], group=group, async_op=async_op)
    rows = torch.empty((2, buffer.numel()), dtype=buffer.dtype)
    work = dist.all_gather(list(rows.unbind(0)), buffer, group=group, async_op=async_op)
    if not async_op:
        _combine(rows, op, buffer)
        return None
    return Gathered(work, rows, op, buffer)


class Gathered:
    """The handle of a gathered reduction: waiting also combines the rows into the buffer."""

    __slots__ = ("_buffer", "_done", "_op", "_rows", "_work")

    def __init__(self, work: Any, rows: torch.Tensor, op: str, buffer: torch.Tensor) -> None:
        self._work, self._rows, self._op, self._buffer = work, rows, op, buffer
        self._done = False

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        self._work.wait(*args, **kwargs)
        if not self._done:
            _combine(self._rows, self._op, self._buffer)
            self._done = True
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


def _gathered(buffer: torch.Tensor, group: Any) -> bool:
    """Whether ``buffer`` goes by all_gather: small, on the CPU, of a 2-rank gloo group."""
    if buffer.numel() < GATHER_FROM or not buffer.is_cpu:
        return False
    if buffer.numel() * buffer.element_size() > GATHER_MAX_BYTES:
        return False
    the_group = group if group is not None else dist.group.WORLD
    pair = _GLOO_PAIRS.get(the_group)
    if pair is None:
        backend = str(dist.get_backend(group))
        pair = dist.get_world_size(group) == 2 and "gloo" in backend
        _GLOO_PAIRS[the_group] = pair
    return pair


def _combine(rows: torch.Tensor, op: str, out: torch.Tensor) -> None:
    if op == "sum":
        torch.sum(rows, 0, out=out)
    elif op == "max":
        torch.amax(rows, 0, out=out)
    elif op == "min":
        torch.amin(rows, 0, out=out)
    else:
        torch.prod(rows, 0, out=out)
