"""Model parallelism's face on :class:`~ddpctx.DistContext`: wrap, shard, precision, clipping.

:class:`ModelFaces` is mixed into ``DistContext``; DDP wrapping, FSDP2
sharding, the precision switch, clipping and gradient accumulation live in
:mod:`ddpctx.parallel.wrapping`, :mod:`ddpctx.parallel.sharding`,
:mod:`ddpctx.parallel.precision`, :mod:`ddpctx.parallel.clipping` and
:mod:`ddpctx.parallel.accumulate`.

The calls that are collectives -- ``ctx.wrap`` and ``ctx.shard`` (rank 0's
weights go to every rank), and ``ctx.full_state_dict`` and ``ctx.clip_grad_norm_``
of a sharded model (the shards are gathered, the norm reduced) -- go through
the session's :attr:`ModelFaces._collective_call`: a caller no other rank can
join (rank-zero-only work, another thread, a DataLoader worker) is refused at
once, on every rank, naming the call (:mod:`ddpctx.reduce.guard`), where it
would otherwise wait out the collective timeout. The hang doctor counts
``full_state_dict`` and ``clip_grad_norm_`` of a sharded model (tensor
parallel too) as one wait each, since torch makes their gathers out of its
sight (:meth:`ddpctx.hang.watchdog.Doctor.wait_in`); ``wrap``, ``shard`` and
``parallel_mesh`` are not (a big model takes minutes to start, which is no
hang), their ``torch.distributed`` collectives are tracked one by one.

Rank-zero work may not run those models' forward, nor clip a DDP model
(no collective, but rank 0's gradients alone would change): refused through
the session's :attr:`ModelFaces._refuse_alone` (:mod:`ddpctx.parallel.guards`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ddpctx.parallel.accumulate import Accumulation, no_sync
from ddpctx.parallel.clipping import clip_grad_norm
from ddpctx.parallel.compiling import CompileSetting, compile_in_place, compile_options
from ddpctx.parallel.guards import CLIP_WHY, CollectiveCall, Refuse, guard_forward
from ddpctx.parallel.precision import Precision
from ddpctx.parallel.sharding import (
    DEFAULT_MIN_PARAMS,
    BlockPolicy,
    check_shardable,
    dtensor_type,
    full_state_dict,
    refuse_flattening_optimizers,
    shard_model,
    sharding_of,
)
from ddpctx.parallel.shardstart import on_meta, start_like_rank0
from ddpctx.parallel.tensorparallel import apply_plan, check_plan, check_tp_size, parallel_mesh
from ddpctx.parallel.wrapping import remember_wrapper, unwrap_model

T = TypeVar("T")


class ModelFaces:
    """``ctx.wrap``, ``ctx.shard``, ``ctx.unwrap``, ``ctx.no_sync``, ``ctx.accumulate``, ..."""

    rank: int
    world_size: int
    device: torch.device
    _precision: Precision
    _mesh: DeviceMesh | None
    _parallel_meshes: dict[int, DeviceMesh]
    #: Called after :meth:`shard` (the session's hang doctor hooks FSDP2, now loaded).
    _after_shard: Callable[[], None] | None = None
    #: Called with every model :meth:`wrap` and :meth:`shard` return (the session's step clock).
    _on_model: Callable[[nn.Module], None] | None = None
    #: Runs the calls that are collectives (see the module docstring); set by the session.
    _collective_call: CollectiveCall | None = None
    #: Refuses a call inside rank-zero work (:mod:`ddpctx.parallel.guards`); set by the session.
    _refuse_alone: Refuse | None = None
    _scaler: torch.amp.GradScaler | None

    def wrap(
        self, model: nn.Module, *, compile: CompileSetting = False, **ddp_kwargs: Any
    ) -> DistributedDataParallel:
        """Move ``model`` to :attr:`device` and wrap it in DistributedDataParallel.

        On CUDA ``device_ids=[local_rank]`` is passed unless you pass your own.
        ``ddp_kwargs`` go to DDP (e.g. ``find_unused_parameters=True``).
        ``compile=True`` (or a dict of ``torch.compile`` options) compiles the
        DDP module in place after wrapping, as torch advises for DDP; its
        parameter names stay those of the model
        (:mod:`ddpctx.parallel.compiling`).

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     type(ctx.wrap(torch.nn.Linear(2, 1))).__name__
        'DistributedDataParallel'
        """
        options = compile_options(compile, "ctx.wrap")
        if isinstance(model, DistributedDataParallel):
            raise ValueError(
                "wrap() got a model that is already DistributedDataParallel; pass the bare "
                "module (ctx.unwrap(model)) or use it as it is."
            )
        sharded = sharding_of(model)
        if sharded is not None:
            raise ValueError(
                f"wrap() got a sharded model ({sharded}: its parameters are split across "
                "ranks), which DistributedDataParallel cannot wrap. A model is either "
                "replicated (ctx.wrap) or sharded (ctx.shard), not both: use the sharded "
                "model as it is, or pass ctx.wrap a model that was never sharded."
            )
        if self.device.type == "cuda":
            ddp_kwargs.setdefault("device_ids", [self.device.index])
        wrapped = self._collective(
            "ctx.wrap()",  # DDP broadcasts rank 0's weights
            lambda: DistributedDataParallel(
                self._precision.prepare(model.to(self.device)), **ddp_kwargs
            ),
            one_wait=False,
        )
        remember_wrapper(wrapped)  # its bare module saves and loads as the wrapper does
        self._precision.wrap_forward(wrapped)
        if options is not None:
            compile_in_place([wrapped], options)
        if self._refuse_alone is not None:  # after compiling: its check stays out of the graph
            guard_forward(wrapped, self._refuse_alone, sharded=False)
        if self._on_model is not None:
            self._on_model(wrapped)
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

    def parallel_mesh(self, tp_size: int) -> DeviceMesh:
        """The ``("dp", "tp")`` mesh of ``(world_size // tp_size, tp_size)`` ranks (made once).

        Rank ``r`` sits at ``(r // tp_size, r % tp_size)``; every rank must ask
        for it the first time (it forms groups). :meth:`shard` uses it.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     ctx.parallel_mesh(1).mesh_dim_names
        ('dp', 'tp')
        """
        size = check_tp_size(tp_size, self.world_size)
        if size not in self._parallel_meshes:
            make = lambda: parallel_mesh(self.device.type, self.world_size, size)  # noqa: E731
            self._parallel_meshes[size] = self._collective("ctx.parallel_mesh()", make, False)
        return self._parallel_meshes[size]

    def shard(
        self,
        model: nn.Module,
        *,
        blocks: BlockPolicy | None = None,
        min_params: int = DEFAULT_MIN_PARAMS,
        full_state_dict: Mapping[str, Any] | None = None,
        compile: CompileSetting = False,
        tp_plan: Mapping[str, Any] | None = None,
        tp_size: int | None = None,
        **fsdp_kwargs: Any,
    ) -> nn.Module:
        """Move ``model`` to :attr:`device` and shard it with FSDP2 ``fully_shard``, block by block.

        Every rank starts from rank 0's weights, as with :meth:`wrap`: rank
        0's parameters and buffers are broadcast first, so a rank-offset
        seed or ``if ctx.is_main: model.load_state_dict(pretrained)`` gives
        the same model at every world size. A model too big for one rank is
        built under ``with torch.device("meta"):`` and passed with
        ``full_state_dict=`` -- rank 0's weights (e.g. ``torch.load(path,
        mmap=True, weights_only=True) if ctx.is_main else None``; other ranks'
        value is not read): it is sharded on the meta device, materialised
        on :attr:`device`, and each rank receives only its shards. Buffers
        made on a real device (a rotary table) are kept.

        Each block (by default every child of an ``nn.ModuleList`` and any
        submodule holding ``min_params`` parameters no smaller block holds;
        ``blocks=[BlockClass]`` or ``blocks=lambda name, module: ...``
        override it) is sharded on its own, then the root, on :attr:`mesh`.
        The run's precision becomes FSDP2's ``MixedPrecisionPolicy``;
        ``fsdp_kwargs`` go to ``fully_shard`` (e.g.
        ``reshard_after_forward=False``). Each rank then holds about
        ``1/world_size`` of the weights, gradients and optimizer state.
        Create the optimizer *after* sharding, one that works per parameter
        (SGD, Adam, AdamW, ...): LBFGS flattens all parameters into one
        vector, which sharded ``DTensor``s cannot do (refused at its first
        ``step``; use :meth:`wrap` for it). Save with :meth:`save_checkpoint`
        (every rank writes its shards).

        ``tp_plan={path: ParallelStyle}, tp_size=N``: tensor parallel over
        :meth:`parallel_mesh`; give it ``ctx.dataloader(..., tp_size=N)``
        (:mod:`ddpctx.parallel.tensorparallel`).

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     model = ctx.shard(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        ...     type(next(model.parameters())).__name__
        'DTensor'
        """
        check_shardable(model, min_params)
        plan = check_plan(model, tp_plan, tp_size)
        split = tp_size if plan and check_tp_size(tp_size, self.world_size) > 1 else None
        options = compile_options(compile, "ctx.shard")
        block_kwargs, batch_norm_kwargs = self._precision.fsdp_kwargs(fsdp_kwargs)
        grid = None if split is None else self.parallel_mesh(split)

        def start() -> nn.Module:  # rank 0's weights reach every rank's shards
            placed = model if on_meta(model) else model.to(self.device)
            prepared = self._precision.prepare(placed)
            return start_like_rank0(
                prepared,
                lambda bare: shard_model(
                    bare,
                    self.mesh if grid is None else grid["dp"],
                    split_first=None if grid is None else lambda m: apply_plan(m, grid, plan),
                    blocks=blocks,
                    min_params=min_params,
                    block_kwargs=block_kwargs,
                    batch_norm_kwargs=batch_norm_kwargs,
                    compile_options=options,
                    **fsdp_kwargs,
                ),
                rank=self.rank,
                world_size=self.world_size,
                device=self.device,
                full_state_dict=full_state_dict,
            )

        sharded = self._collective("ctx.shard()", start, one_wait=False)
        if self._after_shard is not None:
            self._after_shard()
        refuse_flattening_optimizers()
        result = self._precision.wrap_forward(sharded)
        if self._refuse_alone is not None:
            guard_forward(result, self._refuse_alone, sharded=True)
        if self._on_model is not None:
            self._on_model(result)
        return result

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
        Refused inside rank-zero work (:mod:`ddpctx.parallel.guards`).

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     model = ctx.wrap(torch.nn.Linear(2, 1, bias=False))
        ...     model.module.weight.grad = torch.tensor([[3.0, 4.0]])
        ...     ctx.clip_grad_norm_(model, max_norm=1.0)
        5.0
        """

        def clip() -> float:
            return clip_grad_norm(model, max_norm, norm_type, error_if_nonfinite)

        if sharding_of(model) is None:  # DDP: every rank holds the whole gradient, clips alike
            if self._refuse_alone is not None:
                self._refuse_alone("ctx.clip_grad_norm_()", CLIP_WHY)
            return clip()
        return self._collective(
            "ctx.clip_grad_norm_()", clip, one_wait=True, everyone=self._spans_all(model)
        )

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """A snapshot of the whole model's weights on rank 0, on CPU (an empty dict on other ranks).

        Every tensor is a fresh copy: later optimizer steps leave it alone, so
        ``best = ctx.full_state_dict(model)`` keeps the best weights. For a
        sharded model every rank must call it (the shards are gathered); use
        it for ``save_pretrained``, export or evaluation on one process.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     sorted(ctx.full_state_dict(ctx.shard(torch.nn.Linear(2, 1))))
        ['bias', 'weight']
        """
        if sharding_of(model) is None:
            return full_state_dict(model, self.rank)  # rank 0's copy: nothing is sent
        return self._collective(
            "ctx.full_state_dict()",
            lambda: full_state_dict(model, self.rank),
            one_wait=True,
            everyone=self._spans_all(model),
        )

    def _collective(
        self, what: str, call: Callable[[], T], one_wait: bool, everyone: bool = False
    ) -> T:
        """``call()`` through :attr:`_collective_call` (directly while none is set)."""
        if self._collective_call is None:
            return call()
        return self._collective_call(what, call, one_wait=one_wait, everyone=everyone)

    def _spans_all(self, model: nn.Module) -> bool:
        """Whether ``model``'s shards span every rank (under tensor parallel, a planned layer's)."""
        dtensor = dtensor_type()
        meshes = [p.device_mesh for p in model.parameters() if isinstance(p, dtensor)]
        return any(mesh.size() == self.world_size for mesh in meshes)  # FSDP1: none

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The bare module inside DDP (and ``torch.compile``) wrappers.

        >>> from ddpctx import distributed
        >>> layer = torch.nn.Linear(2, 1)
        >>> with distributed() as ctx:
        ...     ctx.unwrap(ctx.wrap(layer)) is layer
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
