"""Who may start a ddpctx collective: refused at once where no other rank can ever join it.

A collective pairs with the collective the other ranks issue at the same
position of their own sequence. Three callers can never be paired rightly, so
every ddpctx collective (``@all_reduced``, ``ctx.all_reduce``, ``ctx.barrier``,
``ctx.any``/``all``, ``ctx.broadcast``, ``ctx.all_gather``, the object
collectives below checkpoints and rank-zero work) checks its caller first,
before anything is sent, and raises a ``RuntimeError`` naming the call, where
it was made, and the fix:

- **Another thread.** Collectives from two threads of one process enter the
  process group in an order that differs between ranks (threads interleave
  differently on each), so a reduction pairs with another thread's reduction
  on another rank: a wrong number, no error (or, for different layouts, an
  abort). A lock per call site cannot help, and waiting for the other thread
  cannot either. So one thread owns the process's ddpctx collectives: the
  thread that entered ``distributed()`` (outside it, the main thread). Every
  other thread is refused on its first call, on every rank alike -- the rule
  depends on no timing -- and nothing it would have sent is sent. Reading
  an async handle (``.result()``) that still has to communicate counts as a
  collective too.
- **A DataLoader worker.** A worker is a process of its own (forked or
  spawned): it is not a rank, the other ranks never join it, and a spawned
  worker has no process group, so it would reduce alone and return its own
  value. ``torch.utils.data.get_worker_info()`` tells a worker apart.
- **Any other forked process** (``os.fork``, a ``multiprocessing`` pool
  with the fork start method). Its forking thread keeps its thread id, but
  it is no rank either: its collectives would write into the rank's own
  connections. The pid of the process that entered ``distributed()`` tells
  it apart.
- **Rank-zero-only work.** Inside a ``@rank_zero_only`` function, a
  ``ctx.rank_zero()`` block (or ``ctx.atomic_dir``) and the first run of a
  ``rank_zero_first`` block, only rank 0 (or each node's local rank 0) runs
  the code; the others are elsewhere. :func:`running_alone` marks such code
  (the rank-zero subsystem writes it, this layer reads it). Refused at every
  world size, so a script meets the error on one process already.

The check costs one thread id and one pid comparison and two attribute reads
per collective (well under a microsecond).

Some calls are no collective, yet must not run in rank-zero work either:
what they change is every rank's to change alike (DDP's ``ctx.clip_grad_norm_``
would scale rank 0's gradients alone and the replicas would part), or they
may issue collectives of torch's own (a DDP or sharded model's forward).
:func:`refuse_alone` refuses those, in rank-zero work only, with the caller's
reason and fix.

Example:
    >>> with running_alone("function", "rank_zero_only function 'save'"):
    ...     try:
    ...         check_caller("ctx.barrier()")
    ...     except RuntimeError as error:
    ...         print(str(error).split(" (at ")[0])
    ctx.barrier() was called inside rank_zero_only function 'save'
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import torch
from torch.utils.data import get_worker_info

from ddpctx.utils.identity import collective_process, collective_thread, occupant

_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep


class _Alone(threading.local):
    """What this thread runs on its own, innermost last: ``(kind, what)`` pairs; ``kind`` is
    ``"function"`` (a rank-zero function's body, a rank-zero block) or ``"first"`` (the first
    run of a ``rank_zero_first`` block), ``what`` names it for error messages."""

    def __init__(self) -> None:
        self.kinds: list[tuple[str, str]] = []


_alone = _Alone()
_get_ident = threading.get_ident
_getpid = os.getpid


@contextlib.contextmanager
def running_alone(kind: str, what: str = "") -> Iterator[None]:
    """Mark the enclosed code as run by this rank alone (see the module docstring).

    >>> with running_alone("function", "a rank_zero() block"):
    ...     inside_rank_zero_work()
    'function'
    """
    _alone.kinds.append((kind, what or "a rank-zero-only function"))
    try:
        yield
    finally:
        _alone.kinds.pop()


def inside_rank_zero_work() -> str | None:
    """``"function"`` or ``"first"`` while rank-zero work runs on this thread, else None."""
    return _alone.kinds[-1][0] if _alone.kinds else None


def check_caller(what: str) -> None:
    """Raise if this caller can never be joined by the other ranks (see the module docstring).

    ``what`` names the call, e.g. ``"all_reduced(train.evaluate)"`` or ``"ctx.barrier()"``.
    """
    owner = collective_thread()
    process = collective_process()
    if (
        _get_ident() != owner.ident
        or _alone.kinds
        or get_worker_info() is not None
        or (process is not None and process != _getpid())
    ):
        _refuse(what, owner)


def refuse_alone(what: str, why: str) -> None:
    """Raise if rank-zero work runs on this thread: ``what`` must run on every rank or none.

    ``why`` completes "Only rank 0 ... runs that code alone, so ...": the harm and the fix.

    >>> with running_alone("function", "a ctx.rank_zero() block"):
    ...     try:
    ...         refuse_alone("model(...)", "nobody joins it. Call it on every rank.")
    ...     except RuntimeError as error:
    ...         print(str(error).split(" (at ")[0])
    model(...) was called inside a ctx.rank_zero() block
    """
    if _alone.kinds:  # dynamo traces this read (a compiled forward calls it): no graph break
        if torch.compiler.is_compiling():  # the frame walk is no code to trace
            torch.compiler.disable(_refuse_alone)(what, why)  # type: ignore[no-untyped-call]
        _refuse_alone(what, why)


def _refuse_alone(what: str, why: str) -> None:
    kind, block = _alone.kinds[-1]
    runs = "first, before the others run it" if kind == "first" else "alone"
    raise RuntimeError(
        f"{what} was called inside {block} (at {_user_line(what)}). Only rank 0 (or each "
        f"node's local rank 0) runs that code {runs}, so {why}"
    )


def _refuse(what: str, owner: threading.Thread) -> None:
    where = _user_line(what)
    worker = get_worker_info()
    if worker is not None:
        raise RuntimeError(
            f"{what} was called in DataLoader worker {worker.id} (at {where}). A worker is "
            "a process of its own, not a rank: the other ranks never join its collectives "
            "(and a spawned worker has no process group at all). Reduce in the training "
            "loop, on the values the loader returns, not inside the dataset or collate_fn."
        )
    process = collective_process()
    if process is not None and process != _getpid():
        raise RuntimeError(
            f"{what} was called in process {_getpid()}, which rank process {process} forked "
            f"(at {where}). A forked process is not a rank: the other ranks never join its "
            "collectives, and it would write into the rank's own connections. Reduce in the "
            "rank's process, on the values the child hands back (a pipe, a multiprocessing "
            "queue)."
        )
    if _alone.kinds:
        kind, block = _alone.kinds[-1]
        runs = "first, before the others run it" if kind == "first" else "alone"
        raise RuntimeError(
            f"{what} was called inside {block} (at {where}). Only rank 0 (or each node's "
            f"local rank 0) runs that code {runs}, so the other ranks never join this "
            "collective and every rank would wait until the timeout. Call it before or "
            "after the rank-zero work, on every rank."
        )
    this = threading.current_thread()
    raise RuntimeError(
        f"{what} was called from thread {this.name!r} (at {where}), but this process's "
        f"ddpctx collectives belong to thread {owner.name!r}, "
        + ("which entered distributed(). " if occupant() is not None else "the main thread. ")
        + "Collectives from two threads enter the process group in an order that differs "
        "between ranks, so a reduction would pair with another thread's on another rank "
        f"(a wrong number, no error). Issue every collective from {owner.name!r} (hand "
        "the values to it, e.g. through a queue), or enter distributed() in the thread "
        "that issues them."
    )


def _user_line(what: str) -> str:
    """``file:line in func`` of the innermost frame outside ddpctx and torch, or ``"?"``;
    with the ddpctx function it called when that is not ``what`` itself (a checkpoint
    save that gathers, say)."""
    frame: FrameType | None = sys._getframe(2)
    callee = ""
    while frame is not None:
        code = frame.f_code
        name = code.co_filename
        if not name.startswith(_PACKAGE) and "/torch/" not in name and "/contextlib" not in name:
            through = (
                f", through {callee}()"
                if callee and callee not in what and callee != "wrapper"
                else ""
            )
            return f"{name}:{frame.f_lineno} in {code.co_name}{through}"
        if name.startswith(_PACKAGE):
            callee = code.co_name
        frame = frame.f_back
    return "?"
