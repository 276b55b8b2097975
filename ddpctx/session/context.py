"""``distributed()``: one ``with`` block around a whole distributed run.

The contract, in the order things happen on enter:

1. Refuse nesting; check every argument and every launcher variable. All
   validation happens before anything is started, so a bad input leaves no
   process group, handler or flag behind.
2. Pick the backend (``nccl`` with CUDA, else ``gloo``) and the device
   (``cuda:<local_rank>`` or ``cpu``), and pin the device.
3. Form the process group -- always, also for one process (an in-memory
   store, gloo pinned to loopback) -- or adopt one that someone else formed,
   Ray Train's ``TorchTrainer`` for one (:mod:`ddpctx.session.adoption`); it
   is then left alive on exit.
4. Turn SIGTERM (what torchrun sends the survivors when a rank dies) into
   ``SystemExit(143)`` so the clean-up below runs instead of the process
   vanishing mid-write.
5. Seed every generator with ``seed + rank``; optionally turn on
   deterministic algorithms.

On exit, whatever the cause, everything is undone in reverse order, and the
process group is destroyed in bounded time. A rank that leaves normally first
records it in the job's store, so that a peer whose collective then loses it
says why (:mod:`ddpctx.session.departures`). torch's ``[rankN]: `` prefix on
uncaught errors stays for an error leaving the block, and goes after a clean
exit; entering again never stacks a second one. An exception leaving the block is
re-raised unchanged; under torchrun it is first written to
``TORCHELASTIC_ERROR_FILE`` in the format of torch's ``@record``, so the
launcher's report names the failing rank and shows its traceback.

Layering: the session composes the subsystems below it (the pure helpers in
:mod:`ddpctx.utils`, reduction, rank-zero work, data, models, checkpoints and
the hang doctor); launching, the pytest plugin and the command line sit above
it. Code anywhere reaches the active context through :func:`current`, the one
piece of module state.

Example:
    >>> from ddpctx import distributed
    >>> with distributed(seed=0) as ctx:
    ...     (ctx.rank, ctx.world_size, ctx.backend, str(ctx.device))
    (0, 1, 'gloo', 'cpu')
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from types import TracebackType
from typing import Any, Literal, TypeVar, cast

import contextlib2
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ddpctx.hang.inflight import hook_fsdp_roots
from ddpctx.hang.settings import HangSettings, resolve_hang_settings
from ddpctx.hang.watchdog import Doctor
from ddpctx.parallel.precision import Precision, PrecisionName, resolve_precision
from ddpctx.reduce.guard import check_caller, refuse_alone
from ddpctx.reduce.handles import end_of_block
from ddpctx.session.adoption import adopted_device_index, check_backend, launch_info
from ddpctx.session.departures import add_note, departed, departure_note, record_departure
from ddpctx.session.distcontext import DistContext
from ddpctx.session.group import ExceptHook, destroy_group_bounded, init_group, peel_rank_prefix
from ddpctx.session.quiesce import quiesce_gloo_workers
from ddpctx.session.signals import exit_on_sigterm
from ddpctx.session.watching import Watching, resolve_watching, start_watching
from ddpctx.utils.env import LaunchInfo, resolve_backend, resolve_device_index, resolve_timeout
from ddpctx.utils.errors import describe, is_follow_on, record_for_torchrun, should_record
from ddpctx.utils.identity import occupant, occupy
from ddpctx.utils.seeding import enable_deterministic, seed_everything, validate_seed
from ddpctx.watch.straggler import StragglerSettings

T = TypeVar("T")


def current() -> DistContext | None:
    """The active :class:`DistContext`, or None outside ``distributed()``.

    >>> current() is None
    True
    """
    return cast("DistContext | None", occupant())


def distributed(
    seed: int | None = None,
    *,
    backend: str | None = None,
    timeout: float | timedelta | None = None,
    deterministic: bool = False,
    hang_timeout: float | None = None,
    on_hang: Literal["report", "raise"] = "report",
    debug: bool = False,
    precision: PrecisionName = "32",
    log_dir: str | os.PathLike[str] | None = None,
    loggers: Sequence[object] | None = None,
    timings: bool = True,
    straggler: bool | StragglerSettings = True,
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
            (:mod:`ddpctx.hang.watchdog`). Default: ``DDPCTX_HANG_TIMEOUT`` if set,
            else a fifth of ``timeout``, at most 300. ``0`` turns it off.
        on_hang: ``"report"`` (print the report, keep waiting) or ``"raise"``
            (every rank raises :class:`~ddpctx.HangError` carrying the report).
        debug: check before every collective, on its own process group, that
            the group's members are in the same one (one extra two-number
            all-gather each; :mod:`ddpctx.hang.lockstep`). ``send``/``recv``
            are not checked. torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` is
            not turned on (with gloo it makes DDP crash). Also
            ``DDPCTX_DEBUG=collectives``.
        precision: the run's numeric precision, applied by ``ctx.wrap`` and
            ``ctx.shard``: ``"32"`` (default), ``"bf16-mixed"``, ``"16-mixed"``
            (CUDA only) or ``"bf16-true"`` (:mod:`ddpctx.parallel.precision`).
        log_dir: where rank 0 writes what ``ctx.log`` reduces (and ``ctx.profile``'s
            traces). With ``log_dir`` and no ``loggers``: ``("jsonl",)``.
        loggers: ``"jsonl"`` (``metrics.jsonl``), ``"csv"`` (``metrics.csv``),
            ``"tensorboard"`` (``pip install ddpctx[tensorboard]``), or objects with
            ``log_metrics(metrics, step)`` (the ``Logger`` protocol:
            ``from ddpctx.watch import Logger``). After a resume every step appears
            exactly once in each (:mod:`ddpctx.watch.trail`).
        timings: time every step of ``ctx.dataloader``'s iterators by phase (data,
            compute, collective wait) for ``ctx.timings()`` and the straggler report
            (:mod:`ddpctx.watch.clock`).
        straggler: rank 0 prints a straggler report when one rank holds the others
            back (:mod:`ddpctx.watch.straggler`); ``False`` or ``DDPCTX_STRAGGLER=0``
            turns it off, :class:`~ddpctx.StragglerSettings` tunes it.

    The same script runs under ``torchrun``, under ``srun`` and as a plain
    ``python script.py`` (world size 1).

    Example:
        >>> with distributed(seed=42) as ctx:
        ...     ctx.seed
        42
    """
    return DistributedSession(
        seed,
        backend,
        timeout,
        deterministic,
        (hang_timeout, on_hang, debug),
        precision,
        (log_dir, loggers, timings, straggler),
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
    precision: Precision
    watching: Watching


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
        precision: object = "32",
        watch: tuple[Any, Any, Any, Any] = (None, None, True, True),
    ) -> None:
        self._watch = watch
        self._seed = seed
        self._hang = hang
        self._doctor: Doctor | None = None
        self._context: DistContext | None = None
        self._backend = backend
        self._timeout = timeout
        self._deterministic = deterministic
        self._cleanup = contextlib2.ExitStack()
        self._precision = precision
        #: sys.excepthook before the group formed, and the rank-prefixing one torch set.
        self._excepthooks: tuple[ExceptHook, ExceptHook] | None = None

    def __enter__(self) -> DistContext:
        active = current()
        if active is not None:
            raise RuntimeError(
                f"distributed() is already active in this process ({active!r}); nesting "
                "would form a second process group. Use the context you have, or "
                "ddpctx.current() to reach it from deeper code."
            )
        plan = _make_plan(
            self._seed,
            self._backend,
            self._timeout,
            os.environ,
            self._hang,
            self._precision,
            self._watch,
        )
        with contextlib2.ExitStack() as stack:  # unwinds everything if a step fails
            if plan.device.type == "cuda":
                torch.cuda.set_device(plan.device)
            if not plan.adopted:
                before = peel_rank_prefix()
                init_group(plan.info, plan.backend, plan.device, plan.timeout)
                self._excepthooks = (before, sys.excepthook)
                stack.callback(destroy_group_bounded)
                stack.callback(quiesce_gloo_workers)  # after the block's last collective
            cuda = plan.device.type == "cuda"
            doctor = Doctor(
                plan.hang,
                plan.info.rank,
                plan.info.world_size,
                cuda=cuda,
                track=plan.watching.timings,
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
            context = DistContext(
                plan.info, plan.backend, plan.device, plan.seed, self.close, plan.precision
            )
            context._after_shard = hook_fsdp_roots
            context._collective_call = partial(guarded_collective, doctor)
            context._refuse_alone = refuse_alone
            # Occupied before the first collective (start_watching's): collectives belong to
            # the thread that entered, which under Ray Train is not the main thread.
            occupy(context)
            stack.callback(occupy, None)
            start_watching(context, plan.watching, plan.info, plan.device, doctor.tracker, stack)
            stack.callback(end_of_block)  # unread async handles never reach the next block
            stack.callback(context._writer_claims.release)  # after any async save is finished
            self._context = context
            self._cleanup = stack.pop_all()
        return context

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        try:
            context, self._context = self._context, None
            if context is not None and exc is None:  # an async checkpoint in flight: publish it
                context.finish_checkpoint()
                record_departure(_group_store(), context.rank, self._entered())
            elif context is not None:  # failing: wait for this rank's write, never publish it
                with contextlib2.suppress(Exception):
                    context._pending.finish(context._place(), publish=False)
            notes = []
            if exc is not None and context is not None and is_follow_on(describe(exc)):
                left = departed(_group_store(), context.rank, context.world_size)
                note = departure_note(context.rank, self._entered(), left)
                if note:
                    add_note(exc, note)
                    notes.append(note)
            if exc is not None and should_record(exc):
                reports = self._doctor.reports if self._doctor is not None else []
                record_for_torchrun(exc, os.environ, note="\n\n".join([*notes, *reports]))
        finally:
            self._cleanup.__exit__(exc_type, exc, tb)  # the trail tells trackers how it ended
            hooks, self._excepthooks = self._excepthooks, None
            if exc is None and hooks is not None and sys.excepthook is hooks[1]:
                sys.excepthook = hooks[0]  # an error leaving the block keeps its [rankN] prefix
        failure = self._doctor.failure if self._doctor is not None else None
        if exc is None and failure is not None:  # on_hang="raise": the stall ended by itself
            raise failure
        return False

    def close(self) -> None:
        """Undo everything ``__enter__`` did; safe to call more than once."""
        self._cleanup.close()

    def _entered(self) -> int | None:
        """How many collectives this rank entered in the block (None: the doctor is off)."""
        tracker = self._doctor.tracker if self._doctor is not None else None
        return tracker.entered if tracker is not None else None


def guarded_collective(
    doctor: Doctor, what: str, call: Callable[[], T], *, one_wait: bool, everyone: bool
) -> T:
    """A ddpctx call that is a collective (``ctx.shard``, ``ctx.full_state_dict``, ...):
    refused where no other rank can join it; with ``one_wait``, one wait for the doctor."""
    check_caller(what)
    return doctor.wait_in(what, call, checked=everyone) if one_wait else call()


def _group_store() -> object:
    """The default group's store (None when there is none to reach)."""
    try:
        return c10d._get_default_store()
    except Exception:
        return None


def _make_plan(
    seed: object,
    backend: str | None,
    timeout: float | timedelta | None,
    environ: Mapping[str, str],
    hang: tuple[object, object, object] = (None, "report", False),
    precision: object = "32",
    watch: tuple[Any, Any, Any, Any] = (None, None, True, True),
) -> _Plan:
    """Every decision and every check, with no side effect."""
    resolved_timeout = resolve_timeout(timeout, environ)
    hang_settings = resolve_hang_settings(*hang, resolved_timeout.total_seconds(), environ)
    cuda_available = torch.cuda.is_available()
    info = launch_info(environ)
    adopted = dist.is_initialized()
    resolved_backend = (
        check_backend(backend) if adopted else resolve_backend(backend, cuda_available)
    )
    device_index = adopted_device_index(info, cuda_available)
    if device_index is None:
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
        adopted=adopted,
        hang=hang_settings,
        precision=resolve_precision(precision, device),
        watching=resolve_watching(*watch, environ, info.world_size),
    )
