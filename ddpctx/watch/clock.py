"""Per-rank phase timings of every step, from what ddpctx already sees: no user code.

What a *step* is:

- With an optimizer (any ``torch.optim`` optimizer, seen through torch's global
  step hooks): from the end of one ``optimizer.step()`` to the end of the
  next. Micro-batches of gradient accumulation (``ctx.no_sync``,
  ``ctx.accumulate``) are one step, so the step that all-reduces shows the
  wait for the others (the batches before the first optimizer step, when no
  optimizer was seen yet, are steps of their own). The first step begins at
  the first batch asked of ``ctx.dataloader`` or, in a loop that never uses
  it, at the first forward of a model from ``ctx.wrap`` / ``ctx.shard``. A
  step still open when a ``ctx.dataloader`` pass ends (evaluation, a pass
  cut short) is no step, and the next pass's first batch request begins the
  next: forwards between passes begin none.
- Without one (an evaluation loop): the span from asking ``ctx.dataloader``'s
  iterator for a batch to asking it for the next (a pass's last step ends
  when the iterator is exhausted; the gap between two passes belongs to no
  step).

Each step is split into three phases:

- **collective**: time the main thread waited in collectives, read from the
  hang doctor's :class:`~ddpctx.hang.inflight.Tracker` (every
  ``torch.distributed`` collective, ddpctx's own, and DDP's gradient
  all-reduce inside ``backward()`` -- the part of the backward after this
  rank's last gradient was ready, which is the wait for the other ranks);
- **data**: with ``ctx.dataloader``, the time its iterator took to hand the
  batches over (workers, ``collate_fn``, the copy to the device). In a loop
  that reads its own batches (a memmap, a stream), the rest of the step:
  whatever is not the forward of a ``ctx.wrap``/``ctx.shard`` model,
  ``backward()``, ``optimizer.step()`` or a collective wait;
- **compute**: with ``ctx.dataloader``, the rest; without, forward + backward
  + optimizer step, less their collective waits.

Those spans (forward, backward, optimizer step) are timed by hooks only until
the first ``ctx.dataloader`` pass begins: from then on its hand-overs are the
data phase, and the hooks, which would time nothing used, come off (a few
microseconds each a step). A loop of its own batches after that has its whole
step, less collective waits, as compute.

Each step also records the main thread's wait for a CPU (the run-queue delay
of ``/proc/thread-self/schedstat``; 0 where the kernel does not say): a
rank whose steps stretch because other processes hold the CPU is *starved*,
not slow (:mod:`ddpctx.watch.straggler`). That file costs ~6 us a read in a
training loop (more than the rest of the clock's step together), so it is read
at most every :data:`SCHEDSTAT_EVERY_S` (and when a pass ends or a step begins
after a gap), and the delay since the last read is shared evenly by the steps
closed meanwhile: a step's wait for a CPU is the average over its ~10 ms.

Durations only, from ``time.monotonic`` on each host, so clocks of different
hosts never meet. On CUDA the host returns before the GPU has run the work:
``StepClock(cuda=True)`` closes a step with a CUDA event and reads the step's
GPU time when that event has completed (one step later, never a sync), so the
compute phase is what the GPU spent rather than what the host queued.

The clock keeps the last ``window`` steps. Its cost is a few clock reads,
one read of the schedstat file and a few additions per step.

Why one module (past 400 lines): the clock is one state machine -- a step
opened by a loader's request, a model's forward or an optimizer step, closed
by the next -- and its hooks (:meth:`StepClock.install`,
:meth:`StepClock.watch_model`) only forward events into that state.

Example:
    >>> clock = StepClock(window=4)
    >>> for batch in clock.timed(iter([1, 2, 3])):
    ...     pass
    >>> clock.count, len(clock.recent())
    (3, 3)
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from ddpctx.hang.inflight import Tracker

T = TypeVar("T")

#: The phases of a step, in report order.
PHASES = ("data", "compute", "collective")

#: Where the kernel says how long this thread waited for a CPU (second field, nanoseconds).
SCHEDSTAT = "/proc/thread-self/schedstat"

#: Seconds between reads of :data:`SCHEDSTAT` while steps follow one another.
SCHEDSTAT_EVERY_S = 0.01


@dataclass(frozen=True)
class StepTime:
    """One step of one rank, in seconds: ``data + compute + collective == step``.

    ``starved``: of the step, the time the main thread was ready to run but had no CPU.
    """

    data: float
    compute: float
    collective: float
    starved: float = 0.0

    @property
    def step(self) -> float:
        return self.data + self.compute + self.collective


@dataclass(frozen=True)
class PhaseTimes:
    """One rank's median step over a window, in seconds, and where it was measured.

    Example:
        >>> PhaseTimes(rank=1, host="node-a", steps=50, data=0.001, compute=0.02,
        ...            collective=0.004).own
        0.021
    """

    rank: int
    host: str
    steps: int  # steps this rank has measured since the block began
    data: float
    compute: float
    collective: float
    step: float = 0.0  # median whole step (not the sum of the phase medians)
    starved: float = 0.0  # median wait for a CPU per step (0: none, or not measurable)

    @property
    def own(self) -> float:
        """The time the rank spends on its own work (data + compute), not waiting for others."""
        return self.data + self.compute

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def as_metrics(self) -> dict[str, float]:
        """Milliseconds by phase, for ``ctx.log``.

        >>> PhaseTimes(0, "h", 1, 0.001, 0.002, 0.0005, 0.0035).as_metrics()["data_ms"]
        1.0
        """
        return {
            f"{name}_ms": 1000.0 * getattr(self, name) for name in ("data", *PHASES[1:], "step")
        }


@dataclass(slots=True)
class _Open:
    """The step being measured: when it began and what it has gathered so far."""

    start: float
    waited: float  # the tracker's wait total at the start
    loader: float = 0.0  # seconds ``ctx.dataloader`` took to hand batches over
    fed: bool = False  # a ``ctx.dataloader`` batch was handed over in this step
    work: float = 0.0  # seconds in forward, backward and optimizer step
    work_wait: float = 0.0  # of which, collective wait


class StepClock:
    """This rank's step timings (see the module docstring)."""

    def __init__(
        self,
        tracker: Tracker | None = None,
        window: int = 50,
        *,
        cuda: bool = False,
        event_factory: Callable[[], Any] | None = None,
        schedstat: str | None = SCHEDSTAT,
    ) -> None:
        self.tracker = tracker
        self.window = window
        self.count = 0  # steps closed since the block began
        self._steps: deque[tuple[float, float, float, float]] = deque(maxlen=max(window, 1))
        self._lock = threading.Lock()  # the publishing thread reads while the main thread writes
        self._open: _Open | None = None
        self._cuda = cuda
        #: Makes the events that close steps on CUDA (default: ``torch.cuda.Event``).
        self.event_factory = event_factory
        self._gpu: deque[tuple[Any, Any, float, float, float]] = deque()
        self._last_event: Any = None  # the CUDA event that closed the previous step
        self.opened = 0  # steps begun since the block began
        #: Called with a step's number (from 0) as it begins: ``ctx.profile`` starts and stops.
        self.listeners: list[Callable[[int], None]] = []
        #: True once an optimizer step was seen: steps end at optimizer steps from then on.
        self.by_optimizer = False
        #: A backward or an optimizer step was seen: training, timed or not (a forward
        #: alone is an evaluation, which a block may run without any step to time).
        self.trained = False
        #: A ``ctx.dataloader`` pass began: its requests, not forwards, begin steps.
        self.fed = False
        self._depth = 0  # nesting of work spans (an optimizer step inside a forward...)
        self._span: tuple[float, float] = (0.0, 0.0)  # the outermost span's (start, waited)
        # the thread that entered distributed() (Ray Train's training thread is not the main one)
        self._main = threading.get_ident()
        self._schedstat: int | None = None
        if schedstat is not None and threading.get_ident() == self._main:
            with contextlib.suppress(OSError):  # the main thread's file, whoever reads it
                self._schedstat = os.open(schedstat, os.O_RDONLY)
        self._delay = 0.0  # the run-queue delay at the last read
        self._read_at = -SCHEDSTAT_EVERY_S  # when (monotonic) it was read
        self._unsettled = 0  # steps kept since, their wait for a CPU not yet given
        self._undo: list[Callable[[], None]] = []
        self._models: list[weakref.ref[nn.Module]] = []  # given to watch_model
        self._spans_on: Callable[[], None] | None = None  # puts the span hooks on (install)
        self._spanning = False  # the span hooks are on
        self._passes = 0  # ctx.dataloader passes running

    # -- what the clock is told ------------------------------------------------------------

    def timed(self, batches: Iterable[T]) -> Iterator[T]:
        """``batches``, each hand-over timed as data wait (and, with no optimizer, a step)."""
        iterator = iter(batches)
        monotonic = time.monotonic
        self.fed = True
        self._passes += 1
        if self._spanning:  # in a pass the forward, backward and optimizer spans go unused:
            self.close()  # its hand-overs are the data phase; their hooks come off (~3 us each)
        try:
            while True:
                start = monotonic()
                closed = self._close(start) if not self.by_optimizer else None
                try:  # asking for the next batch ended the step (with no optimizer)
                    batch = next(iterator)
                except StopIteration:
                    return
                if not self.by_optimizer or self._open is None:
                    self._begin(start, closed)
                opened = self._open
                if opened is not None:
                    opened.loader += monotonic() - start
                    opened.fed = True
                yield batch
        finally:
            self._passes -= 1
            self._open = None  # a pass ended or left early: its open step is not a step
            self._last_event = None  # nor is the gap to the next pass
            self._settle(monotonic())  # the steps' wait for a CPU, not the gap's

    def enter(self) -> None:
        """A forward, backward or optimizer step begins (main thread only)."""
        if threading.get_ident() != self._main:
            return
        if self._depth == 0 and (opened := self._open) is not None and opened.fed:
            return  # a ctx.dataloader step's phases need no span (and leave() sees depth 0)
        self._depth += 1
        if self._depth == 1:
            now = time.monotonic()
            if self._open is None and not self.fed:  # a loop of its own batches
                self._begin(now)
            self._span = (now, self._waited())

    def leave(self) -> None:
        """The span :meth:`enter` began ends."""
        if threading.get_ident() != self._main or self._depth == 0:
            return
        self._depth -= 1
        opened = self._open
        if self._depth == 0 and opened is not None:
            start, waited = self._span
            opened.work += time.monotonic() - start
            opened.work_wait += self._waited() - waited

    def optimizer_stepped(self, leaving: bool = False) -> None:
        """An ``optimizer.step()`` ended: the step ends here and the next begins.

        ``leaving``: the step's span ends too (:meth:`leave` first; one call per step).
        """
        if threading.get_ident() != self._main:
            return
        self.trained = True
        if leaving and self._depth:
            self.leave()
        if not self._spanning and not self._passes:  # a loop of its own batches (again)
            self._spans_resume()
        now = time.monotonic()
        self.by_optimizer = True
        self._begin(now, self._close(now))  # one read of the counters for both

    # -- hooks -----------------------------------------------------------------------------

    def install(self) -> Callable[[], None]:
        """Watch every optimizer step and ``torch.autograd.backward``; returns the undo."""
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        def pre(*_: Any) -> None:
            self.enter()

        def post(*_: Any) -> None:
            self.optimizer_stepped(leaving=True)

        handles = [register_optimizer_step_post_hook(post)]
        original = torch.autograd.backward

        @functools.wraps(original)
        def backward(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self._main:
                self.trained = True
            self.enter()
            try:
                return original(*args, **kwargs)
            finally:
                self.leave()

        def spans_on() -> None:  # the spans' hooks: while no ctx.dataloader pass runs
            handles.append(register_optimizer_step_pre_hook(pre))
            if torch.autograd.backward is original:
                torch.autograd.backward = backward

            def spans_off() -> None:
                handles.pop().remove()
                if torch.autograd.backward is backward:
                    torch.autograd.backward = original

            self._undo.append(spans_off)

        self._spans_on = spans_on
        self._spans_resume()

        def undo() -> None:
            for handle in handles:
                handle.remove()
            if torch.autograd.backward is backward:
                torch.autograd.backward = original
            if self._schedstat is not None:
                with contextlib.suppress(OSError):
                    os.close(self._schedstat)
                self._schedstat = None

        return undo

    def watch_model(self, model: object) -> None:
        """Time ``model``'s forward (a model from ``ctx.wrap`` or ``ctx.shard``).

        Only while no ``ctx.dataloader`` pass runs: in one, its batches begin
        steps and its hand-overs are the data phase, and a forward's hooks
        (torch's slower call path, and a few microseconds of ours) would
        measure nothing. They come back when a loop of its own batches steps
        the optimizer again.
        """
        if not isinstance(model, nn.Module):
            return
        self._models.append(weakref.ref(model))
        if self._spanning:
            self._hook(model)

    def _hook(self, model: nn.Module) -> None:
        """The forward span hooks on ``model`` (taken off by :meth:`close`)."""

        def pre(*_: Any) -> None:
            self.enter()

        def post(*_: Any) -> None:
            self.leave()

        if _compiled(model):
            # Run as plain Python in the compiled forward: a hook dynamo traced would break
            # its graph at every call (threading.get_ident is opaque to it). Only then: a
            # disabled hook costs about 25 us a call (three a step), and dynamo is loaded
            # by DDP itself, so its presence says nothing about this model.
            disable = torch.compiler.disable
            pre, post = disable(pre), disable(post)  # type: ignore[no-untyped-call]

        handles = [
            model.register_forward_pre_hook(pre),
            model.register_forward_hook(post, always_call=True),
        ]
        self._undo.extend(handle.remove for handle in handles)

    def close(self) -> None:
        """Take the hooks off the models :meth:`watch_model` was given, and the span hooks
        (``backward`` and the optimizer's pre-step) off torch; the optimizer's post-step
        hook, which ends steps, stays until :meth:`install`'s undo."""
        self._spanning = False
        undo, self._undo = self._undo, []
        for remove in undo:
            remove()

    def _spans_resume(self) -> None:
        """The span hooks back on (no ``ctx.dataloader`` pass runs: a loop of its own batches)."""
        if self._spans_on is None:
            return
        self._spanning = True
        self._spans_on()
        alive = [model for ref in self._models if (model := ref()) is not None]
        self._models = [weakref.ref(model) for model in alive]
        for model in alive:
            self._hook(model)

    # -- measuring -------------------------------------------------------------------------

    def _waited(self) -> float:
        tracker = self.tracker
        return tracker.wait_total if tracker is not None else 0.0

    def _run_delay(self) -> float | None:
        """Seconds the main thread has waited for a CPU so far; None where unknown."""
        fd = self._schedstat
        if fd is None:
            return None
        try:
            return int(os.pread(fd, 64, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return None

    def _settle(self, now: float) -> None:
        """Read the run-queue delay; the steps kept since the last read share what it grew by.

        Any thread may call it (the file is the main thread's); with none kept since,
        the growth (a gap between passes) belongs to no step, and no step's share is
        more than the step lasted (the rest fell between steps: a pass's discarded end).
        """
        if self._schedstat is None:
            return
        with self._lock:
            delay = self._run_delay()
            if delay is None:
                return
            grown, self._delay, self._read_at = max(0.0, delay - self._delay), delay, now
            count, self._unsettled = min(self._unsettled, len(self._steps)), 0
            steps = self._steps
            for index in range(len(steps) - count, len(steps)):
                data, host, collective, _ = steps[index]  # never more than the step lasted:
                share = min(grown / count, data + host + collective)  # the rest was between
                steps[index] = (data, host, collective, share)

    def _begin(self, now: float, waited: float | None = None) -> None:
        """A step begins at ``now``; ``waited``: the tracker's total, when the step before it
        just ended (None: after a gap, whose wait for a CPU belongs to no step)."""
        if waited is None:
            waited = self._waited()
            self._settle(now)
        self._open = _Open(now, waited)
        for listener in self.listeners:
            listener(self.opened)
        self.opened += 1

    def _close(self, now: float) -> float | None:
        """The open step ends at ``now``; returns the tracker's total it read (None: none open)."""
        opened = self._open
        if opened is None:
            return None
        self._open = None
        tracker = self.tracker
        waited = tracker.wait_total if tracker is not None else 0.0
        collective = max(0.0, waited - opened.waited)
        total = now - opened.start
        if opened.fed or not opened.work:
            data = opened.loader
            host = max(0.0, total - data - collective)
        else:  # a loop that reads its own batches: data is the rest of the step
            host = max(0.0, opened.work - opened.work_wait)
            data = max(0.0, total - collective - host)
        if self._cuda:
            self._close_on_gpu(data, collective, host)
        else:
            self._add((data, host, collective, 0.0))
        if now - self._read_at >= SCHEDSTAT_EVERY_S:
            self._settle(now)
        return waited

    def _add(self, step: tuple[float, float, float, float]) -> None:
        """A closed step's phases, kept as a tuple (a :class:`StepTime` is made when read);
        its wait for a CPU is given at the next read (:meth:`_settle`)."""
        with self._lock:
            self._steps.append(step)
            self.count += 1
            self._unsettled += 1

    def _close_on_gpu(self, data: float, collective: float, host: float) -> None:
        """Compute = the GPU's time between this step's events, read once they completed.

        ``elapsed_time`` between the events closing two steps is the step on the GPU's
        timeline; less this step's data and collective wait, it is the compute the host
        only queued. Never below the host's own compute (a GPU that kept up).
        """
        end = self._new_event()
        if end is None:
            self._add((data, host, collective, 0.0))
            return
        end.record()
        previous, self._last_event = self._last_event, end
        self._gpu.append((previous, end, data, collective, host))
        while self._gpu and self._gpu[0][1].query():
            begin, finish, data_s, collective_s, host_s = self._gpu.popleft()
            if begin is None:
                self._add((data_s, host_s, collective_s, 0.0))
                continue
            gpu_s = begin.elapsed_time(finish) / 1000.0
            compute = max(host_s, gpu_s - data_s - collective_s)
            self._add((data_s, compute, collective_s, 0.0))

    def _new_event(self) -> Any:
        """A timing CUDA event (None before CUDA is in use): ``event_factory`` if given."""
        if self.event_factory is not None:
            return self.event_factory()
        cuda: Any = torch.cuda
        return cuda.Event(enable_timing=True) if cuda.is_initialized() else None

    def recent(self) -> list[StepTime]:
        """The last ``window`` steps, oldest first."""
        self._settle(time.monotonic())
        with self._lock:
            return [StepTime(*step) for step in self._steps]

    def summary(self, rank: int, host: str) -> PhaseTimes:
        """This rank's medians over the window (zeros before its first step)."""
        self._settle(time.monotonic())
        with self._lock:
            steps, count = [StepTime(*step) for step in self._steps], self.count
        if not steps:
            return PhaseTimes(rank, host, count, 0.0, 0.0, 0.0, 0.0)
        return PhaseTimes(
            rank,
            host,
            count,
            statistics.median(s.data for s in steps),
            statistics.median(s.compute for s in steps),
            statistics.median(s.collective for s in steps),
            statistics.median(s.step for s in steps),
            statistics.median(s.starved for s in steps),
        )


def _compiled(model: nn.Module) -> bool:
    """Whether ``model``'s own call runs compiled: ``module.compile()`` (what ``compile=``
    does) or a ``torch.compile`` wrapper around it."""
    if getattr(model, "_compiled_call_impl", None) is not None:
        return True
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return optimized is not None and isinstance(model, optimized)
