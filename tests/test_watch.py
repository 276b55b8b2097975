"""Watching a run: the straggler report names the slow rank and phase, the metrics trail is exact.

Straggler cases run DDP training on real ranks (the plugin's gloo group) with one
rank made slow on purpose: asleep in its ``collate_fn`` (data) or busy in its
model's forward (compute). DDP's gradient all-reduce makes every rank's
backward equally long, so the report must find the rank by who waits least.
The metrics trail is checked after a real SIGKILL and ``torchrun --max-restarts=1``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from ddpctx import StragglerSettings, distributed
from ddpctx.watch.clock import PhaseTimes, StepClock
from ddpctx.watch.loggers import CsvLogger, JsonlLogger, make_loggers
from ddpctx.watch.straggler import find_straggler
from tests.helpers import REPO, child_env, patience, torchrun_command

SLOW_S = 0.03
SETTINGS = StragglerSettings(window=50, tick_s=0.2)


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def work(seconds: float) -> None:
    """Compute for ``seconds`` of CPU time, as real work does (preemption makes it longer).

    A wall-clock busy loop preempted for most of its length is, to the straggler report,
    a rank starved of CPU, which on a busy 2-core machine it is.
    """
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Slowed(nn.Module):
    """A linear model whose forward busy-loops ``SLOW_S`` when ``slow(step)`` says so."""

    def __init__(self, slow: Any) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)
        self.slow = slow
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow(self.calls):
            work(SLOW_S)
        self.calls += 1
        return self.linear(x)


def train(
    steps: int, slow_rank: int | None, phase: str, slow_steps: range | None = None
) -> tuple[int, list[str]]:
    """Train ``steps`` DDP steps with ``slow_rank`` slow in ``phase``; (rank, rank 0's reports)."""
    with distributed(seed=0, straggler=SETTINGS) as ctx:
        slow_here = ctx.rank == slow_rank

        def slow(step: int) -> bool:
            return slow_here and (slow_steps is None or step in slow_steps)

        fetched = [0]

        def collate(samples: list[torch.Tensor]) -> torch.Tensor:
            if phase == "data" and slow(fetched[0]):
                time.sleep(SLOW_S)
            fetched[0] += 1
            return torch.stack(samples)

        data = [torch.randn(8) for _ in range(steps * ctx.world_size * 2)]
        loader = ctx.dataloader(data, batch_size=2, collate_fn=collate)
        model = ctx.wrap(Slowed(slow if phase == "compute" else lambda step: False))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for x in loader:
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        watch = ctx._watch
    assert watch is not None
    assert watch.watcher is not None
    return ctx.rank, watch.watcher.reports


def named(reports: list[str]) -> set[tuple[int, str]]:
    """(rank, phase) of every straggler a report names."""
    found = set()
    for report in reports:
        match = re.match(r"ddpctx straggler report: rank (\d+) \(.+?\) is slow in (\w+):", report)
        if match:
            found.add((int(match[1]), match[2]))
    return found


@pytest.mark.slow
@pytest.mark.distributed(world_size=[3, 4], init=False, timeout=180)
@pytest.mark.parametrize("phase", ["data", "compute"])
def test_the_slow_rank_is_named_with_its_phase_and_no_other(
    dist_world_size: int, phase: str, capsys: pytest.CaptureFixture[str]
) -> None:
    slow_rank = dist_world_size - 1
    rank, reports = train(150, slow_rank, phase)
    if rank == 0:
        assert reports, "no straggler report"
        assert named(reports) == {(slow_rank, phase)}, reports
        first = reports[0].splitlines()[0]
        assert re.fullmatch(
            rf"ddpctx straggler report: rank {slow_rank} \(\S+\) is slow in {phase}: "
            r"\+\d+ ms per step \(\d+\.\d\dx the median rank\) over the last 50 steps",
            first,
        ), first
        size_ms = int(re.search(r"\+(\d+) ms", first)[1])  # type: ignore[index]
        assert 15 <= size_ms <= 120, first  # 30 ms asked; a busy machine stretches it
        assert first in capsys.readouterr().err  # printed, like the hang report


@pytest.mark.slow
@pytest.mark.distributed(world_size=3, init=False, timeout=180)
def test_an_even_job_names_nobody_over_a_thousand_steps() -> None:
    rank, reports = train(1000, None, "compute")
    if rank == 0:
        assert reports == []


@pytest.mark.slow
@pytest.mark.distributed(world_size=3, init=False, timeout=180)
@pytest.mark.parametrize("phase", ["data", "compute"])
def test_a_rank_slow_for_five_steps_only_is_not_reported(phase: str) -> None:
    rank, reports = train(150, 1, phase, slow_steps=range(70, 75))
    if rank == 0:
        assert reports == []


@pytest.mark.slow
@pytest.mark.distributed(world_size=3, init=False, timeout=180)
def test_a_straggler_that_catches_up_is_said_to_have() -> None:
    # slow for the first 150 steps, then even: reported (once slow for persist=2 windows
    # of 50), then caught up by the end (a window back in the lower band)
    rank, reports = train(350, 2, "compute", slow_steps=range(150))
    if rank == 0:
        assert named(reports) == {(2, "compute")}, reports
        assert "rank 2" in reports[-1], reports
        assert "has caught up" in reports[-1], reports


def times(rank: int, data: float, compute: float, wait: float) -> PhaseTimes:
    return PhaseTimes(rank, "h", 50, data / 1000, compute / 1000, wait / 1000)


def test_the_equalised_backward_blames_the_rank_that_waits_least() -> None:
    # rank 1 computes 30 ms longer; its peers wait those 30 ms inside backward's all-reduce.
    ranks = [times(0, 1, 20, 31), times(1, 1, 50, 1), times(2, 1, 20, 30)]
    verdict = find_straggler(ranks, StragglerSettings())
    assert verdict is not None
    assert (verdict.rank, verdict.phase) == (1, "compute")
    # a rank that is slow *and* waits most did not hold the others back
    ranks = [times(0, 1, 20, 1), times(1, 1, 50, 40), times(2, 1, 20, 1)]
    assert find_straggler(ranks, StragglerSettings()) is None
    # under the threshold: noise
    ranks = [times(0, 1, 20, 2), times(1, 1, 22, 0), times(2, 1, 20, 2)]
    assert find_straggler(ranks, StragglerSettings()) is None


def test_at_two_ranks_the_size_is_the_difference_from_the_other_rank() -> None:
    # The median of two ranks is their mean: the excess was halved (+16 ms, 1.94x for a rank
    # 31 ms slower) and the ratio could never reach 2x.
    verdict = find_straggler(
        [times(0, 0.2, 0.9, 32), times(1, 31.3, 1.1, 0.6)], StragglerSettings()
    )
    assert verdict is not None
    assert (verdict.rank, verdict.phase) == (1, "data")
    assert round(verdict.excess_s * 1000) == 31
    assert verdict.ratio > 25


def test_with_two_slow_ranks_of_three_the_slowest_is_still_named() -> None:
    # rank 1 slow in data, rank 2 in compute, rank 0 waits for both: the median rank was
    # itself slow, so nobody exceeded it and no report came at all.
    ranks = [times(0, 0.2, 0.9, 33.7), times(1, 31.2, 1.0, 2.2), times(2, 0.1, 31.5, 2.5)]
    verdict = find_straggler(ranks, StragglerSettings())
    assert verdict is not None
    assert (verdict.rank, verdict.phase) == (1, "data")


@given(
    base=st.floats(1.0, 200.0),
    noise=st.lists(st.floats(0.0, 0.15), min_size=2, max_size=8),
    extra=st.floats(0.0, 100.0),
)
def test_the_named_rank_is_the_slow_one_and_its_size_the_difference(
    base: float, noise: list[float], extra: float
) -> None:
    # Every rank but the last computes base ms (within 15%); the last computes extra more,
    # and the others wait for it. A report names the last rank, by about extra ms.
    n = len(noise) + 1
    own = [base * (1 + jitter) for jitter in noise] + [base + extra]
    slowest = max(own)
    ranks = [times(r, 0.0, own[r], slowest - own[r]) for r in range(n)]
    verdict = find_straggler(ranks, StragglerSettings())
    if extra <= 0.04 * base:  # within the jitter: nobody
        assert verdict is None
    if extra >= 0.5 * base + 6:  # clearly slower: named, by at most its lead over the fastest
        assert verdict is not None
        assert verdict.rank == n - 1
        assert verdict.excess_s * 1000 <= own[-1] - min(own[:-1]) + 1e-6


def test_straggler_settings_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match=r"window=0"):
        StragglerSettings(window=0)
    with pytest.raises(ValueError, match=r"threshold=-1"):
        StragglerSettings(threshold=-1)
    with pytest.raises(ValueError, match=r"straggler='yes'"):
        distributed(straggler="yes").__enter__()  # type: ignore[arg-type]


def test_timings_split_a_step_into_data_and_compute() -> None:
    def collate(samples: list[int]) -> list[int]:
        time.sleep(0.02)
        return samples

    with distributed() as ctx:
        for _ in ctx.dataloader(list(range(20)), batch_size=2, collate_fn=collate):
            busy(0.01)
        mine = ctx.timings()[0]
    assert mine.steps == 10
    assert mine.data >= 0.018
    assert mine.compute >= 0.009
    assert mine.data > mine.compute > mine.collective


def log_timings_before_and_after_steps(op: str) -> tuple[dict[str, Any], ...]:
    from ddpctx import current

    ctx = current()
    assert ctx is not None
    before = ctx.log({"loss": 1.0, "count": 2}, op=op, timings=True)
    for _ in ctx.dataloader(list(range(12)), batch_size=2):
        busy(0.002 * (ctx.rank + 1))
    after = ctx.log({"loss": 1.0, "count": 2}, op=op, timings=True)
    everyone = ctx.timings()
    mean_step_ms = sum(1000.0 * t.step for t in everyone.values()) / len(everyone)
    return before, after, {"mean_step_ms": mean_step_ms}


@pytest.mark.parametrize("op", ["mean", "sum", "max"])
def test_timings_are_left_out_until_measured_and_averaged_whatever_the_op(
    run_distributed: Any, op: str
) -> None:
    before, after, reference = run_distributed(log_timings_before_and_after_steps, op)[0]
    assert "timings" not in before, before  # no rank has a step: not 0 ms
    assert before["loss"] == {"mean": 1.0, "sum": 2.0, "max": 1.0}[op]
    assert after["loss"] == before["loss"]
    assert set(after["timings"]) == {"data_ms", "compute_ms", "collective_ms", "step_ms"}
    assert after["timings"]["step_ms"] > 0
    # a mean over the ranks, as ctx.timings() gives them, never their sum or max
    assert after["timings"]["step_ms"] == pytest.approx(reference["mean_step_ms"], rel=1e-9)


def test_a_metric_named_timings_beside_timings_true_is_refused_naming_it() -> None:
    with distributed() as ctx, pytest.raises(ValueError, match=r"already hold 'timings' \(3\)"):
        ctx.log({"timings": 3}, timings=True)


def test_a_step_below_the_last_one_logged_is_refused_and_the_trail_stays_once_per_step(
    tmp_path: Path,
) -> None:
    with distributed(log_dir=tmp_path, loggers=("jsonl", "csv")) as ctx:
        for _ in range(6):
            ctx.log({"loss": 1.0})  # steps 0..5
        with pytest.raises(
            ValueError, match=r"ctx.log\(step=2\) is below the last step logged \(5\)"
        ):
            ctx.log({"x": 1.0}, step=2)
        ctx.log({"val": 2.0}, step=5)  # the same step adds to it
        ctx.log({"loss": 0.5})  # 6
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [0, 1, 2, 3, 4, 5, 5, 6]


def test_the_jsonl_and_csv_loggers_keep_the_steps_a_checkpoint_covers(tmp_path: Path) -> None:
    for logger in (JsonlLogger(tmp_path), CsvLogger(tmp_path)):
        logger.resume(None)
        for step in range(10):
            logger.log_metrics({"loss": step / 2}, step)
        logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as torn:
        torn.write('{"step": 10, "lo')  # a kill in the middle of a line
    for logger in (JsonlLogger(tmp_path), CsvLogger(tmp_path)):
        logger.resume(5)
        logger.log_metrics({"loss": 9.0}, 6)
        logger.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3, 4, 5, 6]
    assert lines[-1] == {"step": 6, "loss": 9.0}
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,loss"
    assert rows[-1] == "6,9.0"
    assert len(rows) == 8


def test_a_user_logger_gets_reduced_flat_metrics_and_the_config_once(tmp_path: Path) -> None:
    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[str, Any]] = []

        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            self.calls.append(("metrics", (step, metrics)))

        def log_hparams(self, params: dict[str, Any]) -> None:
            self.calls.append(("hparams", params))

        def resume(self, step: int | None) -> None:
            self.calls.append(("resume", step))

    recorder = Recorder()
    with distributed(loggers=(recorder,)) as ctx:
        ctx.log_config({"lr": 0.1})
        ctx.log({"loss": torch.tensor(0.5), "val": {"acc": 1.0}})
        ctx.log({"loss": 0.25, "val": {"acc": 0.5}}, step=7)
    assert recorder.calls == [
        ("resume", None),
        ("hparams", {"lr": 0.1}),
        ("metrics", (0, {"loss": 0.5, "val/acc": 1.0})),
        ("metrics", (7, {"loss": 0.25, "val/acc": 0.5})),
    ]


def test_logging_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no log_dir was given"):
        make_loggers(("jsonl",), None)
    with pytest.raises(ValueError, match=r"'parquet' is not a logger"):
        make_loggers(("parquet",), tmp_path)
    with pytest.raises(ValueError, match=r"has no log_metrics"):
        make_loggers((object(),), tmp_path)
    with pytest.raises(ValueError, match=r"one string"):
        make_loggers("jsonl", tmp_path)  # type: ignore[arg-type]
    with distributed(log_dir=tmp_path) as ctx:
        with pytest.raises(ValueError, match=r"'loss' is Tensor of shape \(3,\), not one number"):
            ctx.log({"loss": torch.ones(3)})
        with pytest.raises(ValueError, match=r"step=-1"):
            ctx.log({"loss": 1.0}, step=-1)


def test_a_profile_of_chosen_steps_writes_one_trace_per_rank(tmp_path: Path) -> None:
    with distributed(log_dir=tmp_path) as ctx:
        profiling = ctx.profile(steps=(2, 3))
        for _batch in ctx.dataloader(list(range(12)), batch_size=2):
            torch.ones(4) @ torch.ones(4)
        assert profiling.done
    trace = json.loads((tmp_path / "profile" / "rank0.pt.trace.json").read_text())
    assert trace["traceEvents"]


@pytest.mark.slow
@pytest.mark.integration("tensorboard")
def test_every_step_is_logged_exactly_once_after_a_sigkill_and_a_restart(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir, steps = tmp_path / "log", 30
    command = torchrun_command(
        REPO / "tests" / "scripts" / "log_resume.py",
        str(log_dir),
        str(tmp_path / "checkpoints"),
        str(steps),
        launcher_args=("--standalone", "--max-restarts=1"),
    )
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=patience(240), env=child_env(), cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exitcode: -9" in done.stderr  # the first attempt really was killed
    lines = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["value"]) for line in lines] == [
        (step, step + 0.5) for step in range(steps)
    ]
    csv_rows = (log_dir / "metrics.csv").read_text().splitlines()
    assert csv_rows == ["step,value", *(f"{step},{step + 0.5}" for step in range(steps))]
    events = EventAccumulator(str(log_dir))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("value")] == [
        (step, step + 0.5) for step in range(steps)
    ]
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2  # both attempts wrote
    assert json.loads((log_dir / "ddpctx-config.json").read_text()) == {"lr": 0.1, "steps": 30}


def test_a_metric_named_step_is_refused_before_the_collective(tmp_path: Path) -> None:
    with (
        distributed(log_dir=tmp_path) as ctx,
        pytest.raises(ValueError, match=r"a metric named 'step'.*step=\.\.\."),
    ):
        ctx.log({"step": 3, "loss": 1.0})


def test_logging_before_loading_a_checkpoint_says_the_earlier_trail_is_gone(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(2, 1)
    with distributed(log_dir=tmp_path / "log") as ctx:
        wrapped = ctx.wrap(model)
        for step in range(3):
            ctx.log({"loss": float(step)})
        ctx.save_checkpoint(tmp_path / "checkpoints", model=wrapped, step=2)
    with distributed(log_dir=tmp_path / "log") as ctx:
        wrapped = ctx.wrap(model)
        ctx.log({"loss": 9.0})  # starts a fresh trail: the earlier attempt's 0..2 go
        with pytest.warns(
            RuntimeWarning,
            match=r"ctx.log was called before load_checkpoint.*logged up to step 2 is gone.*"
            r"This load cuts nothing",
        ):
            meta = ctx.load_checkpoint(tmp_path / "checkpoints", model=wrapped)
        assert meta == {"step": 2}  # the trail's own entry is taken out
        ctx.log({"loss": 3.0})
    lines = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    # this block's own step 0 stays (a load after ctx.log never cuts), step 3 follows
    assert [(x["step"], x["loss"]) for x in lines] == [(0, 9.0), (3, 3.0)]


def test_a_resumed_block_continues_the_steps_and_keeps_the_checkpointed_ones(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(2, 1)
    with distributed(log_dir=tmp_path / "log", loggers=("jsonl", "csv")) as ctx:
        wrapped = ctx.wrap(model)
        ctx.log_config({"lr": 0.5})
        for step in range(5):
            ctx.log({"loss": float(step)})
            if step == 2:
                ctx.save_checkpoint(tmp_path / "checkpoints", model=wrapped, step=step)
    with distributed(log_dir=tmp_path / "log", loggers=("jsonl", "csv")) as ctx:
        wrapped = ctx.wrap(model)
        ctx.log_config({"lr": 0.25})  # a resumed run does not record its config again
        assert ctx.load_checkpoint(tmp_path / "checkpoints", model=wrapped) == {"step": 2}
        ctx.log({"loss": 30.0})
    lines = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["loss"]) for x in lines] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]
    assert (tmp_path / "log" / "metrics.csv").read_text().splitlines()[-1] == "3,30.0"
    assert json.loads((tmp_path / "log" / "ddpctx-config.json").read_text()) == {"lr": 0.5}


class GpuTimeline:
    """Stands in for a CUDA stream: events complete when ``done`` says, ``elapsed`` from it."""

    def __init__(self) -> None:
        self.clock = 0.0
        self.done = True

    def event(self) -> Any:
        timeline = self

        class Event:
            def record(self) -> None:
                self.at = timeline.clock

            def query(self) -> bool:
                return timeline.done

            def elapsed_time(self, end: Any) -> float:
                return (end.at - self.at) * 1000.0

        return Event()


def test_on_cuda_compute_is_the_gpus_time_not_what_the_host_queued() -> None:
    # The host queues each step in ~0 s; the GPU takes 50 ms per step: compute says 50 ms.
    gpu = GpuTimeline()
    clock = StepClock(window=10, cuda=True, event_factory=gpu.event)
    gpu.done = False  # the GPU lags: no step can be read yet
    for index, _ in enumerate(clock.timed(iter(range(6)))):
        gpu.clock += 0.05
        if index == 3:
            gpu.done = True
    steps = clock.recent()
    assert len(steps) == 6  # every step read, once its event completed
    assert steps[0].compute < 0.01  # the first step has no earlier event: host time
    assert all(abs(step.compute - 0.05) < 0.01 for step in steps[1:])


def test_the_step_clocks_forward_hooks_are_plain_and_come_off_when_a_loader_pass_begins() -> None:
    """DDP loads dynamo, and every model's hooks went through torch.compiler.disable
    (~25 us a call); and once ctx.dataloader begins steps, forward hooks measure nothing."""
    with distributed(timings=True) as ctx:
        model = ctx.wrap(nn.Linear(4, 1))
        hooks = list(model._forward_pre_hooks.values()) + list(model._forward_hooks.values())
        assert len(hooks) == 2
        assert not any(hasattr(hook, "_torchdynamo_disable") for hook in hooks)
        assert all(getattr(hook, "__module__", "") == "ddpctx.watch.clock" for hook in hooks)
        for (x,) in ctx.dataloader([(torch.ones(4),)] * 4, batch_size=2):
            assert not model._forward_pre_hooks
            assert not model._forward_hooks
            model(x)
        assert ctx.timings()[0].steps == 2


def test_the_span_hooks_come_off_when_a_loader_pass_begins_and_steps_still_end_at_step() -> None:
    # backward() and the optimizer's pre-step hook time spans only a loop of its own batches
    # uses: ~3 us each a step, gone once ctx.dataloader batches begin steps.
    from torch.optim import optimizer as optim_module

    def clocks_backward() -> bool:
        code = getattr(torch.autograd.backward, "__code__", None)
        return code is not None and code.co_filename.endswith(os.path.join("watch", "clock.py"))

    with distributed(timings=True) as ctx:
        model = ctx.wrap(nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert clocks_backward()  # on: a loop of its own batches times its spans
        pre_hooks = len(optim_module._global_optimizer_pre_hooks)
        post_hooks = len(optim_module._global_optimizer_post_hooks)
        for (x,) in ctx.dataloader([(torch.ones(4),)] * 8, batch_size=2):
            assert not clocks_backward()
            assert len(optim_module._global_optimizer_pre_hooks) == pre_hooks - 1
            assert len(optim_module._global_optimizer_post_hooks) == post_hooks  # ends steps
            model(x).sum().backward()
            opt.step()
        assert ctx.timings()[0].steps == 4  # from the first batch, one per optimizer step
    assert not clocks_backward()
    assert len(optim_module._global_optimizer_post_hooks) == post_hooks - 1


def test_a_loop_of_its_own_batches_after_a_loader_pass_has_its_data_phase_again() -> None:
    # Found by the outside attack: once a ctx.dataloader pass had run, the span hooks stayed
    # off, and a loop of its own batches (nanoGPT's get_batch) had its data time, 20 ms of
    # it here, counted as compute -- "slow in compute" for a rank slow at its own data.
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = StepClock(window=4)
    undo = clock.install()
    clock.watch_model(model)

    def own_batches(steps: int) -> list[float]:
        for _ in range(steps):
            time.sleep(0.02)  # reading its own batch: data
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        return [step.data for step in clock.recent()]

    try:
        before = own_batches(5)
        for x in clock.timed(iter([torch.ones(2, 4)] * 3)):
            assert not model._forward_hooks  # off in a pass
            model(x).sum().backward()
            optimizer.step()
        after = own_batches(5)
        assert model._forward_hooks  # back for the loop of its own batches
    finally:
        undo()
        clock.close()
    assert all(data >= 0.015 for data in before), before
    assert all(data >= 0.015 for data in after), after
    assert not model._forward_hooks


class _Schedstat:
    """A schedstat file whose run-queue delay (2nd field, ns) the test sets."""

    def __init__(self, path: Path) -> None:
        self.path, self.delay_ns = path, 0
        self.write()

    def grow(self, ns: int) -> None:
        self.delay_ns += ns
        self.write()

    def write(self) -> None:
        self.path.write_text(f"123 {self.delay_ns:020d} 7\n")  # one length: pread sees it all


@given(
    grown=st.lists(st.integers(0, 10**7), min_size=1, max_size=30),
    every=st.sampled_from([0.0, 10.0]),
    gap=st.integers(0, 10**8),
)
def test_the_wait_for_a_cpu_is_shared_by_the_steps_it_fell_in_never_the_gaps(
    tmp_path_factory: pytest.TempPathFactory, grown: list[int], every: float, gap: int
) -> None:
    # Read every step (every=0) or once at the pass's end (every=10 s): each step's wait for
    # a CPU is its own, or an even share of the pass's; their sum is the growth during the
    # steps either way, and a gap before the pass (another pass, evaluation) is in none.
    import ddpctx.watch.clock as clock_module

    stat = _Schedstat(tmp_path_factory.mktemp("stat") / "schedstat")
    clock = StepClock(window=100, schedstat=str(stat.path))
    saved = clock_module.SCHEDSTAT_EVERY_S
    clock_module.SCHEDSTAT_EVERY_S = every
    try:
        stat.grow(gap)  # before the pass: no step's
        for index in clock.timed(iter(range(len(grown)))):
            stat.grow(grown[index])  # during step `index` (the last ends with the pass)
        steps = clock.recent()
    finally:
        clock_module.SCHEDSTAT_EVERY_S = saved
    assert len(steps) == len(grown)
    assert all(0.0 <= step.starved <= step.step for step in steps), steps  # never > the step
    if every == 0.0:  # each step its own (but never more than it lasted)
        expected = [min(ns / 1e9, step.step) for ns, step in zip(grown, steps, strict=True)]
        assert [step.starved for step in steps] == pytest.approx(expected, abs=1e-12)
    else:  # an even share of the pass's (but never more than the step lasted)
        share = sum(grown) / 1e9 / len(grown)
        expected = [min(share, step.step) for step in steps]
        assert [step.starved for step in steps] == pytest.approx(expected, abs=1e-12)


def test_the_clock_reads_the_wait_for_a_cpu_at_most_every_ten_milliseconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The file costs ~6 us a read in a training loop: read each step, it was a third of
    # the clock's cost.
    import ddpctx.watch.clock as clock_module

    stat = _Schedstat(tmp_path / "schedstat")
    reads = []
    original = os.pread

    def counted(*args: Any) -> bytes:
        reads.append(time.monotonic())
        return original(*args)

    monkeypatch.setattr(clock_module.os, "pread", counted)
    clock = StepClock(window=5000, schedstat=str(stat.path))
    started = time.monotonic()
    for _ in clock.timed(iter(range(3000))):
        pass
    took = time.monotonic() - started
    assert clock.count == 3000  # a pass's last step ends when its iterator is exhausted
    assert len(reads) <= took / clock_module.SCHEDSTAT_EVERY_S + 3, (len(reads), took)
