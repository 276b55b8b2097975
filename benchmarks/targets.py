"""Issue 47's targets in one run, each read met / not met / unresolved from a 95% interval.

Run:  python benchmarks/targets.py [--quick | --smoke]   (default: about 5-8 min on 2 cores)

One 2-rank torchrun job (gloo, CPU) measures, contenders interleaved round by
round in a new order each round (:func:`~benchmarks.stats.round_order`, the
same on both ranks), a barrier before each one's calls:

- **1M tensor**: ``@all_reduced`` of one 1M-element float32 tensor (mean)
  against the same semantics by hand (``t.clone()``, ``all_reduce``,
  ``div_(world)``), target <= 1.05x; the raw in-place ``all_reduce`` of a
  tensor of that size is reported beside it (no copy, no division).
- **32 metrics**: ``@all_reduced`` of a dict of 32 scalar tensors against one raw
  ``all_reduce`` of their stacked buffer, target <= 1.10x.
- **watching**: a block of DDP training steps (``benchmarks/workload.py``'s model,
  ``ctx.dataloader``, the loss through ``@all_reduced``) inside
  ``distributed(timings=True, straggler=True)`` against
  ``distributed(timings=False, straggler=False)`` (a second ``off`` row gives
  the noise), target <= 1.01x, by wall time and by the main thread's CPU time
  (``time.thread_time``) of each block's median step (each step timed on its
  own: the median, unlike a block's total, is not moved by the odd step that
  met an interrupt or a collection).
- **ctx.log**: in one ``distributed(log_dir=...)`` block, ``ctx.log({"loss": loss})``
  against the reduction it does -- the loss and its step check (one float,
  see :func:`ddpctx.watch.faces.with_step`) through ``@all_reduced`` -- per call
  (the 32 metrics' rounds and calls), target <= 20 us; beside it, what the step
  check costs over the loss alone, and the same rows inside training steps.
Each ratio is the median over rounds of the round's two measurements' ratio
(a difference for ctx.log), with a 95% bootstrap interval of that median
(:func:`~benchmarks.stats.median_interval`); :func:`verdict_of` reads each
measure against its bar, and a target measured two ways is met (or not met)
when one way resolves it and the other does not contradict it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: the repository, not benchmarks/, heads sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.processes import repo_env, torchrun
from benchmarks.stats import median_interval, ratios, round_order, verdict

#: Per mode: rounds and calls of the 1M tensor, of the 32 metrics; rounds and steps
#: per block of the watching and ctx.log rows.
MODES: dict[str, dict[str, int]] = {
    "smoke": {"big": 2, "big_calls": 1, "small": 2, "small_calls": 2, "rounds": 1, "steps": 2},
    "quick": {"big": 15, "big_calls": 3, "small": 60, "small_calls": 10, "rounds": 10, "steps": 60},
    "default": {
        "big": 2400,
        "big_calls": 3,
        "small": 400,
        "small_calls": 10,
        "rounds": 50,
        "steps": 150,
    },
}
WARM_UP = 10
OFF = {"timings": False, "straggler": False}
WATCH_ROWS = {"off": OFF, "off, again": OFF, "on": {"timings": True, "straggler": True}}
#: ctx.log's rows: the reduction it does (the loss and the two leaves per half of the step
#: that check every rank logs the same step, and that check), the loss alone, ctx.log.
LOG_ROWS = ("@all_reduced, with the step check", "@all_reduced, the loss alone", "ctx.log")


@dataclass(frozen=True)
class Measure:
    """One measure of a target: its median, 95% interval and bar (a ratio, or seconds)."""

    name: str
    middle: float
    low: float
    high: float
    bar: float
    unit: str = "x"  # "x": a ratio; "us": a difference in microseconds

    @property
    def verdict(self) -> str:
        return verdict(self.low, self.high, self.bar)

    def cell(self) -> str:
        if self.unit == "us":
            return f"{self.middle:+.1f} µs [{self.low:+.1f}, {self.high:+.1f}]"
        return f"{self.middle:.3f}x [{self.low:.3f}, {self.high:.3f}]"


def verdict_of(measures: Sequence[Measure]) -> str:
    """A target's verdict from its measures: resolved by one, contradicted by none.

    >>> a = Measure("wall", 1.0, 0.98, 1.03, 1.01)
    >>> b = Measure("cpu", 1.0, 0.99, 1.005, 1.01)
    >>> verdict_of([a, b]), verdict_of([a]), verdict_of([b, Measure("w", 1.1, 1.05, 1.2, 1.01)])
    ('met', 'unresolved', 'unresolved')
    """
    verdicts = {measure.verdict for measure in measures}
    if verdicts - {"unresolved"} == {"met"}:
        return "met"
    if verdicts - {"unresolved"} == {"not met"}:
        return "not met"
    return "unresolved"


def _timed(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """Wall and main-thread CPU seconds per call of ``calls`` calls of ``fn()``."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - wall) / calls, (time.thread_time() - cpu) / calls


def _contest(
    ctx: Any, contenders: dict[str, Callable[[], object]], rounds: int, calls: int
) -> dict[str, list[float]]:
    """Per contender, wall seconds per call of each round, interleaved and shuffled; and
    under ``"<name> cpu"``, the main thread's CPU seconds per call of the same rounds."""
    for fn in contenders.values():  # warm-up: buffers sized, connections hot
        for _ in range(3):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    samples.update({f"{name} cpu": [] for name in contenders})
    for index in range(rounds):
        for name in round_order(list(contenders), index):
            ctx.barrier()
            wall, cpu = _timed(contenders[name], calls)
            samples[name].append(wall)
            samples[f"{name} cpu"].append(cpu)
    return samples


def reductions(ctx: Any, mode: dict[str, int]) -> dict[str, dict[str, list[float]]]:
    """The 1M-tensor and 32-metric contenders, on every rank (inside ``distributed()``)."""
    import torch.distributed as dist

    from ddpctx import all_reduced

    world = ctx.world_size
    tensor = torch.randn(1_000_000)
    in_place = torch.randn(1_000_000)

    def by_hand() -> torch.Tensor:
        reduced = tensor.clone()
        dist.all_reduce(reduced)
        return reduced.div_(world)

    big = {
        "@all_reduced": all_reduced(lambda: tensor),
        "by hand": by_hand,
        "raw in-place": lambda: dist.all_reduce(in_place),
    }
    metrics = {f"m{i}": torch.tensor(float(i + ctx.rank)) for i in range(32)}
    small = {
        "@all_reduced": all_reduced(lambda: metrics),
        "raw stacked": lambda: dist.all_reduce(torch.stack(list(metrics.values()))),
    }
    return {
        "big": _contest(ctx, big, mode["big"], mode["big_calls"]),
        "small": _contest(ctx, small, mode["small"], mode["small_calls"]),
    }


def _block(ctx: Any, steps: int, metric: Callable[[torch.Tensor], object]) -> tuple[float, float]:
    """The median wall and main-thread CPU seconds of one of ``steps`` training steps.

    Each step is timed on its own and the block gives its medians: a step that
    met an interrupt, a collection or the other rank's page faults moves a
    block's total but not its median.
    """
    from benchmarks.workload import BATCH, FEATURES, seeded_model

    model, optimizer = seeded_model(ctx)
    data = [(torch.randn(FEATURES), torch.randn(1)) for _ in range((steps + WARM_UP) * BATCH * 2)]
    loader = ctx.dataloader(data, batch_size=BATCH)
    ctx.barrier()
    return _median_step(loader, model, optimizer, metric)


def _median_step(
    loader: Any, model: Any, optimizer: Any, metric: Callable[[torch.Tensor], object]
) -> tuple[float, float]:
    """A pass of training steps over ``loader``: the median step after the warm-up, wall and
    main-thread CPU seconds (a step: from one batch's arrival to the next's)."""
    from benchmarks.workload import train_step

    walls: list[float] = []
    cpus: list[float] = []
    wall, cpu = time.perf_counter(), time.thread_time()
    for index, (x, y) in enumerate(loader):
        metric(train_step(model, optimizer, x, y).detach())
        now, now_cpu = time.perf_counter(), time.thread_time()
        if index >= WARM_UP:
            walls.append(now - wall)
            cpus.append(now_cpu - cpu)
        wall, cpu = now, now_cpu
    return statistics.median(walls), statistics.median(cpus)


def watching(mode: dict[str, int]) -> dict[str, dict[str, list[float]]]:
    """Per row of :data:`WATCH_ROWS`: each round's block, wall and CPU (enters distributed())."""
    from benchmarks.workload import loss_site
    from ddpctx import distributed

    times: dict[str, dict[str, list[float]]] = {r: {"wall": [], "cpu": []} for r in WATCH_ROWS}
    for index in range(mode["rounds"] + 1):  # round 0 warms up
        for row in round_order(list(WATCH_ROWS), index):
            with distributed(seed=0, **WATCH_ROWS[row]) as ctx:  # type: ignore[arg-type]
                wall, cpu = _block(ctx, mode["steps"], loss_site())
            if index:
                times[row]["wall"].append(wall)
                times[row]["cpu"].append(cpu)
    return times


def watching_in_place(mode: dict[str, int]) -> dict[str, dict[str, list[float]]]:
    """One ``distributed(timings=False, straggler=False)`` block whose passes are alternately
    watched and not: the same model, loader and data, each pass's median step.

    A watched pass runs with what ``distributed(timings=True, straggler=True)`` starts
    (:class:`ddpctx.watch.faces.Watch`: the step clock's optimizer and backward hooks,
    the model's forward hooks, the loader's timing and the straggler watcher's thread
    publishing to the job's store), started before the pass and stopped after it.
    Blocks of their own differ by several percent from one another (a fresh model,
    DDP's buckets, where memory lands), more than the 1% bar; passes of one block
    do not.
    """
    from torch.distributed import distributed_c10d

    from benchmarks.workload import BATCH, FEATURES, loss_site, seeded_model
    from ddpctx import distributed
    from ddpctx.hang.inflight import Tracker
    from ddpctx.watch.faces import Watch
    from ddpctx.watch.straggler import StragglerSettings

    times: dict[str, dict[str, list[float]]] = {r: {"wall": [], "cpu": []} for r in ("on", "off")}
    times["on"]["watcher cpu"] = []  # the straggler watcher thread's CPU seconds a step
    with distributed(seed=0, **OFF) as ctx:  # type: ignore[arg-type]
        model, optimizer = seeded_model(ctx)
        site = loss_site()
        count = (mode["steps"] + WARM_UP) * BATCH * ctx.world_size
        loader = ctx.dataloader(
            [(torch.randn(FEATURES), torch.randn(1)) for _ in range(count)], batch_size=BATCH
        )
        store = distributed_c10d._get_default_store()

        def one_pass(watched: bool) -> tuple[float, float]:
            watch = None
            if watched:
                watch = Watch(
                    ctx.rank,
                    ctx.world_size,
                    None,
                    [],
                    True,
                    StragglerSettings(),
                    Tracker(),
                    store=store,
                )
                assert watch.clock is not None
                loader.timed = watch.clock.timed
                watch.watch_model(model)
            try:
                ctx.barrier()
                before = _watcher_cpu(watch)
                step = _median_step(loader, model, optimizer, site)
                if watch is not None and watch.watcher is not None:
                    steps = mode["steps"] + WARM_UP
                    times["on"]["watcher cpu"].append((_watcher_cpu(watch) - before) / steps)
                return step
            finally:
                loader.timed = None
                if watch is not None:
                    watch.stop()

        for index in range(2 * mode["rounds"] + 1):  # round 0 warms up
            for row in round_order(["on", "off"], index):
                wall, cpu = one_pass(row == "on")
                if index:
                    times[row]["wall"].append(wall)
                    times[row]["cpu"].append(cpu)
    return times


def _watcher_cpu(watch: Any) -> float:
    """CPU seconds the straggler watcher's thread has run (0: none; from its schedstat)."""
    thread = getattr(getattr(watch, "watcher", None), "_thread", None)
    native = getattr(thread, "native_id", None)
    if native is None:
        return 0.0
    try:
        return int(Path(f"/proc/self/task/{native}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def logging(mode: dict[str, int], log_dir: str) -> dict[str, dict[str, list[float]]]:
    """Per row of :data:`LOG_ROWS`: each round's block, wall and CPU, in one distributed()."""
    from ddpctx import all_reduced, distributed
    from ddpctx.watch.faces import steps_agree, take_step, with_step

    times: dict[str, dict[str, list[float]]] = {r: {"wall": [], "cpu": []} for r in LOG_ROWS}
    with distributed(seed=0, log_dir=log_dir) as ctx:
        steps = iter(range(10**9))
        _, ops = with_step({"loss": 0.0}, "mean", 0, ctx.world_size)

        @all_reduced(op=ops)
        def with_its_step(loss: torch.Tensor, step: int) -> dict[str, Any]:
            return with_step({"loss": loss}, "mean", step, ctx.world_size)[0]

        def same_reduction(loss: torch.Tensor) -> object:
            step = next(steps)
            reduced = with_its_step(loss, step)
            return steps_agree(take_step(reduced), ctx.world_size, step)

        @all_reduced
        def loss_alone(loss: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": loss}

        metric: dict[str, Callable[[torch.Tensor], object]] = {
            LOG_ROWS[0]: same_reduction,
            LOG_ROWS[1]: loss_alone,
            LOG_ROWS[2]: lambda loss: ctx.log({"loss": loss}),
        }
        for index in range(mode["rounds"] + 1):
            for row in round_order(list(LOG_ROWS), index):
                wall, cpu = _block(ctx, mode["steps"], metric[row])
                if index:
                    times[row]["wall"].append(wall)
                    times[row]["cpu"].append(cpu)
        loss = torch.tensor(float(ctx.rank) + 0.5)
        calls = {row: (lambda fn=fn: fn(loss)) for row, fn in metric.items()}
        contest = _contest(ctx, calls, mode["small"], mode["small_calls"])
        for row in LOG_ROWS:
            times[row]["call wall"] = contest[row]
            times[row]["call cpu"] = contest[f"{row} cpu"]
    return times


def job(mode_name: str, out: str) -> None:
    """Every rank of the torchrun job: all four measurements; rank 0 writes them to ``out``."""
    from ddpctx import distributed

    mode = MODES[mode_name]
    with distributed(seed=0) as ctx:
        results: dict[str, Any] = reductions(ctx, mode)
    results["watch"] = watching(mode)
    results["watch in place"] = watching_in_place(mode)
    with tempfile.TemporaryDirectory() as log_dir:
        results["log"] = logging(mode, log_dir)
    if os.environ.get("RANK", "0") == "0":
        Path(out).write_text(json.dumps(results))


def one_rank_job(mode_name: str, out: str) -> None:
    """A job of one rank: the watching passes without another rank's noise (its main-thread
    cost: the clock's hooks and the loader's timing; no straggler watcher at one rank)."""
    Path(out).write_text(json.dumps(watching_in_place(MODES[mode_name])))


def extra_us(values: list[float], references: list[float]) -> tuple[float, float, float]:
    """The median extra microseconds of ``values`` over ``references`` (round by round), and
    its interval."""
    extra = [(mine - theirs) * 1e6 for mine, theirs in zip(values, references, strict=True)]
    return median_interval(extra)


def _mean_us(seconds: list[float]) -> float:
    return statistics.fmean(seconds) * 1e6 if seconds else 0.0


def _ratio(name: str, values: list[float], reference: list[float], bar: float) -> Measure:
    return Measure(name, *median_interval(ratios(values, reference)), bar)


#: ctx.log's target: per call, against the reduction it does (its metrics and its step check).
LOG_TARGET = "ctx.log - the reduction it does (the metrics and the step check by @all_reduced)"


def measures(results: dict[str, Any]) -> dict[str, list[Measure]]:
    """Per target, its measures, from :func:`job`'s results."""
    big, small, log = results["big"], results["small"], results["log"]
    in_place, alone = results["watch in place"], results["watch one rank"]

    def extra(clock: str) -> Measure:
        found = extra_us(log["ctx.log"][f"call {clock}"], log[LOG_ROWS[0]][f"call {clock}"])
        return Measure("wall" if clock == "wall" else "main-thread CPU", *found, 20.0, "us")

    return {
        "1M float32 tensor, mean: @all_reduced / by hand (clone, all_reduce, divide)": [
            _ratio("wall", big["@all_reduced"], big["by hand"], 1.05)
        ],
        "32 scalar metrics: @all_reduced / raw all_reduce of the stacked buffer": [
            _ratio("wall", small["@all_reduced"], small["raw stacked"], 1.10)
        ],
        "step timings + straggler watcher, on / off (passes of one block, median step)": [
            _ratio("wall", in_place["on"]["wall"], in_place["off"]["wall"], 1.01),
            _ratio("main-thread CPU", in_place["on"]["cpu"], in_place["off"]["cpu"], 1.01),
            _ratio("main-thread CPU, 1 rank", alone["on"]["cpu"], alone["off"]["cpu"], 1.01),
        ],
        f"{LOG_TARGET}, per call": [extra("wall"), extra("cpu")],
    }


def table(results: dict[str, Any], mode: dict[str, int]) -> list[str]:
    """The markdown rows for BENCHMARKS.md's Targets section, verdicts included."""
    lines = [
        "| target | bar | median [95% interval]: verdict, per measure | verdict |",
        "|---|---:|---|---|",
    ]
    for target, found in measures(results).items():
        bar = f"<= {found[0].bar:g}{' µs' if found[0].unit == 'us' else 'x'}"
        cells = "; ".join(f"{m.name} {m.cell()}: {m.verdict}" for m in found)
        lines.append(f"| {target} | {bar} | {cells} | **{verdict_of(found)}** |")
    big, small, watch, log = results["big"], results["small"], results["watch"], results["log"]
    in_place, alone = results["watch in place"], results["watch one rank"]

    def between(row: str, reference: str, clock: str) -> str:
        return Measure(clock, *extra_us(log[row][clock], log[reference][clock]), 0, "us").cell()

    noise = _ratio("wall", watch["off, again"]["wall"], watch["off"]["wall"], 1.01)
    noise_cpu = _ratio("cpu", watch["off, again"]["cpu"], watch["off"]["cpu"], 1.01)
    blocks = _ratio("wall", watch["on"]["wall"], watch["off"]["wall"], 1.01)
    blocks_cpu = _ratio("cpu", watch["on"]["cpu"], watch["off"]["cpu"], 1.01)
    raw = _ratio("wall", big["@all_reduced"], big["raw in-place"], 1.0)
    hand = _ratio("wall", big["by hand"], big["raw in-place"], 1.0)
    lines += [
        "",
        f"Beside them: the 1M tensor's raw in-place `all_reduce` (no copy, no division) "
        f"{statistics.median(big['raw in-place']) * 1e3:.2f} ms a call, by hand "
        f"{statistics.median(big['by hand']) * 1e3:.2f} ms ({hand.cell()} the raw one), "
        f"`@all_reduced` {statistics.median(big['@all_reduced']) * 1e3:.2f} ms ({raw.cell()}); "
        f"32 metrics: raw {statistics.median(small['raw stacked']) * 1e3:.3f} ms, "
        f"`@all_reduced` {statistics.median(small['@all_reduced']) * 1e3:.3f} ms; "
        f"watching in blocks of their own, as a user turns it on (`distributed(timings=True, "
        f"straggler=True)` against both off): {blocks.cell()} by wall time, "
        f"{blocks_cpu.cell()} by CPU, and two blocks both off (the noise): "
        f"{noise.cell()} by wall time, "
        f"{noise_cpu.cell()} by CPU; a block or pass is {mode['steps']} steps, its median step "
        f"{statistics.median(watch['off']['wall']) * 1e6:.0f} µs off "
        f"({statistics.median(watch['off']['cpu']) * 1e6:.0f} µs of CPU). "
        f"At one rank, free of the other rank's noise, watching costs "
        f"{Measure('cpu', *extra_us(alone['on']['cpu'], alone['off']['cpu']), 0, 'us').cell()} "
        f"of main-thread CPU a step (its median step "
        f"{statistics.median(alone['off']['cpu']) * 1e6:.0f} µs of CPU off); at two ranks the "
        f"straggler watcher's own thread (it wakes once a tick, not a step) runs "
        f"{_mean_us(in_place['on'].get('watcher cpu', [])):.2f} µs of CPU a step on average. "
        f"`ctx.log`'s step check, one element more on the wire (the loss and the check by "
        f"`@all_reduced` against the loss alone): "
        f"{between(LOG_ROWS[0], LOG_ROWS[1], 'call wall')} a call by wall time, "
        f"{between(LOG_ROWS[0], LOG_ROWS[1], 'call cpu')} by CPU; in a training step "
        f"(median step of a block), `ctx.log` against the reduction it does "
        f"{between('ctx.log', LOG_ROWS[0], 'wall')} by wall time, "
        f"{between('ctx.log', LOG_ROWS[0], 'cpu')} by CPU, and against the loss alone "
        f"{between('ctx.log', LOG_ROWS[1], 'wall')} by wall time, "
        f"{between('ctx.log', LOG_ROWS[1], 'cpu')} by CPU.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about a minute: fewer rounds")
    parser.add_argument("--smoke", action="store_true", help="seconds: checks that it runs")
    parser.add_argument("--job", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--one-rank-job", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(*args.job)
        return
    if args.one_rank_job:
        one_rank_job(*args.one_rank_job)
        return
    name = "smoke" if args.smoke else "quick" if args.quick else "default"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(scratch) / "targets.json")
        subprocess.run(
            torchrun(2, __file__, "--job", name, out), env=repo_env(), check=True, timeout=1800
        )
        results = json.loads(Path(out).read_text())
        alone = str(Path(scratch) / "one-rank.json")
        subprocess.run(
            torchrun(1, __file__, "--one-rank-job", name, alone),
            env=repo_env(),
            check=True,
            timeout=900,
        )
        results["watch one rank"] = json.loads(Path(alone).read_text())
    mode = MODES[name]
    load = os.getloadavg()
    print(
        f"{name} run, 2 ranks, gloo, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
        f"{time.perf_counter() - started:.0f} s\n"
    )
    for line in table(results, mode):
        print(line)


if __name__ == "__main__":
    main()
