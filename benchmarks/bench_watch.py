"""What watching costs a training step: timings on vs off, ``ctx.log`` every step vs never.

Run:  python benchmarks/bench_watch.py --jobs 6 [--steps 1500]
      torchrun --standalone --nproc_per_node=2 benchmarks/bench_watch.py [--rounds 40 --block 60]

Two ranks (gloo, CPU) train the small DDP model of ``workload.py`` (32 -> 128 -> 1,
batches of 64 from ``ctx.dataloader``) and reduce the loss with ``@all_reduced`` each
step, as the hang doctor's benchmark does. Each round enters ``distributed()`` once per
row, in a new random order (the same on both ranks), warms up 10 steps and times a
block of ``--block`` steps; entering and leaving are not timed. Printed per row: the
median step and the median over rounds of the row's block time to ``plain``'s block
in the same round (paired, so the machine's drift cancels):

- ``plain`` and ``plain, again``: ``distributed(timings=False, straggler=False)``
  (their ratio is the noise);
- ``timings + straggler``: the defaults (the step clock, the gradient marks, the
  straggler watcher's thread publishing once a second);
- ``+ ctx.log every step``: the defaults, and ``ctx.log({"loss": loss})`` after each
  step written by rank 0's thread to ``metrics.jsonl`` (instead of ``@all_reduced``:
  the loss's one reduction moves into ``ctx.log``).

``--jobs N`` runs each row as a whole 2-rank torchrun job instead (one block, 100
steps of warm-up, ``--steps`` timed), N rounds of the rows in turn, and prints each
job's median step and the median over rounds of each row's ratio to ``plain`` in the
same round. It is the way to measure on torch/ddpctx versions where entering many
blocks in one job is not safe.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: the repository, not benchmarks/, heads sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.processes import median_step, print_median_step, torchrun
from benchmarks.stats import paired_ratio, round_order
from benchmarks.workload import BATCH, FEATURES, loss_site, seeded_model, train_step
from ddpctx import distributed

ROWS = ("plain", "plain, again", "timings + straggler", "+ ctx.log every step")


def block(row: str, steps: int, log_dir: str, warm_up: int = 10) -> tuple[float, float]:
    """``(block seconds, median step seconds)`` of ``steps`` steps of ``row``."""
    options: dict[str, Any] = {}
    if row.startswith("plain"):
        options = {"timings": False, "straggler": False}
    if row == "+ ctx.log every step":
        options["log_dir"] = log_dir
    logging = "log_dir" in options
    with distributed(seed=0, **options) as ctx:
        model, optimizer = seeded_model(ctx)
        samples = (steps + warm_up) * BATCH * 2
        data = [(torch.randn(FEATURES), torch.randn(1)) for _ in range(samples)]
        loader = ctx.dataloader(data, batch_size=BATCH)  # type: ignore[arg-type]
        step_loss = loss_site()
        times = []
        ctx.barrier()
        began = last = time.perf_counter()
        for index, (x, y) in enumerate(loader):
            if index == warm_up:
                began = last  # the warm-up is over
            loss = train_step(model, optimizer, x, y)
            if logging:
                ctx.log({"loss": loss.detach()})
            else:
                step_loss(loss.detach())
            now = time.perf_counter()
            if index >= warm_up:
                times.append(now - last)
            last = now
        return last - began, statistics.median(times)


def job_rounds(rounds: int, steps: int) -> None:
    medians: dict[str, list[float]] = {row: [] for row in ROWS}
    for round_index in range(rounds):
        for row in round_order(ROWS, round_index):
            medians[row].append(median_step(torchrun(2, __file__, "--one-job", row, steps)))
    print(f"{rounds} rounds of one 2-rank job per row, {steps} timed steps each\n")
    print("| row | median step per job, µs | job / plain (paired, median over rounds) |")
    print("|---|---|---:|")
    for row in ROWS:
        paired = paired_ratio(medians[row], medians["plain"])
        jobs = ", ".join(f"{m * 1e6:.0f}" for m in medians[row])
        print(f"| {row} | {jobs} | {paired:.3f}x |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--block", type=int, default=60)
    parser.add_argument("--jobs", type=int, default=0, help="rounds of whole jobs instead")
    parser.add_argument("--steps", type=int, default=1500, help="timed steps per job")
    parser.add_argument("--one-job", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_job:
        row, steps = args.one_job
        with tempfile.TemporaryDirectory() as log_dir:
            _, median = block(row, int(steps), log_dir, warm_up=100)
        if os.environ.get("RANK", "0") == "0":
            print_median_step(median)
        return
    if args.jobs:
        job_rounds(args.jobs, args.steps)
        return
    blocks: dict[str, list[float]] = {row: [] for row in ROWS}
    medians: dict[str, list[float]] = {row: [] for row in ROWS}
    with tempfile.TemporaryDirectory() as log_dir:
        for round_index in range(args.rounds + 1):  # one round of warm-up
            for row in round_order(ROWS, round_index):  # the same order on both ranks
                elapsed, median = block(row, args.block, log_dir)
                if round_index > 0:
                    blocks[row].append(elapsed)
                    medians[row].append(median)
    if os.environ.get("RANK", "0") == "0":
        print(f"{args.rounds} rounds of {args.block} steps per row, rank 0\n")
        print("| row | median step | block / plain (paired, median over rounds) |")
        print("|---|---:|---:|")
        for row in ROWS:
            paired = paired_ratio(blocks[row], blocks["plain"])
            median = statistics.median(medians[row]) * 1e6
            print(f"| {row} | {median:.1f} µs | {paired:.3f}x |")


if __name__ == "__main__":
    main()
