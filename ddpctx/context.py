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
import inspect
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from types import FrameType, TracebackType
from typing import IO, Any, Literal

import contextlib2
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.rendezvous import rendezvous
from torch.nn.parallel import DistributedDataParallel

from ddpctx.collectives import (
    OpSpec,
    Site,
    all_gather_objects,
    all_reduce_tree,
    broadcast_object,
    check_op,
)
from ddpctx.env import (
    Launcher,
    LaunchInfo,
    detect_launch,
    resolve_backend,
    resolve_device_index,
    resolve_timeout,
)
from ddpctx.errors import is_follow_on
from ddpctx.rankzero import Place, zero_first
from ddpctx.seeding import enable_deterministic, seed_everything, validate_seed

#: How long exit waits for ``destroy_process_group`` before giving up on it.
DESTROY_TIMEOUT_S = 30.0

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
        launcher: ``"torchrun"``, ``"slurm"``, ``"mpi"`` or ``"single"``.
        seed: this rank's effective seed (``seed + rank``) or None.
        is_main, is_local_main: rank 0 globally / on this node.
        restart_count: how often an elastic launcher restarted the job.
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
        while True:
            if isinstance(model, DistributedDataParallel):
                model = model.module
            elif isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):
                model = inner
            else:
                return model

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
    """The context manager :func:`distributed` returns; ``__enter__`` yields the context."""

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
                _init_group(plan)
                stack.callback(_destroy_group_bounded)
            restore_handler = _exit_on_sigterm(plan.info.rank)
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
                _record_for_torchrun(exc, os.environ)
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


@contextlib.contextmanager
def loopback_gloo() -> Iterator[None]:
    """Pin gloo's transport to the loopback interface while a group is formed.

    gloo listens on the address the host name resolves to -- often a LAN
    address -- even for one process. Groups ddpctx forms by itself are local,
    so they must not be reachable from the network.
    """
    names = [name for _, name in socket.if_nameindex()]
    loopback = next((n for n in ("lo", "lo0") if n in names), None)
    if loopback is None:  # no loopback interface known by name: nothing to pin
        yield
        return
    previous = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = loopback
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = previous


def init_kwargs(plan_backend: str, device: torch.device, timeout: timedelta) -> dict[str, Any]:
    """Arguments for ``init_process_group`` common to every launcher.

    On CUDA, ``device_id`` binds the group to this rank's GPU (eager NCCL
    init, and no guessing of the device in barriers) where torch supports it.
    """
    kwargs: dict[str, Any] = {"backend": plan_backend, "timeout": timeout}
    if device.type == "cuda" and _init_accepts_device_id():
        kwargs["device_id"] = device
    return kwargs


def _init_accepts_device_id() -> bool:
    return "device_id" in inspect.signature(dist.init_process_group).parameters


def _init_group(plan: _Plan) -> None:
    info = plan.info
    kwargs = init_kwargs(plan.backend, plan.device, plan.timeout)
    if info.world_size == 1:
        with loopback_gloo():
            store = dist.HashStore()  # type: ignore[attr-defined]  # exported, not re-declared
            dist.init_process_group(store=store, rank=0, world_size=1, **kwargs)
        return
    # env:// lets torchrun hand over its own store (TORCHELASTIC_USE_AGENT_STORE).
    url = (
        "env://" if info.launcher == "torchrun" else f"tcp://{info.master_addr}:{info.master_port}"
    )
    store, _, _ = next(
        rendezvous(url, rank=info.rank, world_size=info.world_size, timeout=plan.timeout)
    )
    store.set_timeout(plan.timeout)
    dist.init_process_group(
        store=formation_store(store, info.rank),
        rank=info.rank,
        world_size=info.world_size,
        **kwargs,
    )


def formation_store(store: Any, rank: int) -> Any:
    """A view of ``store`` private to this formation of the process group.

    torch names every default group's keys alike, so a group formed again on
    the same store (a second ``distributed()`` in one torchrun job, a group
    formed after someone else's) can read the previous group's stale addresses
    and fail to connect. Each rank counts its formations in the store itself;
    the count, the same on every rank, prefixes the new group's keys.
    """
    generation = store.add(f"ddpctx/formations/rank{rank}", 1)
    return PrefixStore(f"ddpctx/{generation}/", store)


def _destroy_group_bounded() -> None:
    """Destroy the default group, giving up after ``DESTROY_TIMEOUT_S``.

    Runs in a helper thread so that a backend stuck on a dead peer cannot hold
    the exit path hostage; the process may then exit with the group alive.
    Never raises: an error here must not replace the exception leaving the block.
    """
    failure: list[BaseException] = []

    def destroy() -> None:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException as error:  # reported below, never raised
            failure.append(error)

    worker = threading.Thread(target=destroy, name="ddpctx-destroy", daemon=True)
    worker.start()
    worker.join(DESTROY_TIMEOUT_S)
    if worker.is_alive():
        warnings.warn(
            f"destroy_process_group() did not return within {DESTROY_TIMEOUT_S:.0f} s; "
            "leaving it behind so this process can exit.",
            RuntimeWarning,
            stacklevel=2,
        )
    elif failure:
        warnings.warn(
            f"destroy_process_group() failed: {failure[0]!r}", RuntimeWarning, stacklevel=2
        )


def _exit_on_sigterm(rank: int) -> Callable[[], None] | None:
    """Make SIGTERM raise ``SystemExit(143)`` so clean-up runs; returns the undo.

    Only from the main thread, and only when nobody installed a handler of
    their own. A rank blocked inside a C++ collective runs the handler when
    the collective returns or times out; launchers follow SIGTERM with SIGKILL
    after a grace period (torchrun: 30 s), which bounds that case.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        return None

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends us at once
        builtins.print(
            f"ddpctx: rank {rank} received SIGTERM; leaving distributed() and "
            "destroying the process group.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(128 + signum)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    signal.signal(signal.SIGTERM, on_sigterm)
    return restore


def _record_for_torchrun(exc: BaseException, environ: Mapping[str, str]) -> None:
    """Write ``exc`` where torchrun looks for a worker's error (torch's ``@record`` format).

    torchrun names as root cause the failure with the smallest timestamp, in
    whole seconds. A rank whose collective failed because a peer died usually
    fails within the same second as that peer; its record is dated one second
    later so the rank that failed first is the one named.
    """
    path = environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    follow_on = isinstance(exc, RuntimeError) and is_follow_on(str(exc))
    timestamp = int(time.time()) + (1 if follow_on else 0)
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(
                    traceback.format_exception(type(exc), exc, exc.__traceback__)
                ),
                "timestamp": str(timestamp),
            },
        }
    }
    try:
        with open(path, "w") as handle:
            json.dump(data, handle)
    except OSError as error:
        warnings.warn(
            f"could not write TORCHELASTIC_ERROR_FILE={path!r}: {error}",
            RuntimeWarning,
            stacklevel=2,
        )
