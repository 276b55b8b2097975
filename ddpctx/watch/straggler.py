"""Which rank holds the others back, in which phase, by how much: the straggler report.

Pure: takes every rank's :class:`~ddpctx.watch.clock.PhaseTimes` (medians over
the same window of steps) and says who, if anyone, is the straggler.

The trap it avoids: DDP all-reduces the gradients inside ``backward()``, so
every rank's backward ends together and comparing whole phases blames
nobody, or the wrong rank. Waiting is the tell instead. The straggler is the
rank whose *own* time (data + compute) is longest **and** which waits least in
collectives; its victims show the same excess as collective wait. So:

1. ``own`` = data + compute per rank; the candidate is the rank with the
   longest ``own``.
2. It is named only when its ``own`` exceeds the median rank's -- the median
   of the *other* ranks, so that at 2 ranks the size is the difference from
   the other rank, not half of it, and with several slow ranks the slowest
   is still named -- by at least ``threshold`` (a fraction of that median's
   ``own``) and ``min_ms``, and its collective wait is at most the median of
   every rank's: a rank that is slow and also waits is not what held the
   others back.
3. Its phase is the one (data or compute) with the larger excess over the
   other ranks' median of that phase; the size is that excess, per step.
4. When its excess, less its extra wait for a CPU (its main thread was ready
   to run but another process had the CPU: the run-queue delay the clock
   reads), would no longer name it, the rank is *starved*: the machine is
   oversubscribed, and the report says so rather than blame its work. Work
   that is longer *and* preempted is still slow.

Medians over a window of steps (50 by default) keep one-off stalls (a
checkpoint, a 5-step hiccup) from firing. Over time (:class:`Judge`) a rank
is reported only once it has been found for ``persist`` windows, and cleared
only after a whole window back within half the threshold, so scheduling
noise and a rank hovering at the threshold neither fire nor flap.

What it cannot see: a rank whose gradient all-reduce *starts* late (a slow
comm hook, a slow NIC) does its own work on time and then holds every rank in
the same all-reduce, so every rank shows the same collective wait and no rank
is named.

Example:
    >>> from ddpctx.watch.clock import PhaseTimes
    >>> ranks = [PhaseTimes(r, "node-a", 50, 0.001, 0.020, 0.031 if r != 2 else 0.0)
    ...          for r in range(3)]
    >>> ranks[2] = PhaseTimes(2, "node-a", 50, 0.001, 0.051, 0.0)
    >>> verdict = find_straggler(ranks, StragglerSettings())
    >>> verdict.rank, verdict.phase, round(verdict.excess_s * 1000)
    (2, 'compute', 31)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ddpctx.watch.clock import PhaseTimes

#: The environment variable that turns the report off (``0``) for a job.
ENV = "DDPCTX_STRAGGLER"
#: What it may say: off, or on (the block's own ``straggler=`` then applies).
ENV_OFF = ("0", "false", "off", "no")
ENV_ON = ("", "1", "true", "on", "yes")
#: The shortest publishing interval: shorter is a store round trip in a busy loop.
MIN_TICK_S = 0.05


@dataclass(frozen=True)
class StragglerSettings:
    """The straggler report's options: ``distributed(straggler=StragglerSettings(...))``.

    Attributes:
        window: steps each rank's medians are taken over (and that must pass
            before anything is said).
        threshold: how much longer the straggler's own time (data + compute)
            must be than the median rank's, as a fraction (0.2: 20% longer).
        min_ms: and at least this many milliseconds longer per step.
        every: steps before a report about the same rank is printed again.
        tick_s: how often each rank publishes its timings (seconds, at least 0.05).
        persist: windows in a row a rank must be found slow before it is reported
            (a rank reported is said to have caught up only after a whole window
            back within half the threshold and half ``min_ms``).

    Example:
        >>> StragglerSettings(window=100, threshold=0.5).window
        100
    """

    window: int = 50
    threshold: float = 0.2
    min_ms: float = 5.0
    every: int = 500
    tick_s: float = 1.0
    persist: int = 2

    def __post_init__(self) -> None:
        for name, low in (("window", 1), ("every", 1), ("persist", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(
                    f"StragglerSettings({name}={value!r}): a whole number of steps, at least "
                    f"{low}, is needed, e.g. {name}=50."
                )
        for name in ("threshold", "min_ms", "tick_s"):
            value = getattr(self, name)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(
                    f"StragglerSettings({name}={value!r}): a finite number of at least 0 is "
                    f"needed (defaults: threshold=0.2, min_ms=5.0, tick_s=1.0)."
                )
        if self.tick_s < MIN_TICK_S:
            raise ValueError(
                f"StragglerSettings(tick_s={self.tick_s!r}): each rank would publish its "
                f"timings in a busy loop; pass at least tick_s={MIN_TICK_S} (default 1.0)."
            )


def resolve_straggler(value: object, environ: Mapping[str, str]) -> StragglerSettings | None:
    """``distributed(straggler=...)`` as settings, or None when the report is off.

    ``True`` (default) uses :class:`StragglerSettings`'s defaults; ``False`` or
    ``DDPCTX_STRAGGLER=0`` turns it off (``1`` leaves ``straggler=`` to decide).

    >>> resolve_straggler(True, {"DDPCTX_STRAGGLER": "0"}) is None
    True
    >>> resolve_straggler("yes", {})
    Traceback (most recent call last):
    ...
    ValueError: distributed(straggler='yes'): ...
    """
    word = environ.get(ENV, "").strip().lower()
    if word not in ENV_OFF + ENV_ON:
        raise ValueError(
            f"{ENV}={environ[ENV]!r} is not a switch: set {ENV}=0 to turn the straggler "
            f"report off, or {ENV}=1 (or unset it) to keep it on."
        )
    if word in ENV_OFF:
        return None
    if value is True:
        return StragglerSettings()
    if value is False or value is None:
        return None
    if isinstance(value, StragglerSettings):
        return value
    raise ValueError(
        f"distributed(straggler={value!r}): pass True (the default), False, or "
        "StragglerSettings(window=..., threshold=..., ...)."
    )


@dataclass(frozen=True)
class Verdict:
    """The straggler: its rank, host, phase, excess in that phase (seconds per step), ratio.

    ``starved_s``: how much longer than the other ranks' median it waited for a CPU per
    step. ``cause`` is ``"starved"`` when, less that wait, its excess no longer names
    it: the machine (another process holding the CPU) made it late, not its work.
    ``"slow"`` otherwise -- also for work that is longer *and* preempted.
    """

    rank: int
    host: str
    phase: str
    excess_s: float
    ratio: float  # its own time over the median rank's
    starved_s: float = 0.0
    cause: str = "slow"


def find_straggler(ranks: Sequence[PhaseTimes], settings: StragglerSettings) -> Verdict | None:
    """The straggler among ``ranks`` (see the module docstring), or None."""
    if len(ranks) < 2:
        return None
    slowest = max(ranks, key=lambda r: r.own)
    others = [r for r in ranks if r is not slowest]  # the candidate is not its own yardstick
    own_median = statistics.median(r.own for r in others)
    wait_median = statistics.median(r.collective for r in ranks)
    excess = slowest.own - own_median
    if excess < max(settings.threshold * own_median, settings.min_ms / 1000.0):
        return None
    if slowest.collective > wait_median:
        return None
    data_excess = slowest.data - statistics.median(r.data for r in others)
    compute_excess = slowest.compute - statistics.median(r.compute for r in others)
    phase, size = (
        ("data", data_excess) if data_excess > compute_excess else ("compute", compute_excess)
    )
    ratio = slowest.own / own_median if own_median > 0 else float("inf")
    starved = max(0.0, slowest.starved - statistics.median(r.starved for r in others))
    bar = max(settings.threshold * own_median, settings.min_ms / 1000.0)
    cause = "starved" if starved > 0 and excess - starved < bar else "slow"
    return Verdict(slowest.rank, slowest.host, phase, size, ratio, starved, cause)


def caught_up(rank: int, ranks: Sequence[PhaseTimes], settings: StragglerSettings) -> bool:
    """Whether ``rank`` is back in the lower band: within half the threshold and half ``min_ms``.

    The band is lower than the one that names a straggler, so a rank that hovers
    around the threshold is neither reported nor cleared again and again.

    >>> from ddpctx.watch.clock import PhaseTimes
    >>> ranks = [PhaseTimes(0, "h", 50, 0.0, 0.100, 0.0), PhaseTimes(1, "h", 50, 0.0, 0.117, 0.0)]
    >>> caught_up(1, ranks, StragglerSettings())  # 1.17x: under 1.2x, still above 1.1x
    False
    """
    mine = next((r for r in ranks if r.rank == rank), None)
    others = [r.own for r in ranks if r.rank != rank]
    if mine is None or not others:
        return True
    own_median = statistics.median(others)
    band = max(settings.threshold * own_median, settings.min_ms / 1000.0) / 2
    return mine.own - own_median < band


class Judge:
    """Rank 0's judgements over a run: who to report, when, and when they have caught up.

    Pure (no clock, no store): :meth:`observe` takes every rank's timings at each tick
    and returns what to print, if anything. A rank is reported once it is the straggler
    ``persist`` windows of steps after it was first found one, without falling back
    into the lower band (:func:`caught_up`) in between; again at most every ``every``
    steps; and said to have caught up once it has stayed in the lower band for a whole
    window. Between the bands (above half the threshold, below the threshold) nothing
    changes: a rank hovering around the threshold neither flaps nor is cleared.

    >>> from ddpctx.watch.clock import PhaseTimes
    >>> judge = Judge(StragglerSettings(window=10))
    >>> def at(step, slow):
    ...     return [PhaseTimes(0, "h", step, 0.0, 0.010, slow), PhaseTimes(1, "h", step, 0.0,
    ...             0.010 + slow, 0.0)]
    >>> [judge.observe(at(step, 0.02)) is not None for step in (10, 15, 20, 25)]
    [False, False, True, False]
    """

    def __init__(self, settings: StragglerSettings) -> None:
        self.settings = settings
        self._candidate: tuple[int, int] | None = None  # (rank, the step it was first found)
        self._reported: tuple[Verdict, int] | None = None  # (whom, at which step)
        self._calm_since: int | None = None  # since when the reported rank is in the band

    def observe(self, ranks: Sequence[PhaseTimes]) -> str | None:
        """The report to print for these timings (every rank's), or None."""
        settings, window = self.settings, self.settings.window
        if len(ranks) < 2 or min(r.steps for r in ranks) < window:
            return None
        step = min(r.steps for r in ranks)
        verdict = find_straggler(ranks, settings)
        candidate = self._candidate
        if verdict is not None and (candidate is None or candidate[0] != verdict.rank):
            self._candidate = (verdict.rank, step)
        elif verdict is None and candidate is not None and caught_up(candidate[0], ranks, settings):
            self._candidate = None  # only the lower band ends a candidacy, as it ends a report
        lasting = (
            verdict is not None
            and self._candidate is not None
            and step - self._candidate[1] >= window * (settings.persist - 1)
        )
        reported = self._reported
        if (
            verdict is not None
            and lasting
            and (
                reported is None
                or reported[0].rank != verdict.rank
                or step - reported[1] >= settings.every
            )
        ):
            self._reported, self._calm_since = (verdict, step), None
            return format_report(verdict, ranks, window)
        if reported is None:
            return None
        if not caught_up(reported[0].rank, ranks, settings):
            self._calm_since = None
            return None
        if self._calm_since is None:
            self._calm_since = step
        if step - self._calm_since < window:
            return None
        self._reported, self._calm_since = None, None
        return format_caught_up(reported[0].rank, reported[0].host, ranks, window)


def format_report(verdict: Verdict, ranks: Sequence[PhaseTimes], window: int) -> str:
    """The report rank 0 prints: the first line names rank, host, phase and size; then the table.

    >>> from ddpctx.watch.clock import PhaseTimes
    >>> ranks = [PhaseTimes(0, "node-a", 80, 0.0, 0.06, 0.03),
    ...          PhaseTimes(1, "node-b", 80, 0.03, 0.06, 0.0)]
    >>> head = format_report(Verdict(1, "node-b", "data", 0.03, 1.5), ranks, 50).splitlines()[0]
    >>> print(head.replace(" (1.50x", chr(10) + "(1.50x"))
    ddpctx straggler report: rank 1 (node-b) is slow in data: +30 ms per step
    (1.50x the median rank) over the last 50 steps
    """
    if verdict.cause == "starved":
        return format_starved(verdict, ranks, window)
    head = (
        f"ddpctx straggler report: rank {verdict.rank} ({verdict.host}) is slow in "
        f"{verdict.phase}: +{verdict.excess_s * 1000:.0f} ms per step "
        f"({verdict.ratio:.2f}x the median rank) over the last {window} steps"
    )
    waits = ", ".join(f"rank {r.rank} {r.collective * 1000:.1f} ms" for r in ranks)
    others_wait = statistics.median(r.collective for r in ranks if r.rank != verdict.rank)
    mine = next(r.collective for r in ranks if r.rank == verdict.rank)
    if others_wait - mine >= verdict.excess_s / 2:
        why = (
            f"why: rank {verdict.rank} spends the longest in its own work (data + compute) "
            f"and waits least in collectives; the others' collective wait is the time they "
            f"wait for it ({waits})."
        )
    else:  # the others do not visibly wait for it: say so rather than claim they do
        why = (
            f"why: rank {verdict.rank} spends the longest in its own work (data + compute) "
            f"and waits no longer than the others in collectives ({waits}); their steps "
            f"show no matching wait (no collective in most steps, or the work is "
            f"overlapped), so check whether it holds them back."
        )
    return "\n".join([head, *table(ranks, verdict.rank), why])


def format_starved(verdict: Verdict, ranks: Sequence[PhaseTimes], window: int) -> str:
    """The report for a rank whose steps stretch because it waits for a CPU, not for its work.

    >>> from ddpctx.watch.clock import PhaseTimes
    >>> ranks = [PhaseTimes(0, "h", 80, 0.0, 0.01, 0.02),
    ...          PhaseTimes(1, "h", 80, 0.0, 0.03, 0.0, 0.03, 0.02)]
    >>> verdict = Verdict(1, "h", "compute", 0.02, 3.0, 0.02, "starved")
    >>> print(format_report(verdict, ranks, 50).splitlines()[0][:78])
    ddpctx straggler report: rank 1 (h) is starved of CPU (the machine is oversubs
    """
    head = (
        f"ddpctx straggler report: rank {verdict.rank} ({verdict.host}) is starved of CPU "
        f"(the machine is oversubscribed): +{verdict.excess_s * 1000:.0f} ms per step in "
        f"{verdict.phase} ({verdict.ratio:.2f}x the median rank), of which "
        f"{verdict.starved_s * 1000:.0f} ms waiting for a CPU, over the last {window} steps"
    )
    starved = ", ".join(f"rank {r.rank} {r.starved * 1000:.1f} ms" for r in ranks)
    why = (
        f"why: its main thread was ready to run but had no CPU for most of its excess "
        f"(median wait for a CPU per step: {starved}). Other processes on its machine hold "
        f"the CPUs: run fewer ranks or jobs per machine, or fewer threads "
        f"(torch.set_num_threads, OMP_NUM_THREADS)."
    )
    return "\n".join([head, *table(ranks, verdict.rank), why])


def format_caught_up(rank: int, host: str, ranks: Sequence[PhaseTimes], window: int) -> str:
    """What rank 0 prints once a reported straggler is no longer one.

    >>> from ddpctx.watch.clock import PhaseTimes
    >>> ranks = [PhaseTimes(r, "h", 60, 0.0, 0.01, 0.0) for r in range(2)]
    >>> head = format_caught_up(1, "h", ranks, 50).splitlines()[0]
    >>> print(head.replace(" (1.00x", chr(10) + "(1.00x"))
    ddpctx straggler report: rank 1 (h) has caught up
    (1.00x the median rank over the last 50 steps)
    """
    others = [r.own for r in ranks if r.rank != rank] or [r.own for r in ranks]
    own_median = statistics.median(others)
    mine = next((r.own for r in ranks if r.rank == rank), own_median)
    ratio = mine / own_median if own_median > 0 else 1.0
    head = (
        f"ddpctx straggler report: rank {rank} ({host}) has caught up "
        f"({ratio:.2f}x the median rank over the last {window} steps)"
    )
    return "\n".join([head, *table(ranks, None)])


def table(ranks: Sequence[PhaseTimes], marked: int | None) -> list[str]:
    """One line per rank: median milliseconds per step by phase."""
    host_width = max(4, *(len(r.host) for r in ranks))
    lines = [
        f"  rank  {'host':<{host_width}}  {'steps':>7}  {'data ms':>8}  {'compute ms':>10}  "
        f"{'collective ms':>13}  {'step ms':>8}"
    ]
    for r in ranks:
        mark = "*" if r.rank == marked else " "
        lines.append(
            f"  {r.rank:>3}{mark}  {r.host:<{host_width}}  {r.steps:>7}  {r.data * 1000:>8.1f}  "
            f"{r.compute * 1000:>10.1f}  {r.collective * 1000:>13.1f}  {r.step * 1000:>8.1f}"
        )
    return lines
