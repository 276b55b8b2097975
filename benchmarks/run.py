"""ddpctx next to what users would otherwise pick, in one run, as ratios.

Run:  python benchmarks/run.py [--quick] [--world-size 2] [--write]
      python benchmarks/run.py --only reduction --sizes 32 --rounds 500 --calls 10

1. Metric reduction: dicts of 1, 8, 32, 128 scalar metrics and one 1M-element
   tensor -- one raw all_reduce (the floor), @all_reduced, a per-metric loop,
   Lightning Fabric's all_reduce on the dict, Accelerate's reduce
   (PartialState(cpu=True)), Ignite's idist.all_reduce per metric.
   Also a float32 tensor with integer counts ("mixed").
2. Training step: one small DDP model (ctx.wrap, torch's own DDP) and the same
   data, a hand-written loop (DataLoader + DistributedSampler, a raw
   all_reduce) vs ctx.dataloader / @all_reduced per step, synchronous and with
   async_op=True (each step's loss read one step later; torch's own async
   all_reduce as its reference), and the floor of what @all_reduced promises
   (a float64 sum, a new tensor back) in torch alone; the ddpctx loop also
   with the hang doctor on (hang_timeout=60) and in debug mode (debug=True).
   Each step's parts (next batch, model, metric) are timed too, and each
   block's main-thread CPU: every ratio comes with a 95% bootstrap interval,
   and a target is read as met, not met or unresolved by this run against it.
   2b: per-call CPU cost in one process, @all_reduced vs torch.stack(...).tolist().
3. Start-up and teardown: `with distributed()` vs init_process_group +
   destroy_process_group, one process and 2 ranks (under torchrun).
4. Import cost: `import ddpctx` (with its torch-using modules) vs `import torch`.
5. Test harness: per-test cost through the plugin's warm pool vs fresh
   processes per test (benchmarks/bench_harness.py).
6. Scaling: the 32-metric reduction at 2, 4 and 8 ranks (oversubscribed on 2 cores).

Contenders are interleaved round by round, in a new order each round (the same
on every rank), so machine noise and what one contender leaves behind hit
each alike; the tables show medians and ratios. Anchors that are not installed (extra
`bench`) are reported as missing; the rest still runs. `--write` regenerates
BENCHMARKS.md and benchmarks/reduction.png from this run.

This file only reads the command line and calls the sections, which live by subject:
1 and 6 in benchmarks/reduction.py, 2 in training.py, 2b in bench_call.py, 3 and 4 in
startup.py, 5 in bench_harness.py; the page is made by report.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository, not benchmarks/, heads sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.bench_call import cpu_section
from benchmarks.bench_harness import harness_section
from benchmarks.processes import HERE
from benchmarks.reduction import Samples, default_sizes, plot, reduction_section, scaling_section
from benchmarks.report import Report, machine, write_page
from benchmarks.startup import startup_section
from benchmarks.training import training_section

SECTIONS = ("reduction", "training", "cpu", "startup", "harness", "scaling")


def arguments() -> argparse.Namespace:
    """The command line, checked: ``--only`` names known sections, ``--write`` a whole run."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, sizes (3-4 min)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="regenerate BENCHMARKS.md")
    parser.add_argument(
        "--sizes",
        default="",
        help="comma-separated reduction sizes to run, e.g. 32 (default: all; not with --write)",
    )
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default: 25, quick 8)")
    parser.add_argument("--calls", type=int, default=0, help="calls per round (default: 40)")
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated sections to run, of {','.join(SECTIONS)} (not with --write)",
    )
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    if only - set(SECTIONS):
        parser.error(f"--only {args.only}: unknown {sorted(only - set(SECTIONS))}; use {SECTIONS}")
    if (only or args.sizes or args.rounds or args.calls) and args.write:
        parser.error(
            "--only, --sizes, --rounds or --calls with --write would write a page unlike the "
            "others; drop one of them"
        )
    args.only = only or set(SECTIONS)
    return args


def main() -> None:
    args = arguments()
    quick, world = args.quick, args.world_size
    rounds, calls = (8, 20) if quick else (25, 40)
    rounds, calls = args.rounds or rounds, args.calls or calls
    sizes = [size.strip() for size in args.sizes.split(",")] if args.sizes else default_sizes(quick)
    started = time.perf_counter()
    report = Report()
    say = report.say
    say(machine(quick, rounds))

    per_size: Samples = {}
    if "reduction" in args.only:
        per_size = reduction_section(say, sizes, rounds, calls, world)
    if "training" in args.only:
        training_section(say, quick, world)
    if "cpu" in args.only:
        cpu_section(say, quick)
    if "startup" in args.only:
        startup_section(say, quick, world)
    if "harness" in args.only:
        harness_section(say, quick)
    if "scaling" in args.only:
        scaling_section(say, quick, rounds, calls)
    say(f"\nTotal benchmark time: {time.perf_counter() - started:.0f} s.")
    if args.write:
        plot(per_size, HERE / "reduction.png")
        write_page(report.lines)


if __name__ == "__main__":
    main()
