"""Where the microseconds of one ``@all_reduced`` loss call go, in a training step (issue 23).

Run:  python benchmarks/bench_call.py [--samples 600]

Two ranks (gloo, CPU) train the small DDP model of ``run.py``'s section 2
(``benchmarks/workload.py``).
After each step, one piece of the per-step loss reduction is timed -- a
different piece each step, in turn, the same on both ranks -- so every piece
is timed in the state a real call meets: caches cooled by the forward,
backward and optimizer step. Timed warm, in a loop, the same pieces cost a
third of this (ten Python calls: 1.4 µs warm, 4.2 µs after a step; one
``torch.scalar_tensor``: 4 µs warm, 12 µs after a step).

The pieces are those of the steady state of a site whose result is one
floating 0-d CPU tensor (a loss): the whole call, synchronous and
``async_op=True``; torch alone doing what the call promises (a float64
sum, a new tensor of the loss's dtype back: the floor) and the hand-written
``all_reduce`` of a clone divided in place; then the call's parts -- the
fast path's pack (its checks, ``item()`` and the float64 buffer) and unpack
(the mean and the tensor back), the buffer's ``tolist()``, the handle of
``async_op=True``, debug mode's site label, the check that the site agreed
in the current default group, and the decorator's own frame. ``nothing``
is the timer's own cost. Printed: each piece's median on both ranks, in µs.
The hang doctor is off (its wrappers are timed in ``run.py``'s section 2).

Also ``run.py``'s section 2b (:func:`cpu_section`): :func:`per_call_cpu`, the
CPU cost of one ``@all_reduced`` call on 32 0-d tensors in one process, where
there is no collective, against ``torch.stack(...).tolist()`` of them.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: the repository, not benchmarks/, heads sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist

from benchmarks.report import Say
from benchmarks.stats import paired_ratio, per_call
from benchmarks.workload import BATCH, FEATURES, active, loss_site, seeded_model, train_step
from ddpctx import all_reduced, distributed, launch
from ddpctx.reduce.collectives import Reduction
from ddpctx.utils.issuing import ISSUING


def pieces_us(samples: int) -> dict[str, float]:
    """On each rank: the median microseconds of each piece, each timed after a step."""
    ctx = active()
    model, optimizer = seeded_model(ctx)
    x, y = torch.randn(BATCH, FEATURES), torch.randn(BATCH, 1)
    step_loss, step_loss_async = loss_site(), loss_site(async_op=True)

    warm = torch.tensor(0.5)
    for _ in range(2):  # both sites agree on their structure: the steady state from here
        step_loss(warm)
        step_loss_async(warm).result()
    site = inspect.getclosurevars(step_loss).nonlocals["site"]
    fast = site.fast
    assert fast is not None, "the loss site has no steady state"
    assert fast.loss, "the loss site's steady state is not the one-value one"
    buffer = torch.full((1,), 1.0, dtype=torch.float64)
    numbers = buffer.tolist()

    def summed(tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def floor(loss: torch.Tensor) -> torch.Tensor:
        total = summed(torch.full((1,), loss.item(), dtype=torch.float64)).tolist()[0]
        return torch.scalar_tensor(total / ctx.world_size, dtype=loss.dtype)

    def identity(value: Any) -> Any:
        return value

    @functools.wraps(identity)
    def decorated(*args: Any, **kwargs: Any) -> Any:  # the decorator's frame, as it is
        try:
            result = identity(*args, **kwargs)
        except BaseException:
            raise
        return result

    pieces: dict[str, Callable[[torch.Tensor], object]] = {
        "@all_reduced call": step_loss,
        "@all_reduced(async_op=True) call + .result()": lambda loss: step_loss_async(loss).result(),
        "floor: float64 sum, tensor back (torch)": floor,
        "hand-written: all_reduce(clone), /= world": lambda loss: summed(loss.clone()).div_(2),
        "fast path pack": fast.pack,
        "  of which item() + float64 buffer": lambda loss: torch.full(
            (1,), loss.item(), dtype=torch.float64
        ),
        "fast path unpack": lambda loss: fast.unpack(buffer, numbers),
        "  of which scalar_tensor (the tensor back)": lambda loss: torch.scalar_tensor(
            0.25, dtype=loss.dtype
        ),
        "buffer.tolist()": lambda loss: buffer.tolist(),
        "async handle + .result()": lambda loss: Reduction(lambda: loss).result(),
        "debug label (ISSUING set + reset)": lambda loss: ISSUING.reset(ISSUING.set("site")),
        "site agreed in the default group": lambda loss: site.group() is dist.group.WORLD,
        "decorator frame": decorated,
        "nothing": lambda loss: None,
    }
    names = list(pieces)
    times: dict[str, list[int]] = {name: [] for name in names}
    clock = time.perf_counter_ns
    for index in range(-50, samples * len(names)):  # 50 steps of warm-up
        loss = train_step(model, optimizer, x, y).detach()
        name = names[index % len(names)]  # the same piece on both ranks: collectives pair
        began = clock()
        pieces[name](loss)
        elapsed = clock() - began
        if index >= 0:
            times[name].append(elapsed)
    return {name: statistics.median(values) / 1e3 for name, values in times.items()}


def per_call_cpu(rounds: int, calls: int) -> dict[str, list[float]]:
    """Single process: @all_reduced on 32 0-d tensors vs torch.stack(...).tolist() of them.

    With one rank there is no collective: this is the CPU cost of packing,
    checking and unpacking, the floor a GPU user feels next to a 10-20 us
    NCCL all_reduce.
    """
    results: dict[str, list[float]] = {
        "torch.stack(...).tolist()": [],
        "torch.stack(...).unbind() (tensors back)": [],
        "ddpctx @all_reduced": [],
    }
    with distributed():
        metrics = {f"m{i}": torch.tensor(float(i)) for i in range(32)}
        contenders = {
            "torch.stack(...).tolist()": lambda: torch.stack(list(metrics.values())).tolist(),
            "torch.stack(...).unbind() (tensors back)": lambda: dict(
                zip(metrics, torch.stack(list(metrics.values())).unbind(0), strict=True)
            ),
            "ddpctx @all_reduced": all_reduced(lambda: metrics),
        }
        for fn in contenders.values():
            for _ in range(50):
                fn()
        for _ in range(rounds):
            for name, fn in contenders.items():
                results[name].append(per_call(fn, calls))
    return results


def cpu_section(say: Say, quick: bool) -> None:
    """Section 2b of ``run.py``: :func:`per_call_cpu`'s medians and paired ratios."""
    say("\n## 2b. Per-call CPU cost, one process, 32 scalar tensors (median)\n")
    cpu = per_call_cpu(10 if quick else 30, 200)
    bare = cpu["torch.stack(...).tolist()"]
    say("| | median per call | / stack + tolist (paired per round) |\n|---|---:|---:|")
    for name, times in cpu.items():
        target = "; target <= 2x" if name == "ddpctx @all_reduced" else ""
        say(
            f"| {name} | {statistics.median(times) * 1e6:.1f} us "
            f"| {paired_ratio(times, bare):.2f}x{target} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=600, help="timings per piece per rank")
    args = parser.parse_args()
    os.environ["DDPCTX_HANG_TIMEOUT"] = "0"  # the doctor's wrappers are timed in run.py
    ranks = launch(pieces_us, args.samples, world_size=2, timeout=1800)
    print(f"{args.samples} timings per piece per rank, each after a training step; median µs\n")
    print("| piece | rank 0 | rank 1 |\n|---|---:|---:|")
    for name in ranks[0]:
        print(f"| {name} | {ranks[0][name]:.1f} | {ranks[1][name]:.1f} |")


if __name__ == "__main__":
    main()
