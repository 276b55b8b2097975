"""Per-rank phase timings of every step, from what ddpctx already owns: no user code.

A *step* is the span from asking ``ctx.dataloader``'s iterator for a batch to
asking it for the next one (a pass's last step ends when the iterator is
exhausted; the gap between two passes -- evaluation, a checkpoint, the epoch
barrier -- belongs to no step). Each step is split into three phases:

- **data**: the time the iterator took to hand the batch over (the loader's
  workers, the ``collate_fn``, the copy to the device);
- **collective**: time the main thread waited in collectives, read from the
  hang doctor's :class:`~ddpctx.hang.inflight.Tracker` (every
  ``torch.distributed`` collective, ddpctx's own, and DDP's gradient
  all-reduce inside ``backward()`` -- the part of the backward after this
  rank's last gradient was ready, which is the wait for the other ranks);
- **compute**: the rest (forward, the backward up to the last gradient, the
  optimizer step, the user's own Python).

Durations only, from ``time.monotonic`` on each host, so clocks of different
hosts never meet. On CUDA the host returns before the GPU has run the work:
``StepClock(cuda=True)`` closes a step with a CUDA event and reads the step's
GPU time when that event has completed (one step later, never a sync), so the
compute phase is what the GPU spent rather than what the host queued.

The clock keeps the last ``window`` steps. Its cost is two clock reads and a
few additions per batch.

Example:
    >>> clock = StepClock(window=4)
    >>> for batch in clock.timed(iter([1, 2, 3])):
    ...     pass
    >>> clock.count, len(clock.recent())
    (3, 3)
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from ddpctx.hang.inflight import Tracker

T = TypeVar("T")

#: The phases of a step, in report order.
PHASES = ("data", "compute", "collective")


@dataclass(frozen=True)
class StepTime:
    """One step of one rank, in seconds: ``data + compute + collective == step``."""

    data: float
    compute: float
    collective: float

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


class StepClock:
    """This rank's step timings (see the module docstring)."""

    def __init__(
        self,
        tracker: Tracker | None = None,
        window: int = 50,
        *,
        cuda: bool = False,
        event_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.tracker = tracker
        self.window = window
        self.count = 0  # steps closed since the block began
        self._steps: deque[StepTime] = deque(maxlen=max(window, 1))
        self._lock = threading.Lock()  # the publishing thread reads while the main thread writes
        self._open: tuple[float, float, float] | None = None  # (start, data seconds, waited)
        self._cuda = cuda
        #: Makes the events that close steps on CUDA (default: ``torch.cuda.Event``).
        self.event_factory = event_factory
        self._gpu: deque[tuple[Any, Any, float, float, float]] = deque()
        self._last_event: Any = None  # the CUDA event that closed the previous step
        self.opened = 0  # steps begun since the block began
        #: Called with a step's number (from 0) as it begins: ``ctx.profile`` starts and stops.
        self.listeners: list[Callable[[int], None]] = []

    def timed(self, batches: Iterable[T]) -> Iterator[T]:
        """``batches``, each hand-over timed as data wait and each gap as one step."""
        iterator = iter(batches)
        monotonic = time.monotonic
        try:
            while True:
                start = monotonic()
                try:
                    batch = next(iterator)
                except StopIteration:
                    self._close(start)
                    return
                self._close(start)
                self._open = (start, monotonic() - start, self._waited())
                for listener in self.listeners:
                    listener(self.opened)
                self.opened += 1
                yield batch
        finally:
            self._open = None  # a pass left early (break): its open step is not a step
            self._last_event = None  # nor is the gap to the next pass

    def _waited(self) -> float:
        tracker = self.tracker
        return tracker.wait_total if tracker is not None else 0.0

    def _close(self, now: float) -> None:
        opened = self._open
        if opened is None:
            return
        start, data, waited = opened
        self._open = None
        collective = max(0.0, self._waited() - waited)
        host = max(0.0, now - start - data - collective)
        if self._cuda:
            self._close_on_gpu(start, data, collective, host)
            return
        self._add(StepTime(data, host, collective))

    def _add(self, step: StepTime) -> None:
        with self._lock:
            self._steps.append(step)
            self.count += 1

    def _close_on_gpu(self, start: float, data: float, collective: float, host: float) -> None:
        """Compute = the GPU's time between this step's events, read once they completed.

        ``elapsed_time`` between the events closing two steps is the step on the GPU's
        timeline; less this step's data and collective wait, it is the compute the host
        only queued. Never below the host's own compute (a GPU that kept up).
        """
        end = self._new_event()
        if end is None:
            self._add(StepTime(data, host, collective))
            return
        end.record()
        previous, self._last_event = self._last_event, end
        self._gpu.append((previous, end, data, collective, host))
        while self._gpu and self._gpu[0][1].query():
            begin, finish, data_s, collective_s, host_s = self._gpu.popleft()
            if begin is None:
                self._add(StepTime(data_s, host_s, collective_s))
                continue
            gpu_s = begin.elapsed_time(finish) / 1000.0
            compute = max(host_s, gpu_s - data_s - collective_s)
            self._add(StepTime(data_s, compute, collective_s))

    def _new_event(self) -> Any:
        """A timing CUDA event (None before CUDA is in use): ``event_factory`` if given."""
        if self.event_factory is not None:
            return self.event_factory()
        import torch

        cuda: Any = torch.cuda
        return cuda.Event(enable_timing=True) if cuda.is_initialized() else None

    def recent(self) -> list[StepTime]:
        """The last ``window`` steps, oldest first."""
        with self._lock:
            return list(self._steps)

    def summary(self, rank: int, host: str) -> PhaseTimes:
        """This rank's medians over the window (zeros before its first step)."""
        with self._lock:
            steps, count = list(self._steps), self.count
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
        )
