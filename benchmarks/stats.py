"""The numbers every benchmark reads its timings with: orders, clocks, ratios, intervals, cells.

Contract: pure functions of their arguments (the random draws are seeded), no
process, rank or device state. Contenders take turns in :func:`round_order`
(the same order on every rank of a job); a contender's cost against a
reference is :func:`paired_ratio`, the median over rounds of the two
measurements taken side by side in the same round, so the machine's drift over
a run cancels; :func:`median_interval` gives a median its 95% bootstrap
interval and :func:`verdict` reads a target against that interval; :func:`cell`
is a reduction table's ``median ms (paired ratio)`` cell.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

#: Resamples of the rounds behind a ratio's 95% interval.
RESAMPLES = 1000
#: The fewest that give a 95% interval: 2.5% of them is one resample.
MIN_RESAMPLES = 40


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """The contenders' order in one round: shuffled anew each round, the same on every rank.

    A fixed order gives each contender the same predecessor every round (the floor always
    first after the barrier, the loop always after ddpctx): whatever one leaves behind --
    a rank still catching up, a warm cache -- lands on the same neighbour each time and
    the paired ratio inherits it.
    """
    order = list(names)
    random.Random(round_index).shuffle(order)  # seeded: the same order on every rank
    return order


def per_call(fn: Callable[[], object], calls: int) -> float:
    """Wall seconds per call of ``calls`` calls of ``fn()`` in a row."""
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def ratios(values: Sequence[float], references: Sequence[float]) -> list[float]:
    """Each round's value over its reference's in the same round (the two lists pair up)."""
    return [value / reference for value, reference in zip(values, references, strict=True)]


def paired_ratio(values: Sequence[float], references: Sequence[float]) -> float:
    """The median of the per-round :func:`ratios`: a cost relative to its reference."""
    return float(statistics.median(ratios(values, references)))


def median_interval(values: list[float], resamples: int = RESAMPLES) -> tuple[float, float, float]:
    """The median of ``values`` and a 95% bootstrap interval of it: ``(median, low, high)``.

    The rounds are resampled with replacement ``resamples`` times (seeded: the
    same page from the same times); the interval holds the middle 95% of the
    resampled medians, and always the median itself. It says how far this run's
    median could move had the machine's noise fallen otherwise, which is what a
    1% target is read against.
    """
    if not values:
        raise ValueError("median_interval() got no values; time at least one round")
    if resamples < MIN_RESAMPLES:
        raise ValueError(
            f"resamples={resamples} cannot give a 95% interval: 2.5% of the resampled "
            f"medians must be at least one; pass resamples >= {MIN_RESAMPLES}"
        )
    middle = float(statistics.median(values))
    draw = random.Random(0).choices
    medians = sorted(statistics.median(draw(values, k=len(values))) for _ in range(resamples))
    low, high = medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]
    return middle, min(low, middle), max(high, middle)


def verdict(low: float, high: float, target: float) -> str:
    """A target read against an interval: met, not met, or not resolved by this run."""
    if high <= target:
        return "met"
    if low > target:
        return "not met"
    return "unresolved"


def cell(values: list[float], floor: list[float]) -> str:
    """``median ms (median of paired ratios)`` for one contender against the floor."""
    return f"{statistics.median(values) * 1e3:.3f} ms ({paired_ratio(values, floor):.2f}x)"
