"""Where the hang doctor's cost on a training step comes from (issue 23).

Run:  python benchmarks/bench_doctor.py [--rounds 300] [--block 8]
      python benchmarks/bench_doctor.py --jobs 10 [--steps 1500]

Two ranks (gloo, CPU) train the small DDP model of ``run.py``'s section 2
and reduce the loss with ``@all_reduced`` each step. The rows take turns in
blocks of ``--block`` steps, in a new random order each round (the same on
both ranks), and differ only in what runs beside the loop:

- ``off`` and ``off, again``: nothing (their difference is the noise);
- ``trackers only``: the doctor's wrappers of the collectives, of
  ``torch.autograd.backward`` and of DDP's forward, without its thread;
- ``an idle thread only``: a Python thread that waits on an event, as the
  doctor's watchdog does between its once-a-second ticks, without the wrappers;
- ``doctor, no thread``: the doctor with its watchdog thread not started
  (the wrappers, and its store keys written as at a start);
- ``hang doctor on``: both, as ``distributed()`` starts them.

Printed per row: the median of the per-step model part (forward, backward,
optimizer step) and metric part in µs, and the median over rounds of the
row's block time to ``off``'s in the same round.

Started per block, the doctor is started and stopped hundreds of times; a
user starts it once per job. ``--jobs N`` measures that instead: N pairs of
2-rank torchrun jobs, the doctor off (``DDPCTX_HANG_TIMEOUT=0``) and on
(``60``) in turn, each timing ``--steps`` steps of the same loop after 100
steps of warm-up, its watchdog ticking once a second throughout. Printed: each
job's median step and the median of the paired ratios, on to off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run as a file: the repository, not benchmarks/, heads sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.processes import median_step, print_median_step, torchrun
from benchmarks.stats import paired_ratio, round_order
from benchmarks.workload import BATCH, FEATURES, active, loss_site, seeded_model, train_step
from ddpctx import launch
from ddpctx.hang.inflight import Tracker, install
from ddpctx.hang.settings import HangSettings
from ddpctx.hang.watchdog import Doctor, Watchdog

ROWS = (
    "off",
    "off, again",
    "trackers only",
    "an idle thread only",
    "doctor, no thread",
    "hang doctor on",
)


def idle_thread() -> Callable[[], None]:
    """A started thread that only waits, as the watchdog between ticks; returns its stop."""
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [None for _ in iter(lambda: stop.wait(1.0), True)])
    thread.start()

    def end() -> None:
        stop.set()
        thread.join()

    return end


def start(row: str, rank: int, world_size: int) -> Callable[[], None]:
    """Start what ``row`` runs beside the loop; returns what undoes it."""
    if row == "trackers only":
        return install(Tracker(), check=None, cuda=False)
    if row == "an idle thread only":
        return idle_thread()
    if row == "hang doctor on":
        return Doctor(HangSettings(60.0, "report", False), rank, world_size, False).stop
    if row == "doctor, no thread":
        started = Watchdog.start
        Watchdog.start = lambda self: self  # type: ignore[method-assign]
        try:
            doctor = Doctor(HangSettings(60.0, "report", False), rank, world_size, False)
        finally:
            Watchdog.start = started  # type: ignore[method-assign]
        return doctor.stop
    return lambda: None


def training_step() -> Callable[[], tuple[float, float]]:
    """One step of the loop, in the current context; returns its model and metric parts."""
    model, optimizer = seeded_model(active())
    x, y = torch.randn(BATCH, FEATURES), torch.randn(BATCH, 1)
    step_loss = loss_site()
    clock = time.perf_counter

    def step() -> tuple[float, float]:
        t0 = clock()
        loss = train_step(model, optimizer, x, y)
        t1 = clock()
        step_loss(loss.detach())
        return t1 - t0, clock() - t1

    return step


def rank_times(rounds: int, block: int) -> dict[str, dict[str, list[float]]]:
    ctx = active()
    step = training_step()
    times: dict[str, dict[str, list[float]]] = {
        row: {"block": [], "model": [], "metric": []} for row in ROWS
    }
    clock = time.perf_counter
    for round_index in range(rounds + 2):  # two rounds of warm-up
        for row in round_order(ROWS, round_index):  # the same order on both ranks
            undo = start(row, ctx.rank, ctx.world_size)
            ctx.barrier()
            began = clock()
            parts = [step() for _ in range(block)]
            elapsed = clock() - began
            undo()
            if round_index >= 2:
                times[row]["block"].append(elapsed)
                times[row]["model"] += [model_part for model_part, _ in parts]
                times[row]["metric"] += [metric_part for _, metric_part in parts]
    return times


def one_job(steps: int) -> None:
    """Under torchrun: 100 steps of warm-up, then ``steps`` timed; rank 0 prints the median."""
    from ddpctx import distributed

    with distributed(seed=0) as ctx:
        step = training_step()
        for _ in range(100):
            step()
        ctx.barrier()
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            step()
            times.append(time.perf_counter() - began)
        if ctx.rank == 0:
            print_median_step(statistics.median(times))


def job_pairs(pairs: int, steps: int) -> None:
    medians: dict[str, list[float]] = {"0": [], "60": []}
    for pair in range(pairs):
        for seconds in ("0", "60") if pair % 2 == 0 else ("60", "0"):  # alternate who goes first
            env = {**os.environ, "DDPCTX_HANG_TIMEOUT": seconds}
            command = torchrun(2, __file__, "--one-job", steps)
            medians[seconds].append(median_step(command, env))
    for seconds, label in (("0", "doctor off"), ("60", "doctor on")):
        print(f"{label}: median step per job, µs: {[round(m * 1e6) for m in medians[seconds]]}")
    on_off = paired_ratio(medians["60"], medians["0"])
    print(f"on / off, median of {pairs} paired jobs: {on_off:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=0, help="pairs of whole jobs instead")
    parser.add_argument("--steps", type=int, default=1500, help="timed steps per job")
    parser.add_argument("--one-job", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_job:
        one_job(args.one_job)
        return
    if args.jobs:
        job_pairs(args.jobs, args.steps)
        return
    os.environ["DDPCTX_HANG_TIMEOUT"] = "0"  # the rows start their own doctor
    times = launch(rank_times, args.rounds, args.block, world_size=2, timeout=1800)[0]
    print(f"{args.rounds} rounds of {args.block} steps per row, rank 0\n")
    print("| row | model part | metric part | block / off (paired) |\n|---|---:|---:|---:|")
    off = times["off"]["block"]
    for row, parts in times.items():
        model_part = statistics.median(parts["model"]) * 1e6
        metric_part = statistics.median(parts["metric"]) * 1e6
        paired = paired_ratio(parts["block"], off)
        print(f"| {row} | {model_part:.1f} µs | {metric_part:.1f} µs | {paired:.3f}x |")


if __name__ == "__main__":
    main()
