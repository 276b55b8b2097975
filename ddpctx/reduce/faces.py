"""The reduction engine's face on :class:`~ddpctx.DistContext`: reduce, broadcast, gather, agree.

:class:`CollectiveFaces` is mixed into ``DistContext``; it holds no state of
its own beyond the per-call-site :class:`~ddpctx.reduce.collectives.Site`
table, and every method is a thin call into :mod:`ddpctx.reduce.collectives`.
Each refuses a caller no other rank could join -- another thread, a DataLoader
worker, rank-zero-only work -- at once (see :mod:`ddpctx.reduce.guard`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from ddpctx.reduce.collectives import Site, all_reduce_tree, check_op, comm_device
from ddpctx.reduce.guard import check_caller
from ddpctx.reduce.objects import all_gather_objects, broadcast_object
from ddpctx.reduce.packing import OpSpec


class CollectiveFaces:
    """``ctx.barrier``, ``all_reduce``, ``broadcast``, ``all_gather``, ``any``, ``all``."""

    world_size: int
    device: torch.device
    _sites: dict[str, Site]

    def barrier(self) -> None:
        """Wait until every rank gets here.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     ctx.barrier()
        """
        check_caller("ctx.barrier()")
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index or 0])
        else:
            dist.barrier()

    def all_reduce(
        self, obj: Any, op: OpSpec = "mean", weight: str | None = None, *, async_op: bool = False
    ) -> Any:
        """Reduce a number, tensor, array or nested dict/list of them across ranks.

        The functional form of :func:`ddpctx.all_reduced` (same options, same
        collectives). ``async_op=True`` returns a handle: ``.result()`` later.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     ctx.all_reduce({"loss": 0.5, "count": 10}, weight="count")
        {'loss': 0.5, 'count': 10}
        """
        check_op(op)
        caller = sys._getframe(1)
        key = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        site = self._sites.setdefault(key, Site(f"all_reduce at {key}"))
        return all_reduce_tree(obj, op, weight, site=site, async_op=async_op)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (any picklable object; tensors keep their device).

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     ctx.broadcast({"run": "a"})
        {'run': 'a'}
        """
        check_caller("ctx.broadcast()")
        return broadcast_object(obj, src)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order (any picklable object, sizes may differ).

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     ctx.all_gather(ctx.rank)
        [0]
        """
        check_caller("ctx.all_gather()")
        return all_gather_objects(obj)

    def any(self, flag: object) -> bool:
        """True on every rank if ``flag`` is true on any rank (one tiny collective).

        Decide data-dependent skips and early stops together, so that no rank
        takes a branch the others do not (the commonest cause of a hang).

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     ctx.any(False), ctx.any(True)
        (False, True)
        """
        return self._agree(flag, dist.ReduceOp.MAX, "ctx.any()")

    def all(self, flag: object) -> bool:
        """True on every rank if ``flag`` is true on every rank (one tiny collective).

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     ctx.all(True)
        True
        """
        return self._agree(flag, dist.ReduceOp.MIN, "ctx.all()")

    def _agree(self, flag: object, op: Any, what: str) -> bool:
        check_caller(what)
        vote = torch.tensor([1.0 if flag else 0.0], device=comm_device())
        if self.world_size > 1:
            dist.all_reduce(vote, op=op)
        return bool(vote.item())
