"""Where the microseconds of one ``@all_reduced`` loss call go, in a training step (issue 23).

Run:  python benchmarks/bench_call.py [--samples 600]

Two ranks (gloo, CPU) train the small DDP model of ``run.py``'s section 2.
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
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpctx import all_reduced, current, launch
from ddpctx.reduce.collectives import Reduction
from ddpctx.utils.issuing import ISSUING


def pieces_us(samples: int) -> dict[str, float]:
    """On each rank: the median microseconds of each piece, each timed after a step."""
    ctx = current()
    assert ctx is not None
    torch.manual_seed(0)
    model = ctx.wrap(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randn(64, 1)

    @all_reduced
    def step_loss(loss: torch.Tensor) -> torch.Tensor:
        return loss

    @all_reduced(async_op=True)
    def step_loss_async(loss: torch.Tensor) -> torch.Tensor:
        return loss

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
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss = loss.detach()
        name = names[index % len(names)]  # the same piece on both ranks: collectives pair
        began = clock()
        pieces[name](loss)
        elapsed = clock() - began
        if index >= 0:
            times[name].append(elapsed)
    return {name: statistics.median(values) / 1e3 for name, values in times.items()}


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
