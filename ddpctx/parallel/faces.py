"""Model parallelism's face on :class:`~ddpctx.DistContext`: wrap, shard, precision, clipping.

:class:`ModelFaces` is mixed into ``DistContext``; DDP wrapping, FSDP2
sharding, the precision switch, clipping and gradient accumulation live in
:mod:`ddpctx.parallel.wrapping`, :mod:`ddpctx.parallel.sharding`,
:mod:`ddpctx.parallel.precision`, :mod:`ddpctx.parallel.clipping` and
:mod:`ddpctx.parallel.accumulate`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ddpctx.parallel.accumulate import Accumulation, no_sync
from ddpctx.parallel.clipping import clip_grad_norm
from ddpctx.parallel.precision import Precision
from ddpctx.parallel.sharding import DEFAULT_MIN_PARAMS, BlockPolicy, full_state_dict, shard_model
from ddpctx.parallel.wrapping import unwrap_model


class ModelFaces:
    """``ctx.wrap``, ``ctx.shard``, ``ctx.unwrap``, ``ctx.no_sync``, ``ctx.accumulate``, ..."""

    rank: int
    world_size: int
    device: torch.device
    _precision: Precision
    _mesh: DeviceMesh | None
    #: Called after :meth:`shard` (the session's hang doctor hooks FSDP2, now loaded).
    _after_shard: Callable[[], None] | None = None
    _scaler: torch.amp.GradScaler | None

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
        model = self._precision.prepare(model.to(self.device))
        if self.device.type == "cuda":
            ddp_kwargs.setdefault("device_ids", [self.device.index])
        wrapped = DistributedDataParallel(model, **ddp_kwargs)
        self._precision.wrap_forward(wrapped)
        return wrapped

    @property
    def precision(self) -> str:
        """The run's ``precision=``: ``"32"``, ``"bf16-mixed"``, ``"16-mixed"`` or ``"bf16-true"``.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     ctx.precision
        '32'
        """
        return self._precision.name

    @property
    def mesh(self) -> DeviceMesh:
        """The one-dimensional device mesh over all ranks that :meth:`shard` uses (made once)."""
        if self._mesh is None:
            self._mesh = init_device_mesh(self.device.type, (self.world_size,))
        return self._mesh

    def shard(
        self,
        model: nn.Module,
        *,
        blocks: BlockPolicy | None = None,
        min_params: int = DEFAULT_MIN_PARAMS,
        **fsdp_kwargs: Any,
    ) -> nn.Module:
        """Move ``model`` to :attr:`device` and shard it with FSDP2 ``fully_shard``, block by block.

        Each block (by default every child of an ``nn.ModuleList`` and any
        submodule holding ``min_params`` parameters no smaller block holds;
        ``blocks=[BlockClass]`` or ``blocks=lambda name, module: ...``
        override it) is sharded on its own, then the root, on :attr:`mesh`.
        The run's precision becomes FSDP2's ``MixedPrecisionPolicy``;
        ``fsdp_kwargs`` go to ``fully_shard`` (e.g.
        ``reshard_after_forward=False``). Each rank then holds about
        ``1/world_size`` of the weights, gradients and optimizer state.
        Create the optimizer *after* sharding; save with
        :meth:`save_checkpoint` (every rank writes its shards).

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     model = ctx.shard(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        ...     type(next(model.parameters())).__name__
        'DTensor'
        """
        policy = self._precision.fsdp_policy()
        block_kwargs: dict[str, Any] = {}
        if policy is not None and "mp_policy" not in fsdp_kwargs:
            fsdp_kwargs["mp_policy"] = policy
            # only the root casts its output to float32: blocks hand bf16 on to the next block
            block_kwargs["mp_policy"] = dataclasses.replace(policy, output_dtype=None)
        model = self._precision.prepare(model.to(self.device))
        sharded = shard_model(
            model,
            self.mesh,
            blocks=blocks,
            min_params=min_params,
            block_kwargs=block_kwargs,
            **fsdp_kwargs,
        )
        if self._after_shard is not None:
            self._after_shard()
        return self._precision.wrap_forward(sharded, sharded=True)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` for the run's mixed precision (a no-op block otherwise).

        Models from :meth:`wrap` and :meth:`shard` already compute in it; use
        this for work outside their forward.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx, ctx.autocast():
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.float32
        """
        return self._precision.autocast()

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The run's ``GradScaler``: enabled under ``precision="16-mixed"``, else a pass-through.

        ``ctx.scaler.scale(loss).backward(); ctx.scaler.step(optimizer);
        ctx.scaler.update()`` is right in every precision. Pass
        ``scaler=ctx.scaler`` to :meth:`save_checkpoint`/:meth:`load_checkpoint`.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     ctx.scaler.is_enabled()
        False
        """
        if self._scaler is None:
            self._scaler = self._precision.scaler()
        return self._scaler

    def clip_grad_norm_(
        self,
        model: nn.Module,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> float:
        """Clip ``model``'s gradients to total norm ``max_norm``; return the norm before (a float).

        The norm is the whole model's, also for a sharded model (the same
        number on every rank, equal to the unsharded computation). Under
        ``precision="16-mixed"`` call ``ctx.scaler.unscale_(optimizer)`` first.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     model = ctx.wrap(torch.nn.Linear(2, 1, bias=False))
        ...     model.module.weight.grad = torch.tensor([[3.0, 4.0]])
        ...     ctx.clip_grad_norm_(model, max_norm=1.0)
        5.0
        """
        return clip_grad_norm(model, max_norm, norm_type, error_if_nonfinite)

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The whole model's weights on rank 0, on CPU (an empty dict on other ranks).

        For a sharded model every rank must call it (the shards are gathered);
        use it for ``save_pretrained``, export or evaluation on one process.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     sorted(ctx.full_state_dict(ctx.shard(torch.nn.Linear(2, 1))))
        ['bias', 'weight']
        """
        return full_state_dict(model, self.rank)

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The bare module inside DDP (and ``torch.compile``) wrappers.

        >>> from ddpctx import DistContext
        >>> layer = torch.nn.Linear(2, 1)
        >>> ModelFaces.unwrap(layer) is layer
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
