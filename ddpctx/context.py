"""``distributed()``: one ``with`` block around a whole distributed run.

Contract (``DESIGN.md`` section 2), in the order things happen on enter:

1. Refuse nesting; check every argument and every launcher variable. All
   validation happens before anything is started, so a bad input leaves no
   process group, handler or flag behind.
2. Pick the backend (``nccl`` with CUDA, else ``gloo``) and the device
   (``cuda:<local_rank>`` or ``cpu``), and pin the device.
3. Form the process group -- always, also for one process (an in-memory
   store, gloo pinned to loopback) -- or adopt one that someone else formed
   (it is then left alive on exit).
4. Turn SIGTERM (what torchrun sends the survivors when a rank dies) into
   ``SystemExit(143)`` so the clean-up below runs instead of the process
   vanishing mid-write.
5. Seed every generator with ``seed + rank``; optionally turn on
   deterministic algorithms.

On exit, whatever the cause, everything is undone in reverse order, and the
process group is destroyed in bounded time. An exception leaving the block is
re-raised unchanged; under torchrun it is first written to
``TORCHELASTIC_ERROR_FILE`` in the format of torch's ``@record``, so the
launcher's report names the failing rank and shows its traceback.

Layering: ``env`` and ``seeding`` are pure helpers below this module; the
decorators, data loading, checkpoints and launchers sit above it and reach
the active context through :func:`current`, the one piece of module state.

Example:
    >>> from ddpctx import distributed
    >>> with distributed(seed=0) as ctx:
    ...     (ctx.rank, ctx.world_size, ctx.backend, str(ctx.device))
    (0, 1, 'gloo', 'cpu')
"""

from __future__ import annotations

import builtins
import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, TypeVar, cast

import contextlib2
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from ddpctx import resume
from ddpctx.accumulate import Accumulation, no_sync
from ddpctx.atomic import atomic_save
from ddpctx.blocks import atomic_dir, rank_zero_block
from ddpctx.checkpoint import load_file, unwrap_model
from ddpctx.collectives import (
    Site,
    all_gather_objects,
    all_reduce_tree,
    broadcast_object,
    check_op,
    comm_device,
)
from ddpctx.data import epochs, make_dataloader
from ddpctx.env import (
    Launcher,
    LaunchInfo,
    detect_launch,
    resolve_backend,
    resolve_device_index,
    resolve_timeout,
)
from ddpctx.group import (
    destroy_group_bounded,
    init_group,
    record_for_torchrun,
    should_record,
)
from ddpctx.identity import occupant, occupy
from ddpctx.inflight import torch_detail_debug
from ddpctx.loader import ShardLoader
from ddpctx.packing import OpSpec
from ddpctx.rankzero import Place, on_rank_zero, zero_first
from ddpctx.report import bar_on_main
from ddpctx.sampling import Position
from ddpctx.seeding import enable_deterministic, seed_everything, validate_seed
from ddpctx.signals import exit_on_sigterm
from ddpctx.watchdog import Doctor, HangSettings, resolve_hang_settings

T = TypeVar("T")


def current() -> DistContext | None:
    """The active :class:`DistContext`, or None outside ``distributed()``.

    >>> current() is None
    True
    """
    return cast("DistContext | None", occupant())


class DistContext:
    """This process's place in the run, and the operations that need it.

    Made by :func:`distributed`; read its attributes, don't build one yourself.

    Attributes:
        rank, world_size: global rank and number of processes.
        local_rank, local_world_size, node_rank: the same within this node.
        device: ``cuda:<local_rank>`` or ``cpu``; ``backend``: ``nccl``, ``gloo``, ...
        launcher: ``"torchrun"``, ``"slurm"``, ``"mpi"``, ``"launch"`` (``ddpctx.launch``
            and the pytest plugin) or ``"single"``.
        seed: this rank's effective seed (``seed + rank``) or None.
        is_main, is_local_main: rank 0 globally / on this node.
        restart_count: how often an elastic launcher restarted the job.

    Example:
        >>> with distributed() as ctx:
        ...     (ctx.is_main, ctx.local_world_size, ctx.node_rank)
        (True, 1, 0)
    """

    def __init__(
        self,
        info: LaunchInfo,
        backend: str,
        device: torch.device,
        seed: int | None,
        close: Callable[[], None],
    ) -> None:
        self.rank: int = info.rank
        self.world_size: int = info.world_size
        self.local_rank: int = info.local_rank
        self.local_world_size: int = info.local_world_size
        self.node_rank: int = info.node_rank
        self.launcher: Launcher = info.launcher
        self.restart_count: int = info.restart_count
        self.backend: str = backend
        self.device: torch.device = device
        self.base_seed: int | None = seed
        self.seed: int | None = None if seed is None else seed + info.rank
        self._close = close
        self._sites: dict[str, Site] = {}
        self._loaders: list[ShardLoader] = []
        self._resume_positions: list[tuple[Position | None, int]] = []

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True on local rank 0 of each node."""
        return self.local_rank == 0

    def __repr__(self) -> str:
        return (
            f"DistContext(rank={self.rank}, world_size={self.world_size}, "
            f"local_rank={self.local_rank}, device={str(self.device)!r}, "
            f"backend={self.backend!r}, launcher={self.launcher!r}, seed={self.seed})"
        )

    def barrier(self) -> None:
        """Wait until every rank gets here.

        >>> with distributed() as ctx:
        ...     ctx.barrier()
        """
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

        >>> with distributed() as ctx:
        ...     ctx.broadcast({"run": "a"})
        {'run': 'a'}
        """
        return broadcast_object(obj, src)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order (any picklable object, sizes may differ).

        >>> with distributed() as ctx:
        ...     ctx.all_gather(ctx.rank)
        [0]
        """
        return all_gather_objects(obj)

    def any(self, flag: object) -> bool:
        """True on every rank if ``flag`` is true on any rank (one tiny collective).

        Decide data-dependent skips and early stops together, so that no rank
        takes a branch the others do not (the commonest cause of a hang).

        >>> with distributed() as ctx:
        ...     ctx.any(False), ctx.any(True)
        (False, True)
        """
        return self._agree(flag, dist.ReduceOp.MAX)

    def all(self, flag: object) -> bool:
        """True on every rank if ``flag`` is true on every rank (one tiny collective).

        >>> with distributed() as ctx:
        ...     ctx.all(True)
        True
        """
        return self._agree(flag, dist.ReduceOp.MIN)

    def _agree(self, flag: object, op: Any) -> bool:
        vote = torch.tensor([1.0 if flag else 0.0], device=comm_device())
        if self.world_size > 1:
            dist.all_reduce(vote, op=op)
        return bool(vote.item())

    def rank_zero_first(self, local: bool = False) -> contextlib.AbstractContextManager[None]:
        """Rank 0 (local rank 0 with ``local=True``) runs the block first, then the others.

        An exception on rank 0 is raised on every rank instead of deadlocking them.

        >>> with distributed() as ctx, ctx.rank_zero_first():
        ...     print("downloading once")
        downloading once
        """
        place = Place(self.rank, self.world_size, self.local_rank, self.node_rank)
        return zero_first(place, local)

    def wrap(self, model: nn.Module, **ddp_kwargs: Any) -> DistributedDataParallel:
        """Move ``model`` to :attr:`device` and wrap it in DistributedDataParallel.

        On CUDA ``device_ids=[local_rank]`` is passed unless you pass your own.
        ``ddp_kwargs`` go to DDP (e.g. ``find_unused_parameters=True``).

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

        >>> layer = torch.nn.Linear(2, 1)
        >>> DistContext.unwrap(layer) is layer
        True
        """
        return unwrap_model(model)

    def dataloader(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        shuffle: bool = False,
        pad: bool = True,
        device: torch.device | str | None = "auto",
        **loader_kwargs: Any,
    ) -> DataLoader[Any]:
        """A DataLoader over this rank's shard of ``dataset`` (see :mod:`ddpctx.data`).

        The sampler is seeded with the base seed (the same on every rank, so
        shards are disjoint); :meth:`epochs` advances it. ``pad=False`` gives
        uneven shards without repeated samples (for exact evaluation).
        Batches arrive on ``device`` (default :attr:`device`; None leaves them
        where the dataset put them). Workers are seeded per (rank, worker,
        epoch) and each batch per (rank, epoch, batch); your
        ``worker_init_fn`` still runs after that. Its position within the
        epoch is saved by :meth:`save_checkpoint` and resumed by
        :meth:`load_checkpoint`.

        >>> with distributed(seed=0) as ctx:
        ...     loader = ctx.dataloader(list(range(10)), batch_size=4, shuffle=True)
        ...     [len(batch) for batch in loader]
        [4, 4, 2]
        """
        target = self.device if isinstance(device, str) and device == "auto" else device
        loader = make_dataloader(
            dataset,
            batch_size,
            shuffle=shuffle,
            pad=pad,
            base_seed=self.base_seed or 0,
            rank=self.rank,
            world_size=self.world_size,
            loader_kwargs=loader_kwargs,
            device=None if target is None else torch.device(target),
        )
        index = len(self._loaders)
        self._loaders.append(loader)
        if index < len(self._resume_positions):  # made after load_checkpoint
            resume.apply_position(loader, index, *self._resume_positions[index])
        return loader

    def epochs(self, n: int, start: int = 0) -> Iterator[int]:
        """Epochs ``start .. n-1``; ``set_epoch`` on every loader before each, a barrier after.

        >>> with distributed() as ctx:
        ...     list(ctx.epochs(3, start=1))
        [1, 2]
        """
        return epochs(n, start, [loader.shard for loader in self._loaders], self.barrier)

    def no_sync(
        self, model: nn.Module, enabled: bool = True
    ) -> contextlib.AbstractContextManager[Any]:
        """Skip DDP's gradient all-reduce in backward passes inside the block (while ``enabled``).

        A no-op for world size 1 and for models not wrapped in DDP.

        >>> with distributed() as ctx, ctx.no_sync(ctx.wrap(torch.nn.Linear(2, 1))):
        ...     pass
        """
        return no_sync(model, enabled, self.world_size)

    def accumulate(
        self, model: nn.Module, every: int, loader: DataLoader[Any] | None = None
    ) -> Accumulation:
        """Gradient accumulation over ``every`` micro-batches (see :mod:`ddpctx.accumulate`).

        ``with accumulation as sync:`` around each micro-batch's backward; step
        the optimizer when ``sync``. Pass the ``loader`` to count by its
        position, so the sync points survive a mid-epoch resume and the last
        batch of an epoch always syncs.

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

    def rank_zero(self, local: bool = False) -> contextlib.AbstractContextManager[bool]:
        """A block only rank 0 runs (``if main:``); every rank waits, and a failure reaches all.

        The same guarantee as ``@rank_zero_only(barrier=True)``, without a function.

        >>> with distributed() as ctx:
        ...     with ctx.rank_zero() as main:
        ...         if main:
        ...             print("rank 0 writes")
        rank 0 writes
        """
        return rank_zero_block(self._place(), local)

    def atomic_dir(
        self, path: str | os.PathLike[str]
    ) -> contextlib.AbstractContextManager[Path | None]:
        """Rank 0 writes a directory into the yielded temporary path; it replaces ``path`` whole.

        Other ranks get None and wait; a failure reaches every rank and leaves
        ``path`` as it was (see :mod:`ddpctx.blocks`).

        >>> import tempfile
        >>> with distributed() as ctx:
        ...     target = Path(tempfile.mkdtemp()) / "model"
        ...     with ctx.atomic_dir(target) as tmp:
        ...         if tmp is not None:
        ...             _ = (tmp / "config.json").write_text("{}")
        ...     sorted(p.name for p in target.iterdir())
        ['config.json']
        """
        return atomic_dir(self._place(), Path(path))

    def progress(self, iterable: Iterable[T], **tqdm_kwargs: Any) -> Iterable[T]:
        """``iterable`` with a tqdm bar on rank 0 (if tqdm is installed); as it is elsewhere."""
        return bar_on_main(iterable, self.is_main, tqdm_kwargs)

    def _place(self) -> Place:
        return Place(self.rank, self.world_size, self.local_rank, self.node_rank)

    def save(self, obj: Any, path: str | os.PathLike[str]) -> None:
        """Rank 0 writes ``obj`` atomically (temporary file, fsync, rename); every rank waits.

        A failed write raises on every rank (:class:`~ddpctx.RankZeroError` on the others).

        >>> import tempfile, os
        >>> with distributed() as ctx:
        ...     ctx.save({"step": 1}, os.path.join(tempfile.mkdtemp(), "state.pt"))
        """
        on_rank_zero(self._place(), lambda: atomic_save(obj, Path(path)), broadcast=False)

    def load(self, path: str | os.PathLike[str], weights_only: bool = True) -> Any:
        """Load ``path`` on every rank, tensors mapped to :attr:`device`.

        ``weights_only=True`` (the default) refuses pickled code; pass False
        only for files you trust.
        """
        return load_file(Path(path), self.device, weights_only)

    def save_checkpoint(
        self,
        directory: str | os.PathLike[str],
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        extra: dict[str, Any] | None = None,
        step: int | None = None,
        keep: int = 2,
        **meta: Any,
    ) -> Path:
        """Save the training state, every rank's random state and every loader's position.

        Writes a new checkpoint named for its epoch and step (see
        :mod:`ddpctx.checkpoint`), keeps the newest ``keep``, and returns its
        path on every rank. ``scaler`` (AMP) and ``extra`` (name -> object
        with ``state_dict``) are saved too. ``meta`` (e.g. ``epoch=3``) comes
        back from :meth:`load_checkpoint`; NumPy values, paths and
        namespaces are converted, anything that would not load is refused
        here (see :mod:`ddpctx.meta`). Call it every K steps with ``step=``
        to resume mid-epoch.
        """
        return resume.save(
            self._place(),
            self.all_gather,
            self._loaders,
            self.base_seed,
            Path(directory),
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            extra=extra,
            step=step,
            keep=keep,
            meta=meta,
        )

    def load_checkpoint(
        self,
        directory: str | os.PathLike[str],
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        extra: dict[str, Any] | None = None,
        allow_world_size_change: bool = False,
    ) -> dict[str, Any] | None:
        """Restore the newest loadable checkpoint in ``directory``; return its meta.

        None only when ``directory`` holds no checkpoint at all. Restores the
        model, optimizer, scheduler, scaler, ``extra``, this rank's random
        state and every loader's position, so the run continues exactly as
        an uninterrupted one would (``step`` is in the meta when it was
        saved). Torn files are skipped with a warning; a file that reads but
        is refused is an error, as is a directory where no checkpoint loads.
        A checkpoint from another world size is an error unless
        ``allow_world_size_change=True`` (see :mod:`ddpctx.resume`).
        """
        meta, positions = resume.load(
            self._place(),
            self.device,
            self._loaders,
            self.base_seed,
            Path(directory),
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            extra=extra,
            allow_world_size_change=allow_world_size_change,
        )
        self._resume_positions = positions
        for index, loader in enumerate(self._loaders[: len(positions)]):
            resume.apply_position(loader, index, *positions[index])
        return meta

    def print(
        self, *values: object, sep: str = " ", end: str = "\n", file: IO[str] | None = None
    ) -> None:
        """``print`` on rank 0 only (flushed, so it interleaves sanely with other output).

        >>> with distributed() as ctx:
        ...     ctx.print("hello from rank", ctx.rank)
        hello from rank 0
        """
        if self.is_main:
            builtins.print(*values, sep=sep, end=end, file=file, flush=True)


def distributed(
    seed: int | None = None,
    *,
    backend: str | None = None,
    timeout: float | timedelta | None = None,
    deterministic: bool = False,
    hang_timeout: float | None = None,
    on_hang: Literal["report", "raise"] = "report",
    debug: bool = False,
) -> DistributedSession:
    """Set up (and always tear down) distributed training for the block.

    Args:
        seed: base seed; rank ``r`` seeds ``random``, NumPy, torch and CUDA
            with ``seed + r``. None leaves the generators alone.
        backend: ``"nccl"``, ``"gloo"``, ... Default: ``nccl`` with CUDA, else ``gloo``.
        timeout: collective timeout in seconds (or a ``timedelta``). Default:
            ``DDPCTX_TIMEOUT`` seconds if set, else 10 minutes.
        deterministic: turn on ``torch.use_deterministic_algorithms`` and the
            cuDNN flags for the block, restoring the previous flags on exit.
        hang_timeout: seconds a rank may wait in one collective before every
            rank's stack is collected and rank 0 prints a hang report
            (:mod:`ddpctx.watchdog`). Default: ``DDPCTX_HANG_TIMEOUT`` if set,
            else a fifth of ``timeout``, at most 300. ``0`` turns it off.
        on_hang: ``"report"`` (print the report, keep waiting) or ``"raise"``
            (every rank raises :class:`~ddpctx.HangError` carrying the report).
        debug: check before every collective that all ranks are in the same one
            (one extra tiny collective each), and turn on torch's
            ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` for a group formed here. Also
            ``DDPCTX_DEBUG=collectives``.

    The same script runs under ``torchrun``, under ``srun`` and as a plain
    ``python script.py`` (world size 1).

    Example:
        >>> with distributed(seed=42) as ctx:
        ...     ctx.seed
        42
    """
    return DistributedSession(
        seed, backend, timeout, deterministic, hang=(hang_timeout, on_hang, debug)
    )


@dataclass(frozen=True)
class _Plan:
    info: LaunchInfo
    backend: str
    device: torch.device
    timeout: timedelta
    seed: int | None
    adopted: bool
    hang: HangSettings


class DistributedSession:
    """The context manager :func:`distributed` returns; ``__enter__`` yields the context.

    Example:
        >>> session = distributed()
        >>> with session as ctx:
        ...     ctx.world_size
        1
    """

    def __init__(
        self,
        seed: int | None,
        backend: str | None,
        timeout: float | timedelta | None,
        deterministic: bool,
        hang: tuple[object, object, object] = (None, "report", False),
    ) -> None:
        self._seed = seed
        self._hang = hang
        self._doctor: Doctor | None = None
        self._backend = backend
        self._timeout = timeout
        self._deterministic = deterministic
        self._cleanup = contextlib2.ExitStack()

    def __enter__(self) -> DistContext:
        active = current()
        if active is not None:
            raise RuntimeError(
                f"distributed() is already active in this process ({active!r}); nesting "
                "would form a second process group. Use the context you have, or "
                "ddpctx.current() to reach it from deeper code."
            )
        plan = _make_plan(self._seed, self._backend, self._timeout, os.environ, self._hang)
        with contextlib2.ExitStack() as stack:  # unwinds everything if a step fails
            if plan.device.type == "cuda":
                torch.cuda.set_device(plan.device)
            if not plan.adopted:
                with torch_detail_debug(plan.hang.debug):
                    init_group(plan.info, plan.backend, plan.device, plan.timeout)
                stack.callback(destroy_group_bounded)
            doctor = Doctor(
                plan.hang, plan.info.rank, plan.info.world_size, cuda=plan.device.type == "cuda"
            )
            stack.callback(doctor.stop)  # before the group is destroyed
            self._doctor = doctor
            restore_handler = exit_on_sigterm(plan.info.rank)
            if restore_handler is not None:
                stack.callback(restore_handler)
            if plan.seed is not None:
                seed_everything(plan.seed + plan.info.rank)
            if self._deterministic:
                stack.callback(enable_deterministic())
            context = DistContext(plan.info, plan.backend, plan.device, plan.seed, self.close)
            occupy(context)
            stack.callback(occupy, None)
            self._cleanup = stack.pop_all()
        return context

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        try:
            if exc is not None and should_record(exc):
                reports = self._doctor.reports if self._doctor is not None else []
                record_for_torchrun(exc, os.environ, note="\n\n".join(reports))
        finally:
            self.close()
        return False

    def close(self) -> None:
        """Undo everything ``__enter__`` did; safe to call more than once."""
        self._cleanup.close()


def _make_plan(
    seed: object,
    backend: str | None,
    timeout: float | timedelta | None,
    environ: Mapping[str, str],
    hang: tuple[object, object, object] = (None, "report", False),
) -> _Plan:
    """Every decision and every check, with no side effect."""
    resolved_timeout = resolve_timeout(timeout, environ)
    hang_settings = resolve_hang_settings(*hang, resolved_timeout.total_seconds(), environ)
    cuda_available = torch.cuda.is_available()
    if dist.is_initialized():
        info, resolved_backend = _adopted_launch(backend, environ)
    else:
        info = detect_launch(environ)
        resolved_backend = resolve_backend(backend, cuda_available)
    device_index = resolve_device_index(
        info,
        cuda_available,
        torch.cuda.device_count() if cuda_available else 0,
        environ.get("CUDA_VISIBLE_DEVICES"),
    )
    device = torch.device("cpu") if device_index is None else torch.device("cuda", device_index)
    return _Plan(
        info=info,
        backend=resolved_backend,
        device=device,
        timeout=resolved_timeout,
        seed=validate_seed(seed, info.world_size),
        adopted=dist.is_initialized(),
        hang=hang_settings,
    )


def _adopted_launch(backend: str | None, environ: Mapping[str, str]) -> tuple[LaunchInfo, str]:
    """Describe a process group that someone else initialised.

    Rank and world size come from the group. The launcher and local ranks come
    from the environment when it agrees with the group; otherwise (e.g.
    ``mp.spawn`` without ``RANK``) the group is taken to be one node.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group_backend = str(dist.get_backend())
    if backend is not None and backend.lower() not in group_backend:
        raise ValueError(
            f"backend={backend!r} but the process group that was already initialised uses "
            f"{group_backend!r}. Drop backend= to adopt the existing group, or destroy it first."
        )
    detected = detect_launch(environ, rendezvous=False)
    if (detected.rank, detected.world_size) == (rank, world_size):
        return detected, group_backend
    info = replace(
        detected,
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        local_world_size=world_size,
        node_rank=0,
    )
    return info, group_backend
