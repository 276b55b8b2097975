"""One thread per logger on rank 0: a logger that hangs or fails holds up no other, nor training.

A :class:`Lane` owns one logger and calls it from its own daemon thread, one
call at a time, in the order the commands came. Contract:

- Points arrive in batches (``put("points", [...])`` from the dispatcher,
  each batch what came in one :data:`~ddpctx.watch.trail.DISPATCH_S`): a built-in logger
  (:class:`~ddpctx.watch.files.FileLogger`) gets the whole batch at once
  (one write; the lines are in the file when it returns), a user's logger one
  ``log_metrics`` per point. While idle the lane ``tick()``s a built-in
  logger every :data:`TICK_S`, so rows held back for a csv header rewrite are
  written within about a second.
- A logger that raises is dropped with a warning naming it (its path, for a
  built-in) and the error; the lane keeps draining so that nobody waits on it.
- A lane whose logger has been inside one call for :data:`STUCK_S` or more
  (or the logger's own ``stuck_after_s``: a tracker that imports its package
  and talks to a server in its first call says a longer time) is *stuck*: a
  checkpoint's flush and the end of the block stop waiting for it
  (warning once, naming that logger only), and points for it beyond
  :data:`QUEUE_LIMIT` waiting are counted, not queued, so training never
  waits on it (nor does memory grow).
  A stuck logger that returns carries on with what is queued.
- :meth:`Lane.wait` waits for a marker as long as the lane makes progress:
  a slow logger is waited for, never cut off while it is still writing --
  unless the logger says a bound (``wait_s``: a tracker whose server is
  outside the job, :mod:`ddpctx.watch.servers`): a checkpoint then waits at
  most ``wait_s`` for all such loggers together (one bound from the
  checkpoint's start, not one per logger in turn), the end of the block
  three times that (warned once), and
  points beyond :data:`QUEUE_LIMIT` for it are counted, never waited for.
- A logger with ``connect()`` gets it first, from its thread, as the block
  starts; one with ``ended(how)`` is told how the block ended
  (``"finished"``, ``"failed"``, ``"killed"``) before ``close()``.
- At the end, a logger that did not get every point is named with the exact
  count: the points never handed to it, plus its own ``unsent`` (points it
  took that its server never confirmed), of all points logged.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ddpctx.utils.warn import warn_user
from ddpctx.watch.files import FileLogger, Point

#: A logger inside one call this long is stuck: nobody waits for it any more.
STUCK_S = 10.0
#: Points queued for one logger before the dispatcher waits (or, for a stuck one, counts them).
QUEUE_LIMIT = 10_000
#: How often an idle lane lets a built-in logger write what it held back.
TICK_S = 0.2

_Command = tuple[str, Any]


class Lane:
    """One logger, its queue and its thread (see the module docstring)."""

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self.dropped = False  # the logger raised: no more calls
        self.warned_stuck = False
        self.received = 0  # points handed to put()
        self.written = 0  # points the logger returned from
        self.lost = 0  # points never queued because the logger was stuck
        self._queue: queue.Queue[_Command] = queue.Queue()
        self._waiting = 0  # points queued, not yet taken by the thread
        self._count_lock = threading.Lock()
        self._busy_since: float | None = None
        self._stuck_after = float(getattr(logger, "stuck_after_s", STUCK_S))
        bound = getattr(logger, "wait_s", None)
        self._wait_s = float(bound) if isinstance(bound, (int, float)) else None
        self.warned_wait = False
        # A tracker that counts what its server lacks (unsent) takes whole batches too.
        self._batched = isinstance(logger, FileLogger) or (
            hasattr(logger, "unsent") and callable(getattr(logger, "write_points", None))
        )
        if callable(getattr(logger, "connect", None)):
            self._queue.put(("connect", ()))
        self._thread = threading.Thread(
            target=self._run, name=f"ddpctx-log-{type(logger).__name__}", daemon=True
        )
        self._thread.start()

    @property
    def named(self) -> str:
        """The logger as its warnings name it: its own repr, else its class (no address)."""
        kind = type(self.logger)
        if getattr(kind, "__repr__", None) is not getattr(object, "__repr__", None):
            return repr(self.logger)
        return kind.__name__

    @property
    def stuck(self) -> bool:
        since = self._busy_since
        return since is not None and time.monotonic() - since >= self._stuck_after

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def put(self, kind: str, payload: Any = None) -> None:
        """Queue a command; points wait while :data:`QUEUE_LIMIT` wait, unless it is stuck."""
        points = len(payload) if kind == "points" else 0
        self.received += points
        while points:
            with self._count_lock:
                if self._waiting == 0 or self._waiting + points <= QUEUE_LIMIT:
                    self._waiting += points
                    break
            if self.stuck or self._wait_s is not None:  # nobody waits on it
                self.lost += points
                return
            time.sleep(0.01)
        self._queue.put((kind, payload))

    def wait(self, done: threading.Event, what: str, started: float | None = None) -> bool:
        """Wait for ``done`` while this lane progresses; False (warned once) when it is stuck.

        A bounded logger's ``wait_s`` counts from ``started`` (the checkpoint's
        start, shared by its lanes: N trackers hold it up ``wait_s``, not N times it).
        """
        started = time.monotonic() if started is None else started
        while not done.wait(0.05):
            if not self._thread.is_alive():
                return done.is_set()
            if self.stuck:
                self.say_stuck(what)
                return False
            if self._wait_s is not None and time.monotonic() - started >= self._wait_s:
                self.say_waited(what, self._wait_s)
                return False
        return True

    def join(self, what: str, started: float | None = None) -> None:
        """Wait for the thread to end after ``close`` while it progresses (or its bound).

        The bound counts from ``started`` (the end of the block's, shared by
        its lanes). Warns with the exact count when the logger did not get
        every point.
        """
        why = "it did not confirm them"
        started = time.monotonic() if started is None else started
        bound = None if self._wait_s is None else 3 * self._wait_s
        while self._thread.is_alive():
            self._thread.join(0.05)
            if not self._thread.is_alive():
                break
            if self.stuck:
                self.say_stuck(what)
                why = "it was stuck in one call"
                break
            if bound is not None and time.monotonic() - started >= bound:
                self.say_waited(what, bound)
                why = f"it was still busy after {bound:g} s"
                # What is counted below stays true: no point is sent after the count
                # (a tracker that can abandon its points still closes its run).
                abandon = getattr(self.logger, "abandon", None)
                if callable(abandon):
                    abandon()
                else:
                    self.dropped = True
                break
        missing = self.received - self.written + int(getattr(self.logger, "unsent", 0))
        if missing > 0:
            maybe = min(missing, int(getattr(self.logger, "maybe_held", 0)))
            unsure = (
                f"; {maybe} of them went out in a request that got no answer in time, so its "
                f"server may hold up to {maybe} of them"
                if maybe
                else ""
            )
            warn_user(
                f"ddpctx left the logger {self.named} behind at the end of the block: "
                f"{missing} of its {self.received} points were never written by it ({why}"
                f"{unsure}). The other loggers have all of them; fix that logger or its server "
                "(or remove it from loggers=) to keep its trail.",
                RuntimeWarning,
            )

    def say_waited(self, what: str, seconds: float) -> None:
        if self.warned_wait:
            return
        self.warned_wait = True
        warn_user(
            f"ddpctx: {what} waited {seconds:g} s for the logger {self.named} (the most it "
            "waits for it) and goes on: what that logger has not written yet is not covered "
            f"by {what}. It keeps writing while the block runs.",
            RuntimeWarning,
        )

    def say_stuck(self, what: str) -> None:
        if self.warned_stuck:
            return
        self.warned_stuck = True
        since = self._busy_since or time.monotonic()
        warn_user(
            f"ddpctx's logger {self.named} has been inside one call for "
            f"{time.monotonic() - since:.0f} s (stuck); {what} goes on without waiting for it. "
            "The other loggers keep writing; this one gets what it missed if it returns. "
            "Fix that logger, or remove it from loggers=.",
            RuntimeWarning,
        )

    def _run(self) -> None:
        while True:
            try:
                command = self._queue.get(timeout=TICK_S)
            except queue.Empty:
                self._call("tick")
                continue
            batch: list[Point] = []
            while command[0] == "points":
                batch.extend(command[1])
                with self._count_lock:
                    self._waiting -= len(command[1])
                try:
                    command = self._queue.get_nowait()
                except queue.Empty:
                    command = ("", None)
            if batch:
                self._write(batch)
            kind, payload = command
            if kind == "flush":
                self._call("flush")
                payload.set()
            elif kind == "close":
                self._call("flush")
                if payload is not None:
                    self._call("ended", payload)
                self._call("close")
                return
            elif kind:
                self._call(kind, *payload)

    def _write(self, batch: list[Point]) -> None:
        if isinstance(self.logger, FileLogger):
            self._call("write_points", batch)
            self.written += len(batch)
            return
        if self._batched:  # a tracker: it counts what its server lacks itself (unsent)
            self.written += len(batch)
            self._call("write_points", batch)
            return
        for step, metrics in batch:
            self._call("log_metrics", metrics, step)
            self.written += 1

    def _call(self, method: str, *args: Any) -> None:
        if self.dropped:
            return
        if method == "tick" and not self._batched:
            return
        call: Callable[..., Any] | None = getattr(self.logger, method, None)
        if call is None:
            return
        self._busy_since = time.monotonic()
        try:
            call(*args)
        except Exception as error:
            self.dropped = True
            warn_user(
                f"ddpctx dropped the logger {self.named}: its {method}() raised {error!r}. "
                "The other loggers go on; fix the logger (or remove it from loggers=) "
                "to keep its trail.",
                RuntimeWarning,
            )
        finally:
            self._busy_since = None
