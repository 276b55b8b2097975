"""Cost of reducing a dict of 32 scalar metrics across ranks, as ratios to one raw all_reduce.

Run:  torchrun --standalone --nproc_per_node=2 benchmarks/bench_reduce.py [--rounds R]

Contenders, interleaved round by round so machine noise hits each alike:
  (a) floor:      one dist.all_reduce of a 32-element tensor
  (b) ddpctx:     @all_reduced on a dict of 32 scalar tensors (one collective)
  (c) per-metric: one dist.all_reduce per metric (the usual hand-written loop)
Each round times `--calls` calls per contender. The table shows the median
per-call time over rounds, the ratio of medians, and the median of the
per-round ratios (paired within a round, so slow drift of the machine cancels).
Targets: (b) <= 1.3x (a), (b) at least 8x faster than (c).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run as a file: the repository, not benchmarks/, heads sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist

from benchmarks.stats import paired_ratio, per_call
from ddpctx import all_reduced, distributed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--metrics", type=int, default=32)
    args = parser.parse_args()

    with distributed(seed=0) as ctx:
        metrics = {f"metric_{i}": torch.tensor(float(i + ctx.rank)) for i in range(args.metrics)}

        def floor() -> None:
            dist.all_reduce(torch.stack(list(metrics.values())))

        @all_reduced
        def reduced() -> dict[str, torch.Tensor]:
            return metrics

        def per_metric() -> None:
            for value in metrics.values():
                dist.all_reduce(value.clone())

        contenders: dict[str, Callable[[], object]] = {
            "(a) raw all_reduce, 1 buffer": floor,
            "(b) @all_reduced": reduced,
            "(c) all_reduce per metric": per_metric,
        }
        samples: dict[str, list[float]] = {name: [] for name in contenders}
        for fn in contenders.values():  # warm-up: buffers sized, connections hot
            for _ in range(5):
                fn()
        for _ in range(args.rounds):
            for name, fn in contenders.items():
                ctx.barrier()
                samples[name].append(per_call(fn, args.calls))

        medians = {name: statistics.median(times) for name, times in samples.items()}
        floor_name = "(a) raw all_reduce, 1 buffer"
        floor_time = medians[floor_name]
        paired = {name: paired_ratio(times, samples[floor_name]) for name, times in samples.items()}
        ctx.print(
            f"{args.metrics} scalar metrics, {ctx.world_size} ranks, backend {ctx.backend}, "
            f"{args.rounds} rounds x {args.calls} calls, torch {torch.__version__}"
        )
        ctx.print(f"{'contender':32} {'median/call':>12} {'ratio to (a)':>13} {'paired':>8}")
        for name, median in medians.items():
            ctx.print(
                f"{name:32} {median * 1e3:9.3f} ms {median / floor_time:12.2f}x "
                f"{paired[name]:7.2f}x"
            )
        speedup = medians["(c) all_reduce per metric"] / medians["(b) @all_reduced"]
        ctx.print(f"(b) is {speedup:.1f}x faster than (c)")


if __name__ == "__main__":
    main()
