"""The metrics trail: ``ctx.log``'s steps on every rank, and rank 0's writer.

Every rank keeps the number of the last step logged (``ctx.log(step=None)``
takes the next one), so that a checkpoint records it on every rank and a
resume continues from it. Rank 0 alone writes: the training thread appends
``(step, values)`` to a queue and returns; a dispatcher thread turns the
values into numbers (on CUDA that wait happens there, not in training) and
hands them to each logger's own thread (:mod:`ddpctx.watch.lanes`).

A point wakes nobody: the dispatcher takes what has come every
:data:`DISPATCH_S` and hands each lane the batch at once (one wake-up and one
write per batch, not per step). Waking two threads per step cost rank 0
about 200 us of CPU a step (2 ranks on 2 cores, a loss a step: 518 against
306 us of the process's CPU a call), taken from the ranks' own cores.
Everything else (a flush, the end, a resume, the configuration) wakes the
dispatcher at once, and the commands keep their order.

Exactly once, across a kill and a resume, whatever the order of ``ctx.log``
and ``save_checkpoint`` within a step:

- A checkpoint first *flushes* the trail (every logger has written and
  ``flush()``-ed what was logged), then records the last step logged. What a
  checkpoint covers is durable before the checkpoint exists. A checkpoint
  before the block's first point flushes nothing: no logger is called before
  it has been told how the trail starts (``resume``).
- A ``load_checkpoint`` before this block's first ``ctx.log`` is a *resume*:
  before anything else is written, every logger is told ``resume(step)``.
  When the block's first point comes after the checkpoint's step ``N``, the
  points after ``N`` go (the killed attempt's); when it is at ``N`` itself,
  the block redoes step ``N`` (nanoGPT's "evaluate, checkpoint, train" at one
  step), so the points at ``N`` go too (``resume(N - 1)``). A resume with no
  point before the block ends cuts after ``N``.
- A ``load_checkpoint`` after this block's first ``ctx.log`` (the best
  checkpoint, loaded to evaluate) never cuts: what this attempt wrote stays,
  and the steps go on from the larger of the two.
- A block that logs without such a load starts a fresh trail
  (``resume(None)``); a block that neither logs, loads nor records a config
  leaves the files as they are.
- The run's configuration (``ctx.log_config``) is written when the trail
  starts fresh, whichever comes first, never by a resumed run.

The writer never drops a point silently: the end of the block waits for
every logger while it makes progress, and one that is stuck is left behind
with a warning that says how many points it did not get.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ddpctx.utils.warn import warn_user
from ddpctx.watch import lanes
from ddpctx.watch.lanes import Lane
from ddpctx.watch.metrics import flat_metrics, step_number

#: The checkpoint meta key under which the last logged step travels (popped at load).
META_KEY = "ddpctx_log_step"
#: Points queued before ``ctx.log`` waits for the writer (memory stays bounded).
QUEUE_LIMIT = 10_000
#: How often the dispatcher takes the points that came (a flush or the end: at once).
DISPATCH_S = 0.1

_Command = tuple[str, Any]


class Trail:
    """``ctx.log``'s state on one rank; rank 0 (with loggers) also runs the writer."""

    def __init__(self, loggers: list[Any], writer: bool) -> None:
        #: The last step logged (-1: none yet).
        self.last_step = -1
        self.logged = False  # ctx.log was called in this block
        self._writer = _Writer(loggers) if writer and loggers else None

    def next_step(self, step: object) -> int:
        """The step of this ``ctx.log`` call: ``step``, or one after the last one."""
        if step is None:
            return self.last_step + 1
        try:
            number = step_number(step)
        except TypeError:
            number = -1
        if number < 0:
            raise ValueError(
                f"ctx.log(step={step!r}): a step is a whole number from 0 on (an int, or a "
                "NumPy or torch integer), or None for the one after the last step logged."
            )
        if number < self.last_step:
            raise ValueError(
                f"ctx.log(step={number}) is below the last step logged ({self.last_step}): the "
                "metrics trail only goes forward, so that every step appears once in every "
                "logger (a resumed run continues from its checkpoint's step). Pass a step "
                f">= {self.last_step} (the same step adds metrics to it), or leave step= out."
            )
        return number

    def record(self, step: int, values: Any) -> None:
        self.logged = True
        self.last_step = step
        if self._writer is not None:
            self._writer.put(("metrics", (step, values)))

    def config(self, params: dict[str, Any]) -> None:
        if self._writer is not None:
            self._writer.put(("hparams", params))

    def flush(self) -> None:
        """Wait until everything logged so far is written and flushed (rank 0)."""
        if self._writer is not None:
            self._writer.flush()

    def checkpoint_meta(self) -> dict[str, int]:
        """What a checkpoint records of the trail, after the trail is flushed."""
        self.flush()
        return {META_KEY: self.last_step}

    def restored(self, meta: dict[str, Any] | None) -> None:
        """A checkpoint was loaded (``meta`` its meta, or None: none): resume the trail there."""
        saved = None if meta is None else meta.pop(META_KEY, None)
        step = saved if isinstance(saved, int) and saved >= -1 else None
        if step is None:
            return  # nothing loaded (or no trail in it): the trail goes on as it was
        if self.logged:  # later in the attempt: never cut what this attempt wrote
            if step > self.last_step and self._writer is not None:
                warn_user(
                    "ctx.log was called before load_checkpoint in this block, so its first call "
                    "started a fresh metrics trail: what an earlier attempt logged up to step "
                    f"{step} is gone from the files. This load cuts nothing (the points this "
                    f"block logged stay); ctx.log goes on after step {step}. Call "
                    "load_checkpoint before the first ctx.log to keep an earlier attempt's "
                    "points.",
                    RuntimeWarning,
                )
            self.last_step = max(self.last_step, step)
            return
        self.last_step = step
        if self._writer is not None:
            self._writer.put(("resume", step))

    def close(self, how: str = "finished") -> None:
        """The block ended (``how``: finished, failed, killed): every logger ends, told so."""
        if self._writer is not None:
            self._writer.close(how)


@dataclass
class _Flush:
    """A checkpoint's flush: set once the dispatcher handed a marker to every lane."""

    dispatched: threading.Event = field(default_factory=threading.Event)
    markers: list[tuple[Lane, threading.Event]] = field(default_factory=list)


class _Writer:
    """Rank 0's dispatcher thread and one lane per logger."""

    def __init__(self, loggers: list[Any]) -> None:
        self.lanes = [Lane(logger) for logger in loggers]
        self._commands: deque[_Command] = deque()
        self._wake = threading.Event()
        self._mode: str | None = None  # "fresh" or "resumed" once the loggers were told
        self._resume_at: int | None = None  # a resume's step, until the first point
        self._held_config: dict[str, Any] | None = None
        self._busy_since: float | None = None
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="ddpctx-log-writer", daemon=True)
        self._thread.start()

    def put(self, command: _Command) -> None:
        """Queue a command: a point silently, anything else waking the dispatcher."""
        while len(self._commands) >= QUEUE_LIMIT and self._thread.is_alive():
            self._wake.set()  # full: let it catch up
            time.sleep(0.001)
        self._commands.append(command)  # one append: atomic, and in order
        if command[0] != "metrics":
            self._wake.set()

    def flush(self) -> None:
        marker = _Flush()
        self.put(("flush", marker))
        if not self._wait(marker.dispatched.wait, "the checkpoint"):
            return
        started = time.monotonic()  # one bound for all trackers, not one each in turn
        for lane, done in marker.markers:
            lane.wait(done, "the checkpoint", started)

    def close(self, how: str) -> None:
        self.put(("close", how))
        if not self._wait(self._ended, "the end of the block"):
            return
        started = time.monotonic()
        for lane in self.lanes:
            lane.join("the end of the block", started)

    def _ended(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _wait(self, until: Any, what: str) -> bool:
        """Wait on ``until(timeout)`` while the dispatcher progresses (False: it is stuck)."""
        while not until(0.05):
            if not self._thread.is_alive():
                return True
            since = self._busy_since
            if since is not None and time.monotonic() - since >= lanes.STUCK_S:
                if not self._warned:
                    self._warned = True
                    warn_user(
                        f"ddpctx's metrics writer has been turning one ctx.log call into numbers "
                        f"for {time.monotonic() - since:.0f} s (a device that never finishes?); "
                        f"{what} goes on without waiting for it.",
                        RuntimeWarning,
                    )
                return False
        return True

    def _run(self) -> None:
        while True:
            self._wake.wait(DISPATCH_S)
            self._wake.clear()
            points: list[tuple[int, dict[str, float]]] = []
            while self._commands:
                kind, payload = self._commands.popleft()
                self._busy_since = time.monotonic()
                try:
                    if kind == "metrics":
                        point = self._point(*payload)
                        if point is not None:
                            points.append(point)
                        continue
                    self._hand(points)
                    points = []
                    if self._handle(kind, payload):
                        return
                finally:
                    self._busy_since = None
            self._hand(points)

    def _point(self, step: int, values: Any) -> tuple[int, dict[str, float]] | None:
        """One ``ctx.log`` call as the loggers get it, or None (warned) if it has no numbers."""
        try:
            return step, flat_metrics(values)
        except ValueError as error:
            warn_user(f"ddpctx did not write step {step}: {error}", RuntimeWarning)
            return None

    def _hand(self, points: list[tuple[int, dict[str, float]]]) -> None:
        """Give every lane these points at once (after telling it how the trail starts)."""
        if not points:
            return
        self._start(points[0][0])
        for lane in self.lanes:
            lane.put("points", points)

    def _handle(self, kind: str, payload: Any) -> bool:
        """Carry out one command; True at the end."""
        if kind == "hparams":
            if self._mode is None:
                self._held_config = payload
            elif self._mode == "fresh":
                self._each("log_hparams", payload)
            # a resumed trail never records the configuration again
        elif kind == "resume":
            if self._mode is None:
                self._resume_at = payload
        elif kind == "flush":
            for lane in self.lanes:
                done = threading.Event()
                if self._mode is None:
                    # Nothing reached the loggers yet (a save before this block's first
                    # point): nothing to flush, and a resumed logger hears resume() first.
                    done.set()
                else:
                    lane.put("flush", done)
                payload.markers.append((lane, done))
            payload.dispatched.set()
        elif kind == "close":
            if self._mode is None and (
                self._resume_at is not None or self._held_config is not None
            ):
                self._start(None)
            for lane in self.lanes:
                lane.put("close", payload)
            return True
        return False

    def _start(self, step: int | None) -> None:
        """Tell every logger how the trail starts, before its first point (``step``)."""
        if self._mode is not None:
            return
        resumed = self._resume_at
        if resumed is not None:
            self._mode = "resumed"
            self._held_config = None
            # A first point at the checkpoint's own step redoes that step: its points go too.
            cut = resumed if step is None or step > resumed else step - 1
            self._each("resume", cut)
            return
        self._mode = "fresh"
        self._each("resume", None)
        if self._held_config is not None:
            self._each("log_hparams", self._held_config)
            self._held_config = None

    def _each(self, method: str, argument: Any) -> None:
        for lane in self.lanes:
            lane.put(method, (argument,))
