"""The hang doctor: a watchdog thread per rank that reports (or ends) a job that stopped moving.

With ``hang_timeout > 0`` every rank runs a
daemon thread that wakes once a second and reads this rank's
:class:`~ddpctx.hang.inflight.Tracker`. When this rank has waited in one collective
for ``hang_timeout`` seconds it opens an *incident* in the job's store; every
rank's thread answers with its main thread's state and stack; rank 0 prints ONE
report to stderr (:mod:`ddpctx.hang.report`). When rank 0 cannot (its main
thread holds the GIL in native code, or the process is stopped), the first
other rank that sees no report within a few seconds prints it, naming the
ranks that did not answer and how long since each last showed life (every
watchdog notes the time in the store at each tick). A rank holding the GIL
cannot answer at all: what it waits in is unknown until it lets go. A rank whose
watchdog could not run for ``STALL_S`` or more (GIL held, stopped, no CPU) and
answers once it runs again says for how long, and the report names that stall
as what the others waited for. The waits that an incident
covered are not reported again, so a slow rank-0 checkpoint write is reported
once and the job goes on (``on_hang="report"``). With ``on_hang="raise"``
every rank then raises :class:`HangError` carrying the report: ranks running
Python get it at once; a rank blocked in native code (a collective whose peer
is stuck, a ``sleep``) writes it to torchrun's error file and exits after a
short grace, which also releases the peers' collectives, whose wrappers raise
the same :class:`HangError`.

"Main thread" here means the thread that entered ``distributed()`` (the
tracker's): the main thread, except under Ray Train, whose training function
runs in a thread of its own.

The thread never raises into a healthy job: any failure of its own (a store
that went away at shutdown) ends the watching, silently. It stops with the
context, before the process group is destroyed, within a bounded time.

Layering: below :mod:`ddpctx.session.context`, which starts it; knows
``torch.distributed``'s store and nothing of decorators.

Its options are resolved by :mod:`ddpctx.hang.settings`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch.distributed.distributed_c10d as c10d

from ddpctx.hang.inflight import HangError, Tracker, install
from ddpctx.hang.lockstep import Lockstep
from ddpctx.hang.report import Exchange, RankState, format_report, snapshot
from ddpctx.hang.settings import HangSettings
from ddpctx.utils.errors import record_for_torchrun

T = TypeVar("T")

#: How often the watchdog wakes (at most once a second, by contract).
TICK_S = 1.0
#: How long rank 0 waits for the other ranks' answers.
ANSWER_WAIT_S = 4.0
#: Under ``on_hang="raise"``: how long a rank gets to raise before it exits.
RAISE_GRACE_S = 3.0
#: How long leaving the context waits for the thread.
STOP_WAIT_S = 5.0
#: A tick this much later than due: the rank could not run Python (the report says so).
STALL_S = 2.0


class Watchdog:
    """The thread of one rank (see the module docstring); :meth:`stop` ends it."""

    def __init__(
        self, settings: HangSettings, tracker: Tracker, store: object, rank: int, world_size: int
    ) -> None:
        self.settings = settings
        self.tracker = tracker
        self.rank = rank
        self.exchange = Exchange(store, rank, world_size)
        self.reports: list[str] = []
        self._stop = threading.Event()
        self._seen = self._before = self.exchange.newest()  # incidents of earlier blocks
        self._covered = -1  # the wait (tracker.entered) that an incident already covered
        self._thread = threading.Thread(target=self._run, name="ddpctx-watchdog", daemon=True)
        self._ticked = time.monotonic()  # when this thread last ran

    def start(self) -> Watchdog:
        self.exchange.beat()  # from the main thread: a rank silent from the start has a time too
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(STOP_WAIT_S)
        if self.settings.on_hang == "raise" and self.tracker.failure is None:
            # An incident of this block not raised here (silent through it, or the block
            # ended while the report was being collected): this rank raises that report too.
            with contextlib.suppress(Exception):
                incident = max(self.exchange.newest(), self._seen)
                deadline = time.monotonic() + ANSWER_WAIT_S + 2 * TICK_S
                while incident > self._before and time.monotonic() < deadline:
                    report = self.exchange.published(incident)
                    if report is not None:
                        self.tracker.failure = HangError(report)
                        record_for_torchrun(self.tracker.failure, os.environ)
                        break
                    time.sleep(0.1)

    def _run(self) -> None:
        try:
            while not self._stop.wait(TICK_S):
                self._tick()
        except Exception:  # the store is gone (shutdown) or broken: stop watching, quietly
            return

    def _tick(self) -> None:
        self.exchange.beat()
        now = time.monotonic()
        # A tick due a second ago that comes seconds late: the GIL was held in native
        # code, the process was stopped or got no CPU; an answer now says so. The stall
        # is the whole time since this thread last ran: it began after that tick, so the
        # gap is never shorter than the stall and longer by less than a tick (a 6 s stall
        # is a gap of 6 to 7 s, reported as "6 s"; the lateness alone said "5 s").
        gap, self._ticked = now - self._ticked, now
        stalled = gap if gap - TICK_S >= STALL_S else 0.0
        op, waited = self.tracker.waited(now)
        newest = self.exchange.newest()
        if newest > self._seen:
            self._handle(newest, stalled)
        elif (
            op is not None
            and waited >= self.settings.hang_timeout
            and self.tracker.entered != self._covered
        ):
            self._handle(self.exchange.open_next(self._seen), stalled)

    def _handle(self, incident: int, stalled: float) -> None:
        self._seen = incident
        op, waited, state = self._state(stalled)
        if op is not None:
            self._covered = self.tracker.entered
        self.exchange.answer(incident, state)
        # Rank 0 reports; when it cannot (GIL held in native code, stopped), the first
        # other rank that finds no report in time does, naming rank 0 as not answering.
        report = self._report(incident) if self.rank == 0 else None
        if report is None:
            report = self._await_report(incident)
        if self.settings.on_hang == "raise":
            if report is None and self._stop.is_set():
                return  # the block ended and no report came: nothing to raise, nothing to say
            own = RankState(self.rank, op, waited, "?", "")
            fallback = format_report([own], self.settings.hang_timeout) + " (no rank sent a report)"
            self._raise(report or fallback)

    def _state(self, stalled: float) -> tuple[str | None, float, RankState]:
        """What the main thread waits in and its stack, read together: ``(op, waited, state)``.

        The main thread runs between two reads of this thread (the store calls
        before an answer release the GIL), so the tracker is read on both sides
        of the stack, up to three times, until no collective was entered or left
        in between: one read made before the stack said "not in a collective"
        under a stack in ``barrier()`` (a rank back from a stall, entering its
        next collective). A main thread that enters and leaves collectives faster
        than that keeps the last reading, at most a collective off its stack.
        """
        tracker = self.tracker
        for _ in range(3):
            moved = tracker.entered, tracker.completed
            op, waited = tracker.waited(time.monotonic())
            peers = tracker.peers if tracker.op is not None else None
            state = snapshot(self.rank, op, waited, peers, stalled, tracker.thread)
            if (tracker.entered, tracker.completed) == moved:
                break
        return op, waited, state

    def _report(self, incident: int, wait_s: float = ANSWER_WAIT_S) -> str | None:
        """Collect, print and publish the report, unless another rank already claimed it.

        ``wait_s``: how long to wait for answers still missing.
        """
        if not self.exchange.claim(incident):
            return None
        states = self.exchange.collect(incident, time.monotonic() + wait_s)
        silent = [rank for rank, state in enumerate(states) if state is None]
        # as of the incident's opening, as the answers' waits are (not of this moment)
        silent_for = self.exchange.silence(silent, self.exchange.opened(incident))
        report = format_report(states, self.settings.hang_timeout, silent_for=silent_for)
        print(report, file=sys.stderr, flush=True)
        self.exchange.publish(incident, report)
        self.reports.append(report)
        return report

    def _await_report(self, incident: int) -> str | None:
        """The published report; this rank writes it when none came in time."""
        deadline = time.monotonic() + ANSWER_WAIT_S + 2 * TICK_S
        claimed = False
        while not self._stop.is_set():
            report = self.exchange.published(incident)
            if report is not None:
                return report
            if time.monotonic() >= deadline:
                if claimed:
                    return None
                claimed = True
                report = self._report(incident, wait_s=TICK_S)  # the others had their time
                if report is not None:
                    return report
                deadline = time.monotonic() + ANSWER_WAIT_S + 2 * TICK_S  # another rank writes
            time.sleep(0.1)
        return self.exchange.published(incident)  # stopping: a report may have come meanwhile

    def _raise(self, report: str) -> None:
        """Make the main thread raise :class:`HangError`; exit if it is blocked in native code.

        Once the block is ending (:meth:`stop` called), the error is only recorded:
        ``distributed()`` raises it as the block's exit, not at a random point of it.
        """
        error = HangError(report)
        self.tracker.failure = error
        record_for_torchrun(error, os.environ)
        if self._stop.is_set():
            return
        # The collective thread (the main thread, or Ray Train's training thread) in a
        # tracked wait raises from the wrapper when the wait ends; otherwise it gets the
        # exception at its next Python instruction.
        if self.tracker.op is None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self.tracker.thread), ctypes.py_object(_raising(report))
            )
        # A rank outside collectives that has not raised is stuck in native code: it goes
        # first, which fails its peers' collectives, whose wrappers then raise. When every
        # rank waits (different collectives), the highest rank goes first.
        grace = RAISE_GRACE_S
        if self.tracker.op is not None:
            grace = 2 * RAISE_GRACE_S + TICK_S * (self.exchange.world_size - 1 - self.rank)
        if self._stop.wait(grace):
            return  # the main thread raised and left the context
        print(
            f"ddpctx: rank {self.rank} is blocked in native code and cannot raise HangError; "
            "exiting (the report is the root cause).",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(1)


def _raising(report: str) -> type[HangError]:
    """A HangError class whose no-argument construction carries ``report``.

    An exception set into another thread must be a class, built without arguments.
    """

    class RaisedHangError(HangError):
        def __init__(self, *args: object) -> None:
            super().__init__(*(args or (report,)))

    RaisedHangError.__name__ = RaisedHangError.__qualname__ = "HangError"
    RaisedHangError.__module__ = HangError.__module__
    return RaisedHangError


class Doctor:
    """The hang doctor of one ``distributed()`` block: trackers installed, thread running.

    ``reports`` holds the reports this rank printed (rank 0 only); :meth:`stop`
    ends the thread and puts torch's functions back, and is safe to call twice.
    :meth:`wait_in` covers ddpctx calls whose collectives torch makes out of the
    trackers' sight.
    """

    def __init__(
        self, settings: HangSettings, rank: int, world_size: int, cuda: bool, track: bool = False
    ) -> None:
        self._undo: Callable[[], None] | None = None
        self._watchdog: Watchdog | None = None
        #: What this rank's main thread waits in, and how many collectives it entered.
        self.tracker: Tracker | None = None
        self._check: Lockstep | None = None
        if not settings.active and not track:  # track: the step timings read the tracker
            return
        tracker = self.tracker = Tracker()
        check = self._check = Lockstep() if settings.debug else None
        self._undo = install(tracker, check=check, cuda=cuda)
        if settings.hang_timeout > 0:
            try:
                store = c10d._get_default_store()
                self._watchdog = Watchdog(settings, tracker, store, rank, world_size)
            except Exception as error:  # a group without a reachable store: watch nothing
                warnings.warn(
                    f"ddpctx's hang doctor is off for this block: the process group's store "
                    f"cannot be used ({error!r}). Pass hang_timeout=0 to silence this.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            else:
                self._watchdog.start()

    def wait_in(self, what: str, call: Callable[[], T], *, checked: bool) -> T:
        """``call()``, counted as one wait in ``what`` for its whole duration.

        For ddpctx calls whose collectives the wrappers of
        :mod:`ddpctx.hang.inflight` cannot see: a sharded model's DTensor
        gathers and reductions go through torch's functional collectives, so a
        rank waiting in one read as "not in a collective". Here it waits in
        ``what`` (e.g. ``ctx.full_state_dict()``), named in the hang report
        with its line; collectives it makes through ``torch.distributed`` count
        as part of it. With ``checked`` (every rank of the default group makes
        the call), debug mode checks it as one collective of that group, so a
        rank that calls it alone fails at once on every rank instead of
        pairing its gathers with another collective. A no-op wrapper off the
        main thread, inside another tracked wait, or with the doctor off.
        """
        tracker = self.tracker
        if tracker is None or tracker.op is not None:
            return call()
        if threading.get_ident() != tracker.thread:
            return call()  # as the wrappers: other threads' collectives are not tracked
        check = self._check if checked else None
        caller = sys._getframe(1)

        def checked_call() -> T:
            if check is not None:
                check(what, None, caller)
            return call()

        result: T = tracker.run(what, checked_call)
        return result

    @property
    def reports(self) -> list[str]:
        return self._watchdog.reports if self._watchdog is not None else []

    @property
    def failure(self) -> HangError | None:
        """The ``on_hang="raise"`` error of this rank, once a report was made."""
        return self._watchdog.tracker.failure if self._watchdog is not None else None

    def stop(self) -> None:
        try:
            if self._watchdog is not None:
                self._watchdog.stop()
        finally:
            if self._undo is not None:
                self._undo()
                self._undo = None
