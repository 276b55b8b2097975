"""The metrics trail: ``ctx.log``'s steps on every rank, and rank 0's writer thread.

Every rank keeps the number of the last step logged (``ctx.log(step=None)``
takes the next one), so that a checkpoint records it on every rank and a
resume continues from it. Rank 0 alone writes: the training thread puts
``(step, values)`` on a queue and returns; a daemon thread turns the values
into floats (on CUDA that wait happens there, not in training) and calls the
loggers (:mod:`ddpctx.watch.loggers`), one call at a time.

Exactly once, across a kill and a resume:

- A checkpoint first *flushes* the trail (the queue drained, every logger's
  ``flush()``), then records the last step logged. What a checkpoint covers
  is durable before the checkpoint exists.
- Loading a checkpoint tells every logger ``resume(step)`` before anything
  else is written: the points of the killed attempt after that step go. A run
  that logs before (or without) loading one starts a fresh trail
  (``resume(None)``).
- The run's configuration (``ctx.log_config``) is written when the trail
  starts fresh, never again by a resumed run.

A logger that raises is dropped with a warning naming it and the error;
training goes on, and the other loggers keep writing.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable
from typing import Any

from ddpctx.utils.warn import warn_user
from ddpctx.watch.loggers import flat_metrics

#: The checkpoint meta key under which the last logged step travels (popped at load).
META_KEY = "ddpctx_log_step"
#: Points queued before ``ctx.log`` waits for the writer (memory stays bounded).
QUEUE_LIMIT = 10_000
#: How long a checkpoint waits for the trail to flush before it warns and goes on.
FLUSH_WAIT_S = 120.0

_Command = tuple[str, Any, Any]


class Trail:
    """``ctx.log``'s state on one rank; rank 0 (with loggers) also runs the writer."""

    def __init__(self, loggers: list[Any], writer: bool) -> None:
        #: The last step logged (-1: none yet).
        self.last_step = -1
        self.logged = False  # ctx.log was called in this block
        self._config: dict[str, Any] | None = None
        self._writer = _Writer(loggers) if writer and loggers else None

    def next_step(self, step: int | None) -> int:
        """The step of this ``ctx.log`` call: ``step``, or one after the last one."""
        if step is None:
            return self.last_step + 1
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(
                f"ctx.log(step={step!r}): a step is a whole number from 0 on (or None for "
                "the one after the last step logged)."
            )
        if step < self.last_step:
            raise ValueError(
                f"ctx.log(step={step}) is below the last step logged ({self.last_step}): the "
                "metrics trail only goes forward, so that every step appears once in every "
                "logger (a resumed run continues from its checkpoint's step). Pass a step "
                f">= {self.last_step} (the same step adds metrics to it), or leave step= out."
            )
        return step

    def record(self, step: int, values: Any) -> None:
        self.logged = True
        self.last_step = step
        if self._writer is not None:
            self._writer.put(("metrics", step, values))

    def config(self, params: dict[str, Any]) -> None:
        if self._writer is not None:
            self._writer.put(("hparams", params, None))

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
        step = saved if isinstance(saved, int) and saved >= 0 else None
        if self.logged and step is not None and self._writer is not None:
            warn_user(
                f"ctx.log was called before load_checkpoint: the metrics trail started afresh, "
                f"so what an earlier attempt logged up to step {step} is gone from the files. "
                "Call load_checkpoint before the first ctx.log to keep it.",
                RuntimeWarning,
            )
        self.last_step = -1 if step is None else step
        if self._writer is not None:
            self._writer.put(("resume", step, None))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class _Writer:
    """Rank 0's daemon thread that calls the loggers."""

    def __init__(self, loggers: list[Any]) -> None:
        self.loggers = list(loggers)
        self._queue: queue.Queue[_Command] = queue.Queue(QUEUE_LIMIT)
        self._started = False  # every logger was told resume(...)
        self._held_config: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, name="ddpctx-log-writer", daemon=True)
        self._thread.start()

    def put(self, command: _Command) -> None:
        self._queue.put(command)

    def flush(self) -> None:
        done = threading.Event()
        self._queue.put(("flush", done, None))
        if not done.wait(FLUSH_WAIT_S):
            warnings.warn(
                f"ddpctx's metrics writer did not flush within {FLUSH_WAIT_S:.0f} s (a logger "
                f"is stuck: {self.loggers!r}); the checkpoint goes on without waiting for it.",
                RuntimeWarning,
                stacklevel=4,
            )

    def close(self) -> None:
        self._queue.put(("close", None, None))
        self._thread.join(timeout=FLUSH_WAIT_S)

    def _run(self) -> None:
        while True:
            kind, first, second = self._queue.get()
            if kind == "metrics":
                self._start(None)
                self._each("log_metrics", flat_metrics(second), first)
            elif kind == "hparams":
                self._held_config = first
                if self._started:
                    self._write_config()
            elif kind == "resume":
                self._held_config = None if first is not None else self._held_config
                self._started = False
                self._start(first)
            elif kind == "flush":
                self._each("flush")
                first.set()
            elif kind == "close":
                self._start(None)
                self._each("flush")
                self._each("close")
                return

    def _start(self, step: int | None) -> None:
        if self._started:
            return
        self._started = True
        self._each("resume", step)
        if step is None:
            self._write_config()

    def _write_config(self) -> None:
        if self._held_config is not None:
            self._each("log_hparams", self._held_config)
            self._held_config = None

    def _each(self, method: str, *args: Any) -> None:
        for logger in list(self.loggers):
            call: Callable[..., Any] | None = getattr(logger, method, None)
            if call is None:
                continue
            try:
                call(*args)
            except Exception as error:
                self.loggers.remove(logger)
                warnings.warn(
                    f"ddpctx dropped the logger {logger!r}: its {method}() raised {error!r}. "
                    "The other loggers go on; fix the logger (or remove it from loggers=) "
                    "to keep its trail.",
                    RuntimeWarning,
                    stacklevel=1,
                )
