"""Model parallelism's face on :class:`~ddpctx.DistContext`: wrap, unwrap, no_sync, accumulate.

:class:`ModelFaces` is mixed into ``DistContext``; DDP wrapping and gradient
accumulation live in :mod:`ddpctx.parallel.wrapping` and
:mod:`ddpctx.parallel.accumulate`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ddpctx.parallel.accumulate import Accumulation, no_sync
from ddpctx.parallel.wrapping import unwrap_model


class ModelFaces:
    """``ctx.wrap``, ``ctx.unwrap``, ``ctx.no_sync``, ``ctx.accumulate``."""

    world_size: int
    device: torch.device

    def wrap(self, model: nn.Module, **ddp_kwargs: Any) -> DistributedDataParallel:
        """Move ``model`` to :attr:`device` and wrap it in DistributedDataParallel.

        On CUDA ``device_ids=[local_rank]`` is passed unless you pass your own.
        ``ddp_kwargs`` go to DDP (e.g. ``find_unused_parameters=True``).

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     type(ctx.wrap(torch.nn.Linear(2, 1))).__name__
        'DistributedDataParallel'
        """
        if isinstance(model, DistributedDataParallel):
            raise ValueError(
                "wrap() got a model that is already DistributedDataParallel; pass the bare "
                "module (ctx.unwrap(model)) or use it as it is."
            )
        model = model.to(self.device)
        if self.device.type == "cuda":
            ddp_kwargs.setdefault("device_ids", [self.device.index])
        return DistributedDataParallel(model, **ddp_kwargs)

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The bare module inside DDP (and ``torch.compile``) wrappers.

        >>> from ddpctx import DistContext
        >>> layer = torch.nn.Linear(2, 1)
        >>> DistContext.unwrap(layer) is layer
        True
        """
        return unwrap_model(model)

    def no_sync(
        self, model: nn.Module, enabled: bool = True
    ) -> contextlib.AbstractContextManager[Any]:
        """Skip DDP's gradient all-reduce in backward passes inside the block (while ``enabled``).

        A no-op for world size 1 and for models not wrapped in DDP.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx, ctx.no_sync(ctx.wrap(torch.nn.Linear(2, 1))):
        ...     pass
        """
        return no_sync(model, enabled, self.world_size)

    def accumulate(
        self, model: nn.Module, every: int, loader: DataLoader[Any] | None = None
    ) -> Accumulation:
        """Gradient accumulation over ``every`` micro-batches (:mod:`ddpctx.parallel.accumulate`).

        ``with accumulation as sync:`` around each micro-batch's backward; step
        the optimizer when ``sync``. Pass the ``loader`` to count by its
        position, so the sync points survive a mid-epoch resume and the last
        batch of an epoch always syncs.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     model = ctx.wrap(torch.nn.Linear(2, 1))
        ...     accumulation = ctx.accumulate(model, every=2)
        ...     steps = []
        ...     for x in torch.ones(4, 1, 2):
        ...         with accumulation as sync:
        ...             model(x).sum().div(2).backward()
        ...         steps.append(sync)
        ...     steps
        [False, True, False, True]
        """
        return Accumulation(model, every, self.world_size, loader)
