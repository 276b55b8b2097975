"""What this rank is waiting in: collectives, DDP's and FSDP2's backward, tracked live.

While ``distributed()`` runs with the hang doctor on, the collectives of the
``torch.distributed`` namespace (``all_reduce``, ``barrier``, the object
collectives, ...) are replaced by thin wrappers that note in a
:class:`Tracker` which operation the main thread entered and when, and that
it left. Every caller counts: ddpctx's own collectives (which call them
through ``torch.distributed``), the user's raw calls, and ``torch.autograd.backward``
after a forward pass of a DDP model that will synchronise its gradients (DDP's
reducer all-reduces inside ``backward()``; the call site there is inside
autograd, so reports name the user's ``backward()`` line, never a made-up one).
FSDP2 counts the same way: after a sharded root's forward, ``backward()`` is a wait in
its all-gathers/reduce-scatters; its async calls keep raw ``Work`` handles (it checks
their type). On exit the originals are put back.

FSDP2 is not imported for this (it costs 0.7 s of import time, and most jobs never
shard): its root is hooked at install when FSDP2 is already loaded, else by
:func:`hook_fsdp_roots` (``ctx.shard`` calls it), else by the first FSDP2 all-gather
(FSDP2 imported and used by hand inside the block: tracked from the next forward on).

The wrappers cost one function call and two clock reads per collective. They
never look at the stack: where a rank waits is read from its live stack by the
watchdog, only when a report is needed. On NCCL a collective returns before
the GPU has run it, so the wrapper also records a CUDA event after it; the
watchdog counts the rank as waiting until that event completes.

``debug=True`` adds a lockstep check (:mod:`ddpctx.hang.lockstep`) before every
collective, on that collective's own process group; ``send``/``recv`` are
point-to-point and not checked there.

Calls made with ``async_op=True`` return at once; the ``Work`` handle they
return is wrapped so that its ``wait()`` counts as the wait. Names
bound before the block (``from torch.distributed import all_reduce``) bypass
the wrappers.

This module knows torch and nothing of :mod:`ddpctx.session.context`.

Why one module (a little over 400 lines): the wrappers, the backward hooks and the
:class:`Tracker` they write are one protocol -- which wait the main thread is in --
and the lazy FSDP2 hook has to reach into the same install.

Example:
    >>> tracker = Tracker()
    >>> tracker.run("barrier()", lambda: tracker.op)
    'barrier()'
    >>> tracker.op is None, tracker.completed
    (True, 1)
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddpctx.hang.peers import describe, describe_transfer, group_position

#: The blocking collectives of ``torch.distributed`` that are tracked.
TRACKED = (
    "all_reduce",
    "all_reduce_coalesced",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "all_gather_single",  # FSDP2's all-gather and reduce-scatter in torch 2.13
    "reduce_scatter_single",
)
_RAW_ASYNC = frozenset({"all_gather_single", "reduce_scatter_single"})  # handles stay raw
_LABELS = {
    "all_gather_single": "FSDP2 all-gather (all_gather_single())",
    "reduce_scatter_single": "FSDP2 reduce-scatter (reduce_scatter_single())",
}
_FSDP_STATE = "torch.distributed.fsdp._fully_shard._fsdp_state"  # FSDP2's per-module state
#: What a rank inside DDP's ``backward()`` is said to wait in.
DDP_BACKWARD = "DDP backward (gradient all-reduce)"
#: What a rank inside a sharded (FSDP2) model's ``backward()`` is said to wait in.
FSDP_BACKWARD = "FSDP2 backward (all-gather / reduce-scatter)"

_PACKAGES = (
    str(Path(__file__).resolve().parents[1]),  # the ddpctx package
    str(Path(torch.__file__).resolve().parent),
)


class HangError(RuntimeError):
    """The job stopped making progress in a collective; the message is the hang report.

    Raised on every rank by ``distributed(on_hang="raise")`` after the report,
    and at once by ``distributed(debug=True)`` when ranks enter different
    collectives.

    Example:
        >>> str(HangError("ddpctx hang report: ...")).startswith("ddpctx hang report")
        True
    """


def is_library_file(filename: str) -> bool:
    """True for frames of ddpctx, torch and Python's own machinery (not the user's code)."""
    if filename.startswith("<") and not filename.startswith("<doctest"):
        return True
    return filename.startswith(_PACKAGES) or "/lib/python3" in filename


def user_site(frame: FrameType | None) -> str:
    """``file:line in func`` of the innermost frame that is the user's, or ``"?"``."""
    while frame is not None:
        code = frame.f_code
        if not is_library_file(code.co_filename):
            return f"{short_path(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return "?"


def short_path(filename: str) -> str:
    """An installed package's path from the package on; else relative to the working directory.

    >>> short_path("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py")
    'torch/distributed/distributed_c10d.py'
    """
    if "-packages/" in filename:
        return filename.rsplit("-packages/", 1)[1]
    with contextlib.suppress(ValueError):
        relative = Path(filename).resolve().relative_to(Path.cwd())
        return str(relative)
    return filename


@dataclass
class Tracker:
    """This rank's collective thread: the operation it waits in (None: not in one) and since when.

    The collective thread is the one that made the tracker, the thread that
    entered ``distributed()``: the main thread, except where a framework runs
    the training function in a thread of its own (Ray Train does).
    Written by that thread, read by the watchdog thread; single attribute
    writes are atomic in CPython, and a torn read costs at worst one stale
    second.
    """

    op: str | None = None
    peers: tuple[int, ...] | None = None  # the ranks ``op`` waits with (None: every rank)
    since: float = 0.0
    entered: int = 0  # collectives entered, this rank's sequence number
    completed: int = 0
    gpu_pending: tuple[Any, str, float] | None = None  # (CUDA event, op, since)
    failure: HangError | None = None  # set by the watchdog under on_hang="raise"
    backward_sync: str | None = None  # DDP_BACKWARD / FSDP_BACKWARD: the next backward waits
    wait_total: float = 0.0  # seconds the main thread spent waiting, all tracked waits together
    grad_ready: float = 0.0  # when a DDP model's last gradient was ready (its backward's compute)
    thread: int = field(default_factory=threading.get_ident)  # the collective thread's ident

    def run(
        self,
        op: str,
        call: Callable[[], Any],
        *,
        issued: bool = True,
        peers: tuple[int, ...] | None = None,
    ) -> Any:
        """``call()``, marked as a wait in ``op`` (the wrappers inline the same steps).

        ``issued=False`` for the wait on a collective already counted when issued;
        ``peers``: the ranks it waits with, when not every rank.
        """
        self.op, self.peers, self.since = op, peers, time.monotonic()
        if issued:
            self.entered += 1
        try:
            result = call()
        except Exception as error:
            if self.failure is not None:  # the hang was reported; the peers are going
                raise self.failure from error
            raise
        finally:
            self.op = None
            self.completed += 1
            self.wait_total += time.monotonic() - self.since
        if self.failure is not None:  # on_hang="raise": the wait ended, the job still ends
            raise self.failure
        return result

    def waited(self, now: float) -> tuple[str | None, float]:
        """``(op, seconds)`` this rank has waited in, counting GPU work not yet finished."""
        op, since = self.op, self.since
        if op is not None:
            return op, now - since
        pending = self.gpu_pending
        if pending is not None:
            event, gpu_op, gpu_since = pending
            with contextlib.suppress(Exception):
                if not event.query():
                    return f"{gpu_op} (on the GPU)", now - gpu_since
            self.gpu_pending = None
        return None, 0.0


#: Point-to-point operations: they pair two ranks, never checked as collectives of a group.
POINT_TO_POINT = frozenset({"send", "recv"})

#: ``check(op, group, caller)`` before a collective: raises when the ranks differ.
LockstepCheck = Callable[[str, Any, FrameType | None], None]


def install(tracker: Tracker, *, check: LockstepCheck | None, cuda: bool) -> Callable[[], None]:
    """Replace the tracked collectives and ``torch.autograd.backward``; returns the undo.

    Only from the tracker's thread: other threads' collectives (e.g. a user's
    background all-reduce) are passed through untracked. ``check`` (debug
    mode) runs before every collective that is not point-to-point.
    """
    main: int | None = tracker.thread
    originals: dict[tuple[Any, str], Any] = {}

    def replace(owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        originals.setdefault((owner, name), getattr(owner, name))  # the first, true original
        setattr(owner, name, wrapper)

    for name in TRACKED:
        if hasattr(dist, name):
            original = getattr(dist, name)
            checked = None if name in POINT_TO_POINT else check
            replace(dist, name, _collective(tracker, name, original, checked, cuda, main))
    replace(torch.autograd, "backward", _backward(tracker, torch.autograd.backward, cuda, main))
    marks: list[Any] = []  # the gradient hooks put on DDP models' parameters; removed by undo
    replace(
        DistributedDataParallel, "forward", _ddp_forward(tracker, DistributedDataParallel, marks)
    )

    def hook_fsdp() -> bool:
        """Hook FSDP2's root forward once FSDP2 is loaded; True when hooked (now or before)."""
        if hooked:
            return True
        module = sys.modules.get(_FSDP_STATE)
        if module is None:
            return False
        state = module.FSDPState
        replace(state, "_root_pre_forward", _fsdp_root_pre_forward(tracker, state))
        hooked.append(state)
        return True

    hooked: list[type] = []
    if not hook_fsdp():
        _FSDP_HOOKS.append(hook_fsdp)
        for name in _RAW_ASYNC:
            if hasattr(dist, name):
                wrapped = getattr(dist, name)
                replace(dist, name, _hooking_fsdp(wrapped, hook_fsdp))

    def undo() -> None:
        with contextlib.suppress(ValueError):
            _FSDP_HOOKS.remove(hook_fsdp)
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
        for handle in marks:
            handle.remove()

    return undo


def _collective(
    tracker: Tracker,
    name: str,
    original: Callable[..., Any],
    check: LockstepCheck | None,
    cuda: bool,
    main: int | None,
) -> Callable[..., Any]:
    label = _LABELS.get(name, f"{name}()")
    raw_async = name in _RAW_ASYNC
    monotonic, get_ident = time.monotonic, threading.get_ident
    group_at = group_position(original)

    def group_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if "group" in kwargs:
            return kwargs["group"]
        return args[group_at] if group_at is not None and len(args) > group_at else None

    # The steps of Tracker.run, inlined: this runs on every collective of the job.
    @functools.wraps(original)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        if tracker.op is not None or get_ident() != main:
            return original(*args, **kwargs)
        group = group_of(args, kwargs)
        what, peers = (label, None) if group is None else describe(label, group)
        if name in POINT_TO_POINT:
            what, peers = describe_transfer(name, group, args, kwargs)
        if kwargs.get("async_op"):  # the wait happens later, in work.wait()
            if raw_async:
                return original(*args, **kwargs)
            tracker.entered += 1
            if check is not None:
                check(name, group, sys._getframe(1))
            work = original(*args, **kwargs)
            return work if work is None else TrackedWork(work, tracker, what, main, peers)
        tracker.op, tracker.peers, tracker.since = what, peers, monotonic()
        tracker.entered += 1
        try:
            if check is not None:
                check(name, group, sys._getframe(1))
            result = original(*args, **kwargs)
        except Exception as error:
            if tracker.failure is not None:  # the hang was reported; the peers are going
                raise tracker.failure from error
            raise
        finally:
            tracker.op = None
            tracker.completed += 1
            tracker.wait_total += monotonic() - tracker.since
        if tracker.failure is not None:  # on_hang="raise": the wait ended, the job still ends
            raise tracker.failure
        if cuda:
            _note_gpu_work(tracker, what)
        return result

    return tracked


class TrackedWork:
    """A collective's ``Work`` handle whose ``wait()`` counts as waiting in that collective.

    ``async_op=True`` collectives return at once; the wait -- where a hang
    shows -- comes later (ddpctx's own reductions send this way too).
    Everything else is the handle's own.
    """

    __slots__ = ("_label", "_main", "_peers", "_tracker", "_work")

    def __init__(
        self,
        work: Any,
        tracker: Tracker,
        label: str,
        main: int | None,
        peers: tuple[int, ...] | None = None,
    ) -> None:
        self._work, self._tracker, self._label, self._main = work, tracker, label, main
        self._peers = peers

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        tracker = self._tracker
        if tracker.op is not None or threading.get_ident() != self._main:
            return self._work.wait(*args, **kwargs)
        return tracker.run(
            self._label,
            lambda: self._work.wait(*args, **kwargs),
            issued=False,
            peers=self._peers,
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


#: The FSDP2 hooks of installs made before FSDP2 was loaded (see :func:`hook_fsdp_roots`).
_FSDP_HOOKS: list[Callable[[], bool]] = []


def hook_fsdp_roots() -> None:
    """FSDP2 has just been loaded (``ctx.shard``): track its roots' backward from now on."""
    for hook in list(_FSDP_HOOKS):
        if hook():
            _FSDP_HOOKS.remove(hook)


def _hooking_fsdp(tracked: Callable[..., Any], hook_fsdp: Callable[[], bool]) -> Callable[..., Any]:
    """An FSDP2 collective that hooks FSDP2's root forward the first time it runs.

    FSDP2 was loaded by hand inside the block: the forward this all-gather belongs to
    began before the hook (and runs under ``no_grad`` here, so it cannot be told from an
    evaluation); the backward of every later forward is tracked.
    """
    hooked = False

    @functools.wraps(tracked)
    def first(*args: Any, **kwargs: Any) -> Any:
        nonlocal hooked
        if not hooked:
            hooked = hook_fsdp()
        return tracked(*args, **kwargs)

    return first


def _backward(
    tracker: Tracker, original: Callable[..., Any], cuda: bool, main: int | None
) -> Callable[..., Any]:
    get_ident = threading.get_ident

    @functools.wraps(original)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        label = tracker.backward_sync
        if label is None or tracker.op is not None or get_ident() != main:
            return original(*args, **kwargs)
        tracker.backward_sync = None
        tracker.grad_ready = 0.0
        start = time.monotonic()
        result = tracker.run(label, lambda: original(*args, **kwargs))
        if tracker.grad_ready > start:  # the backward's own compute is not a wait for the peers
            tracker.wait_total -= tracker.grad_ready - start
        if cuda:
            _note_gpu_work(tracker, label)
        return result

    return tracked


def _ddp_forward(
    tracker: Tracker, ddp: type[DistributedDataParallel], marks: list[Any]
) -> Callable[..., Any]:
    """DDP's forward, noting that the next backward waits; its parameters note their gradients.

    The time of the last gradient splits that backward into this rank's compute and its
    wait for the others (:mod:`ddpctx.watch.clock`): one hook per parameter, put on at the
    model's first forward and taken off with the install.
    """
    original: Callable[..., Any] = ddp.forward
    marked: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()
    monotonic = time.monotonic

    def ready(_: torch.Tensor) -> None:
        tracker.grad_ready = monotonic()

    @functools.wraps(original)
    def forward(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            tracker.backward_sync = DDP_BACKWARD
            if self not in marked:
                marked.add(self)
                for parameter in self.module.parameters():
                    if parameter.requires_grad:
                        marks.append(parameter.register_post_accumulate_grad_hook(ready))
        return original(self, *args, **kwargs)

    return forward


def _fsdp_root_pre_forward(tracker: Tracker, state: type[Any]) -> Callable[..., Any]:
    original: Callable[..., Any] = state._root_pre_forward

    @functools.wraps(original)
    def root_pre_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if self._is_root and torch.is_grad_enabled():  # looked up per call: any FSDP2 root
            tracker.backward_sync = FSDP_BACKWARD
        return result

    return root_pre_forward


def _note_gpu_work(tracker: Tracker, op: str) -> None:
    """Record a CUDA event after an NCCL collective: it completes when the collective does."""
    cuda: Any = torch.cuda
    if not cuda.is_available() or not cuda.is_initialized():
        return
    event = cuda.Event()
    event.record()
    tracker.gpu_pending = (event, op, time.monotonic())
