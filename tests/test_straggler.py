"""The straggler report under the conditions that fooled it: hovering, contention, accumulation.

Rank 0's judgement is driven tick by tick through the real :class:`Watcher` (a real
``HashStore``), so the same tests run against any version of its logic. Steps are
measured by the real clock in real blocks: gradient accumulation over real ranks,
a loop that reads its own batches. The slow tier runs whole jobs beside a CPU hog
(a busy-loop process this file starts and kills) and with one rank made slow.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ddpctx import StragglerSettings, all_reduced, current, distributed
from ddpctx.watch.clock import PhaseTimes, StepClock
from ddpctx.watch.straggler import find_straggler, format_report
from ddpctx.watch.watcher import Watcher


def busy(seconds: float) -> None:
    """Compute for ``seconds`` of CPU time, as real work does (preemption makes it longer)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def times(
    rank: int, step: int, compute_ms: float, wait_ms: float, starved_ms: float = 0.0
) -> PhaseTimes:
    return PhaseTimes(
        rank,
        "h",
        step,
        0.0,
        compute_ms / 1000,
        wait_ms / 1000,
        (compute_ms + wait_ms) / 1000,
        **({"starved": starved_ms / 1000} if starved_ms else {}),
    )


def judged(ticks: Sequence[list[PhaseTimes]], config: StragglerSettings) -> list[str]:
    """The reports rank 0's watcher prints for these timings, one list of ranks per tick."""
    store = dist.HashStore()  # type: ignore[attr-defined]
    watcher = Watcher(config, StepClock(window=config.window), store, 0, 2, "h")
    for ranks in ticks:
        watcher._judge(ranks)
    return watcher.reports


def slow_by(ratio: float, step: int, base_ms: float = 100.0) -> list[PhaseTimes]:
    """Two ranks: rank 1's work is ``ratio`` times rank 0's; rank 0 waits the difference."""
    extra = base_ms * (ratio - 1)
    return [times(0, step, base_ms, extra + 1), times(1, step, base_ms + extra, 1)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(1.12, 1.4), min_size=80, max_size=80))
def test_a_rank_hovering_around_the_threshold_is_reported_once_and_never_cleared(
    ratios: list[float],
) -> None:
    # Rank 1 is steadily slow; its ratio wanders between 1.12x and 1.4x around the 1.2x
    # threshold (a tick every 5 steps, 400 steps). It was reported, said to have caught
    # up at 1.17x, reported again: 9 reports in 400 steps, `every=500` never applied.
    ratios = [max(r, 1.25) if index % 10 == 0 else r for index, r in enumerate(ratios)]
    config = StragglerSettings(window=50, every=500)
    reports = judged([slow_by(r, 50 + 5 * i) for i, r in enumerate(ratios)], config)
    assert len(reports) == 1, reports
    assert "rank 1 (h) is slow in compute" in reports[0]


def test_a_straggler_is_cleared_after_a_window_back_in_the_lower_band() -> None:
    config = StragglerSettings(window=50, every=500)
    ticks = [slow_by(1.5, step) for step in range(50, 200, 5)]
    ticks += [slow_by(1.02, step) for step in range(200, 300, 5)]
    reports = judged(ticks, config)
    assert len(reports) == 2, reports
    assert "rank 1 (h) is slow in compute" in reports[0], reports
    assert reports[1].startswith("ddpctx straggler report: rank 1 (h) has caught up"), reports
    # a whole window in the band first: cleared at step 250, not at 200
    assert len(judged(ticks[: len(ticks) - 10], config)) == 1


def test_an_excess_shorter_than_persist_windows_is_not_reported() -> None:
    # 1.5x for 40 steps of a 50-step window's medians, then even: an episode, not a rank
    config = StragglerSettings(window=50, every=500)
    ticks = [slow_by(1.5, step) for step in range(50, 90, 5)]
    ticks += [slow_by(1.0, step) for step in range(90, 300, 5)]
    assert judged(ticks, config) == []
    persisting = [slow_by(1.5, step) for step in range(50, 105, 5)]
    assert len(judged(persisting, config)) == 1


def test_a_rank_that_waits_for_a_cpu_is_starved_not_slow() -> None:
    # Rank 1's extra 21 ms per step are 19 ms in the CPU run queue: the machine is
    # oversubscribed (other work beside an even run), not rank 1's compute.
    config = StragglerSettings(window=50, every=500)
    ticks = [
        [times(0, step, 100, 22, starved_ms=2), times(1, step, 121, 1, starved_ms=21)]
        for step in range(50, 200, 5)
    ]
    reports = judged(ticks, config)
    assert len(reports) == 1, reports
    head = reports[0].splitlines()[0]
    assert "rank 1 (h) is starved of CPU (the machine is oversubscribed)" in head, head
    assert "is slow in" not in head
    assert "19 ms waiting for a CPU" in head, head
    assert "run fewer ranks or jobs per machine" in reports[0]
    # the same excess without the wait for a CPU is the rank's own: slow in compute
    plain = [[times(0, s, 100, 22), times(1, s, 121, 1)] for s in range(50, 200, 5)]
    assert "rank 1 (h) is slow in compute" in judged(plain, config)[0]
    # 31 ms more work, preempted for 16 ms of the wall-clock 31 (3 ranks on 2 busy cores):
    # the work is still longer once the wait is taken out, so the rank is slow, not starved
    busy_and_preempted = [
        [times(0, s, 1, 32, starved_ms=0.5), times(1, s, 32, 1, starved_ms=16)]
        for s in range(50, 200, 5)
    ]
    assert "rank 1 (h) is slow in compute" in judged(busy_and_preempted, config)[0]


def test_the_why_line_never_claims_a_wait_nobody_shows() -> None:
    # Every rank's median collective wait is 0 ms (no collective in most steps): the report
    # said "the others' collective wait is the time they wait for it (... 0.0 ms ...)".
    ranks = [times(0, 80, 1, 0), times(1, 80, 30, 0)]
    verdict = find_straggler(ranks, StragglerSettings())
    assert verdict is not None
    why = format_report(verdict, ranks, 50).splitlines()[-1]
    assert "the time they wait for it" not in why, why
    assert "show no matching wait" in why, why


def test_settings_refuse_a_busy_tick_and_the_environment_a_word_it_does_not_know() -> None:
    with pytest.raises(ValueError, match=r"tick_s=0\b.*at least tick_s=0.05"):
        StragglerSettings(tick_s=0)
    with pytest.raises(ValueError, match=r"persist=0"):
        StragglerSettings(persist=0)
    from ddpctx.watch.straggler import resolve_straggler

    with pytest.raises(ValueError, match=r"DDPCTX_STRAGGLER='maybe'.*DDPCTX_STRAGGLER=0"):
        resolve_straggler(True, {"DDPCTX_STRAGGLER": "maybe"})
    assert resolve_straggler(True, {"DDPCTX_STRAGGLER": "1"}) == StragglerSettings()
    assert resolve_straggler(True, {"DDPCTX_STRAGGLER": "off"}) is None


@given(
    name=st.sampled_from(["threshold", "min_ms", "tick_s"]),
    value=st.sampled_from([math.nan, math.inf, -math.inf, -1e-9]),
)
def test_settings_refuse_numbers_that_are_not_finite_or_below_zero(name: str, value: float) -> None:
    """A NaN tick spun the publishing thread and crashed every rank's exit in ``join``."""
    with pytest.raises(ValueError, match=rf"StragglerSettings\({name}=.*finite number"):
        StragglerSettings(**{name: value})


@pytest.mark.parametrize(
    ("word", "on"),
    [
        *[(w, False) for w in ("0", "false", "off", "No ")],
        *[(w, True) for w in ("", "1", "true", "ON", "yes")],
    ],
)
def test_the_environment_switch_takes_the_words_the_guide_lists(word: str, on: bool) -> None:
    from ddpctx.watch.straggler import resolve_straggler

    assert (resolve_straggler(True, {"DDPCTX_STRAGGLER": word}) is not None) is on


# -- the clock: accumulation and loops of their own batches --------------------------------


def accumulate(slow_rank: int, micro: int, steps: int) -> tuple[int, dict[str, float], int]:
    """``steps`` optimizer steps of ``micro`` micro-batches; ``slow_rank`` sleeps in data."""
    ctx = current()
    assert ctx is not None
    config = StragglerSettings(window=steps - 4)

    def collate(samples: list[torch.Tensor]) -> torch.Tensor:
        if ctx.rank == slow_rank:
            time.sleep(0.015)
        return torch.stack(samples)

    data = [torch.randn(4) for _ in range(steps * micro * ctx.world_size * 2)]
    loader = ctx.dataloader(data, batch_size=2, collate_fn=collate)
    model = ctx.wrap(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for index, x in enumerate(loader):
        last = (index + 1) % micro == 0
        with ctx.no_sync(model, enabled=not last):
            model(x).sum().backward()
        if last:
            optimizer.step()
            optimizer.zero_grad()
    everyone = ctx.timings()
    mine = everyone[ctx.rank]
    verdict = find_straggler(list(everyone.values()), config)
    named = -1 if verdict is None else verdict.rank
    millis = {"data": mine.data * 1000, "collective": mine.collective * 1000}
    return mine.steps, millis, named


@pytest.mark.slow
def test_under_accumulation_a_step_is_an_optimizer_step_and_shows_the_wait(
    run_distributed: Any,
) -> None:
    # 4 micro-batches per optimizer step; rank 1 takes 15 ms more for each. Per micro-batch
    # the median collective wait was 0 ms on every rank (3 of 4 micro-steps do not sync).
    micro, steps = 4, 24
    results = run_distributed(accumulate, 1, micro, steps, world_size=2, timeout=120)
    (steps0, fast, named0), (steps1, slow, _) = results
    # the micro-batches of a step are one step (those before the first optimizer step,
    # when the clock cannot know one is coming, are steps of their own)
    assert steps0 == steps1
    assert steps <= steps0 <= steps + micro - 1
    assert named0 == 1
    assert slow["data"] >= 0.7 * micro * 15, slow  # all four micro-batches' data
    # rank 0 waits in the one all-reduce of the step for rank 1's ~60 ms of data
    assert fast["collective"] >= 0.5 * micro * 15, fast
    assert fast["collective"] > 3 * slow["collective"], (fast, slow)


class Busy(nn.Module):
    """A linear model whose forward busy-loops ``seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        busy(self.seconds)
        return self.linear(x)


def test_a_loop_that_reads_its_own_batches_is_timed_its_data_the_rest_of_the_step() -> None:
    # nanoGPT's get_batch reads a memmap: no ctx.dataloader, so nothing was timed at all
    # (no timings, no report, and nothing said so).
    def get_batch() -> torch.Tensor:
        time.sleep(0.02)
        return torch.randn(8, 4)

    with distributed(seed=0) as ctx:
        model = ctx.wrap(Busy(0.01))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(12):
            x = get_batch()
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        mine = ctx.timings()[0]
    assert mine.steps in (11, 12)  # from the first forward (or optimizer step) on
    assert mine.data >= 0.018, mine  # get_batch: the rest of the step
    assert mine.compute >= 0.009, mine  # the forward's 10 ms of CPU
    # the forward is not data: data is the sleep, not sleep + forward (as long as a busy
    # machine does not stretch the sleep's wake-up by the forward's length and more)
    assert mine.data < mine.step - 0.009, mine


def test_forwards_between_two_passes_without_an_optimizer_begin_no_step() -> None:
    # An evaluation between passes (a forward of the wrapped model) belongs to no step.
    with distributed(seed=0) as ctx:
        model = ctx.wrap(nn.Linear(4, 1))
        loader = ctx.dataloader([torch.randn(4) for _ in range(8)], batch_size=2)
        for _ in range(2):
            for x in loader:
                model(x)
            with torch.no_grad():
                model(torch.randn(2, 4))
                time.sleep(0.2)
        mine = ctx.timings()[0]
        clock = ctx._watch.clock if ctx._watch is not None else None
    assert mine.steps == 8
    assert clock is not None
    assert max(step.step for step in clock.recent()) < 0.15, clock.recent()


@pytest.mark.distributed(world_size=2, init=False, timeout=60)
def test_a_loop_with_neither_an_optimizer_nor_a_loader_is_said_to_be_untimed() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distributed(seed=0) as ctx:
            model = ctx.wrap(nn.Linear(4, 1))
            for _ in range(3):
                model(torch.randn(2, 4)).sum().backward()
    said = [str(w.message) for w in caught if "ddpctx timed no step" in str(w.message)]
    assert len(said) == (1 if ctx.rank == 0 else 0), said  # rank 0 says it, once
    if said:
        assert "optimizer.step()" in said[0], said
        assert "timings=False" in said[0], said


@pytest.mark.distributed(world_size=2, init=False, timeout=60)
def test_a_block_that_only_evaluates_is_not_said_to_be_untimed() -> None:
    """The README's example: forwards of the wrapped model, no backward, no optimizer."""

    @all_reduced(weight="count")
    def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        loss = nn.functional.mse_loss(model(x), y)
        return {"loss": loss, "count": len(x)}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distributed(seed=0) as ctx:
            model = ctx.wrap(nn.Linear(4, 1))
            for _ in range(3):
                evaluate(model, torch.randn(64, 4), torch.randn(64, 1))
            with torch.no_grad():
                model(torch.randn(2, 4))
    said = [str(w.message) for w in caught if "ddpctx timed no step" in str(w.message)]
    assert said == []


# -- profiles ------------------------------------------------------------------------------


def test_profiles_never_overwrite_a_trace_and_refuse_ranks_that_do_not_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with distributed(log_dir=tmp_path) as ctx:
        with pytest.raises(ValueError, match=r"rank 7 does not exist at world size 1"):
            ctx.profile(ranks=[7])
        first = ctx.profile(steps=(1, 1))
        second = ctx.profile(steps=(3, 3))
        for _batch in ctx.dataloader(list(range(12)), batch_size=2):
            torch.ones(4) @ torch.ones(4)
    assert first.done
    assert second.done
    assert first.path != second.path  # the first was overwritten by the second
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == [
        "rank0.1.pt.trace.json",
        "rank0.pt.trace.json",
    ]
    monkeypatch.setenv("DDPCTX_PROFILE", "1-2@9")
    with pytest.raises(ValueError, match=r"DDPCTX_PROFILE='1-2@9': rank 9 does not exist"):
        distributed().__enter__()


def test_a_profile_without_log_dir_says_where_its_trace_went(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with (
        distributed() as ctx,
        pytest.warns(RuntimeWarning, match=r"wrote its trace to") as got,
        ctx.profile(),
    ):
        torch.ones(4) @ torch.ones(4)
    message = str(got[0].message)
    assert str(tmp_path / "profile" / "rank0.pt.trace.json") in message, message
    assert "log_dir" in message


# -- the slow tier: whole jobs beside a CPU hog, and with a steadily slow rank -------------


@pytest.fixture
def cpu_hogs() -> Iterator[None]:
    """Busy-loop processes, one per CPU and one more, for the length of a test; then killed."""
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpu_count() + 1)
    ]
    try:
        yield
    finally:
        for process in hogs:
            process.kill()
        for process in hogs:
            process.wait(timeout=30)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


STEADY = StragglerSettings(window=25, every=100, tick_s=0.1)


def train(steps: int, slow_rank: int | None, phase: str) -> tuple[int, list[str]]:
    """``steps`` DDP steps, each ~3 ms of compute; ``slow_rank`` 25 ms slower in ``phase``."""
    with distributed(seed=0, straggler=STEADY) as ctx:
        slow_here = ctx.rank == slow_rank

        def collate(samples: list[torch.Tensor]) -> torch.Tensor:
            if slow_here and phase == "data":
                time.sleep(0.025)
            return torch.stack(samples)

        data = [torch.randn(4) for _ in range(steps * ctx.world_size * 2)]
        loader = ctx.dataloader(data, batch_size=2, collate_fn=collate)
        model = ctx.wrap(Busy(0.003))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for x in loader:
            if slow_here and phase == "compute":
                time.sleep(0.025)
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        watch = ctx._watch
    assert watch is not None
    assert watch.watcher is not None
    return ctx.rank, watch.watcher.reports


def slow_named(reports: list[str]) -> list[tuple[int, str]]:
    found = []
    for report in reports:
        match = re.match(r"ddpctx straggler report: rank (\d+) \(.+?\) is slow in (\w+):", report)
        if match:
            found.append((int(match[1]), match[2]))
    return found


@pytest.mark.slow
def test_the_clock_sees_the_wait_for_a_cpu_beside_a_hog(cpu_hogs: None) -> None:
    if not Path("/proc/thread-self/schedstat").exists():
        pytest.skip("the kernel does not say how long a thread waits for a CPU")
    clock = StepClock(window=40)
    for _ in clock.timed(iter(range(40))):
        busy(0.005)
    steps = clock.recent()
    starved = sum(step.starved for step in steps)
    assert starved >= 0.1 * sum(step.step for step in steps), steps[:3]


@pytest.mark.slow
@pytest.mark.distributed(world_size=2, init=False, timeout=60)
def test_an_even_run_beside_a_cpu_hog_names_no_slow_rank(cpu_hogs: None) -> None:
    rank, reports = train(300, None, "compute")
    if rank == 0:
        # "starved of CPU" is the truth here and allowed; "rank N is slow" is crying wolf
        assert slow_named(reports) == [], reports


@pytest.mark.slow
@pytest.mark.distributed(world_size=2, init=False, timeout=60)
@pytest.mark.parametrize("phase", ["data", "compute"])
def test_a_steadily_slow_rank_is_reported_once_per_every_and_never_cleared(phase: str) -> None:
    steps = 300
    rank, reports = train(steps, 1, phase)
    if rank == 0:
        named = slow_named(reports)
        assert named, reports
        assert set(named) == {(1, phase)}, reports
        assert len(reports) <= steps // STEADY.every + 1, reports  # not flapping
        assert not any("caught up" in report for report in reports), reports


@pytest.mark.parametrize("steps", [(1,), (1, 2, 3), 5, "1-2", (2, 1), (-1, 2)])
def test_profile_steps_that_are_not_a_pair_of_step_numbers_are_refused_naming_them(
    steps: object, tmp_path: Path
) -> None:
    with (
        distributed(log_dir=tmp_path) as ctx,
        pytest.raises(ValueError, match=r"ctx\.profile\(steps=.*a pair of step numbers"),
    ):
        ctx.profile(steps=steps)  # type: ignore[arg-type]


def test_a_profile_variable_with_an_empty_rank_list_is_refused() -> None:
    from ddpctx.watch.profiling import parse_profile_env

    with pytest.raises(ValueError, match=r"DDPCTX_PROFILE='1-2@'.*@RANKS"):
        parse_profile_env("1-2@", 2)
    assert parse_profile_env("1-2@1", 2) == ((1, 2), (1,))
