"""What watching costs a training step: timings on vs off, ``ctx.log`` every step vs never.

Run:  python benchmarks/bench_watch.py --jobs 6 [--steps 1500]
      torchrun --standalone --nproc_per_node=2 benchmarks/bench_watch.py [--rounds 40 --block 60]

Two ranks (gloo, CPU) train the small DDP model of ``bench_doctor.py`` (32 -> 128 -> 1,
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
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

from ddpctx import all_reduced, distributed

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
        torch.manual_seed(0)
        model = ctx.wrap(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 1)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        data = [(torch.randn(32), torch.randn(1)) for _ in range((steps + warm_up) * 64 * 2)]
        loader = ctx.dataloader(data, batch_size=64)

        @all_reduced
        def step_loss(loss: torch.Tensor) -> torch.Tensor:
            return loss

        times = []
        ctx.barrier()
        began = last = time.perf_counter()
        for index, (x, y) in enumerate(loader):
            if index == warm_up:
                began = last  # the warm-up is over
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
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
        order = list(ROWS)
        random.Random(round_index).shuffle(order)
        for row in order:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            output = subprocess.run(
                [*command, "--nproc_per_node=2", __file__, "--one-job", row, str(steps)],
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            ).stdout
            found = [line for line in output.splitlines() if line.startswith("MEDIAN-STEP ")]
            medians[row].append(float(found[0].split()[1]))
    print(f"{rounds} rounds of one 2-rank job per row, {steps} timed steps each\n")
    print("| row | median step per job, µs | job / plain (paired, median over rounds) |")
    print("|---|---|---:|")
    for row in ROWS:
        paired = statistics.median(
            a / b for a, b in zip(medians[row], medians["plain"], strict=True)
        )
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
            print(f"MEDIAN-STEP {median!r}", flush=True)
        return
    if args.jobs:
        job_rounds(args.jobs, args.steps)
        return
    blocks: dict[str, list[float]] = {row: [] for row in ROWS}
    steps: dict[str, list[float]] = {row: [] for row in ROWS}
    with tempfile.TemporaryDirectory() as log_dir:
        for round_index in range(args.rounds + 1):  # one round of warm-up
            order = list(ROWS)
            random.Random(round_index).shuffle(order)  # seeded: the same order on both ranks
            for row in order:
                elapsed, median = block(row, args.block, log_dir)
                if round_index > 0:
                    blocks[row].append(elapsed)
                    steps[row].append(median)
    if os.environ.get("RANK", "0") == "0":
        print(f"{args.rounds} rounds of {args.block} steps per row, rank 0\n")
        print("| row | median step | block / plain (paired, median over rounds) |")
        print("|---|---:|---:|")
        for row in ROWS:
            paired = statistics.median(
                a / b for a, b in zip(blocks[row], blocks["plain"], strict=True)
            )
            median = statistics.median(steps[row]) * 1e6
            print(f"| {row} | {median:.1f} µs | {paired:.3f}x |")


if __name__ == "__main__":
    main()
