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
from typing import IO, Any, Literal, TypeVar

import contextlib2
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from ddpctx.checkpoint import (
    atomic_save,
    check_world_size,
    load_file,
    newest_checkpoint,
    next_checkpoint_path,
    prune,
    training_state,
    unwrap_model,
)
from ddpctx.collectives import (
    Site,
    all_gather_objects,
    all_reduce_tree,
    broadcast_object,
    check_op,
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
    exit_on_sigterm,
    init_group,
    record_for_torchrun,
)
from ddpctx.packing import OpSpec
from ddpctx.rankzero import Place, on_rank_zero, zero_first
from ddpctx.report import bar_on_main
from ddpctx.seeding import (
    enable_deterministic,
    rng_state,
    seed_everything,
    set_rng_state,
    validate_seed,
)

T = TypeVar("T")

_current: DistContext | None = None


def current() -> DistContext | None:
    """The active :class:`DistContext`, or None outside ``distributed()``.

    >>> current() is None
    True
    """
    return _current


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
        self._samplers: list[Any] = []

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

    def all_reduce(self, obj: Any, op: OpSpec = "mean", weight: str | None = None) -> Any:
        """Reduce a number, tensor, array or nested dict/list of them across ranks.

        The functional form of :func:`ddpctx.all_reduced` (same options, same
        single collective). Each calling line keeps its own agreed buffer size.

        >>> with distributed() as ctx:
        ...     ctx.all_reduce({"loss": 0.5, "count": 10}, weight="count")
        {'loss': 0.5, 'count': 10}
        """
        check_op(op)
        caller = sys._getframe(1)
        key = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        site = self._sites.setdefault(key, Site(f"all_reduce at {key}"))
        return all_reduce_tree(obj, op, weight, site=site)

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
        **loader_kwargs: Any,
    ) -> DataLoader[Any]:
        """A DataLoader over this rank's shard of ``dataset`` (see :mod:`ddpctx.data`).

        The sampler is seeded with the base seed (the same on every rank, so
        shards are disjoint); :meth:`epochs` advances it. ``pad=False`` gives
        uneven shards without repeated samples (for exact evaluation).
        Workers are seeded per (rank, worker, epoch); your ``worker_init_fn``
        still runs after that.

        >>> with distributed(seed=0) as ctx:
        ...     loader = ctx.dataloader(list(range(10)), batch_size=4, shuffle=True)
        ...     [len(batch) for batch in loader]
        [4, 4, 2]
        """
        loader, sampler = make_dataloader(
            dataset,
            batch_size,
            shuffle=shuffle,
            pad=pad,
            base_seed=self.base_seed or 0,
            rank=self.rank,
            world_size=self.world_size,
            loader_kwargs=loader_kwargs,
        )
        self._samplers.append(sampler)
        return loader

    def epochs(self, n: int, start: int = 0) -> Iterator[int]:
        """Epochs ``start .. n-1``; ``set_epoch`` on every loader before each, a barrier after.

        >>> with distributed() as ctx:
        ...     list(ctx.epochs(3, start=1))
        [1, 2]
        """
        return epochs(n, start, self._samplers, self.barrier)

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
        keep: int = 2,
        **meta: Any,
    ) -> Path:
        """Save the training state and every rank's random state as a new numbered checkpoint.

        Keeps the newest ``keep`` checkpoints; returns the new file's path on every rank.
        ``meta`` (e.g. ``epoch=3``) comes back from :meth:`load_checkpoint`.
        """
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(
                f"keep={keep!r} must be a positive int (how many checkpoints to keep)."
            )
        rng_states = self.all_gather(rng_state())  # every rank's, collected on every rank
        folder = Path(directory)

        def write() -> Path:
            folder.mkdir(parents=True, exist_ok=True)
            path = next_checkpoint_path(folder)
            state = training_state(model, optimizer, scheduler, meta, self.world_size, rng_states)
            atomic_save(state, path)
            prune(folder, keep)
            return path

        _, path = on_rank_zero(self._place(), write, broadcast=True)
        return Path(path)

    def load_checkpoint(
        self,
        directory: str | os.PathLike[str],
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
    ) -> dict[str, Any] | None:
        """Restore the newest complete checkpoint in ``directory``; return its meta, or None.

        Restores the model, optimizer and scheduler, and this rank's random
        state, so the run continues exactly as an uninterrupted one would.
        Checkpoints that do not load are skipped with a warning. A checkpoint
        from a different world size is an error (its random states are per rank).
        """
        folder = Path(directory)
        _, chosen = on_rank_zero(self._place(), lambda: newest_checkpoint(folder), broadcast=True)
        if chosen is None:
            return None
        state = load_file(Path(chosen), self.device, weights_only=True)
        check_world_size(state, Path(chosen), self.world_size)
        unwrap_model(model).load_state_dict(state["model"])
        if optimizer is not None and state["optimizer"] is not None:
            optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"][self.rank])
        meta: dict[str, Any] = dict(state["meta"])
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

    The same script runs under ``torchrun``, under ``srun`` and as a plain
    ``python script.py`` (world size 1).

    Example:
        >>> with distributed(seed=42) as ctx:
        ...     ctx.seed
        42
    """
    return DistributedSession(seed, backend, timeout, deterministic)


@dataclass(frozen=True)
class _Plan:
    info: LaunchInfo
    backend: str
    device: torch.device
    timeout: timedelta
    seed: int | None
    adopted: bool


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
    ) -> None:
        self._seed = seed
        self._backend = backend
        self._timeout = timeout
        self._deterministic = deterministic
        self._cleanup = contextlib2.ExitStack()

    def __enter__(self) -> DistContext:
        global _current
        if _current is not None:
            raise RuntimeError(
                f"distributed() is already active in this process ({_current!r}); nesting "
                "would form a second process group. Use the context you have, or "
                "ddpctx.current() to reach it from deeper code."
            )
        plan = _make_plan(self._seed, self._backend, self._timeout, os.environ)
        with contextlib2.ExitStack() as stack:  # unwinds everything if a step fails
            if plan.device.type == "cuda":
                torch.cuda.set_device(plan.device)
            if not plan.adopted:
                init_group(plan.info, plan.backend, plan.device, plan.timeout)
                stack.callback(destroy_group_bounded)
            restore_handler = exit_on_sigterm(plan.info.rank)
            if restore_handler is not None:
                stack.callback(restore_handler)
            if plan.seed is not None:
                seed_everything(plan.seed + plan.info.rank)
            if self._deterministic:
                stack.callback(enable_deterministic())
            context = DistContext(plan.info, plan.backend, plan.device, plan.seed, self.close)
            _current = context
            stack.callback(_clear_current)
            self._cleanup = stack.pop_all()
        return context

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        try:
            if isinstance(exc, Exception):
                record_for_torchrun(exc, os.environ)
        finally:
            self.close()
        return False

    def close(self) -> None:
        """Undo everything ``__enter__`` did; safe to call more than once."""
        self._cleanup.close()


def _clear_current() -> None:
    global _current
    _current = None


def _make_plan(
    seed: object,
    backend: str | None,
    timeout: float | timedelta | None,
    environ: Mapping[str, str],
) -> _Plan:
    """Every decision and every check, with no side effect."""
    resolved_timeout = resolve_timeout(timeout, environ)
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
