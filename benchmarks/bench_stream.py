"""Throughput of ``ctx.dataloader`` over a stream vs a plain DataLoader over the same stream.

Run:  python benchmarks/bench_stream.py [--rounds 7] [--samples 4096] [--batch 64]

One process (world size 1), CPU tensors. The stream yields numbered samples
of 32 floats, each costing ``--work`` microseconds of Python-side work first
(0: the loaders' own cost dominates; 20: a light decode or tokenisation).
Contenders, interleaved round by round so a busy machine's drift hits all:

- ``plain, 0 workers``: ``DataLoader(stream, batch_size)``;
- ``ddpctx, 0 workers``: what ``ctx.dataloader(stream, batch_size)`` builds
  (merging, per-batch seeding with the rank's generators put aside, a
  position), over the same stream;
- ``plain, 2 workers`` and ``ddpctx, 2 workers``: the same stream declaring
  ``splits_itself = "ranks_and_workers"`` (it reads only its worker's
  samples), so the plain DataLoader does not read every sample twice.

The contenders take turns in a new order each round (``round_order``).
Printed: median samples per second of each (wall time), and the medians of
the per-round ratios (ddpctx / plain) of wall time and of the main thread's
CPU time (torch runs single-threaded here), each with its 95% bootstrap
interval and the verdict against the target of <= 1.05x: *met* when the
interval lies at or under it, *not met* over it, *unresolved* when it holds
it (then run more rounds or a quieter machine). The CPU time
leaves out what a busy machine gives to other processes, so on a shared runner
it is the steadier measure of the loader's own cost without workers; with
workers the reading happens in the workers, whose CPU time it does not count,
so there only the wall time tells.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: the repository, not benchmarks/, heads sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from benchmarks.stats import median_interval, ratios, round_order, verdict
from ddpctx.data.streambuild import make_stream_loader


def loop_for(microseconds: float) -> int:
    """How long ``sum(range(n))`` must be to take about ``microseconds`` of CPU here."""
    if microseconds <= 0:
        return 0
    began = time.process_time()
    sum(range(2_000_000))
    per_us = 2_000_000 / max((time.process_time() - began) * 1e6, 1.0)
    return int(per_us * microseconds)


class Stream(IterableDataset[torch.Tensor]):
    """``samples`` numbered tensors, each after a fixed Python loop (``work`` iterations).

    A fixed amount of CPU work, not a wait on the clock: a process the busy
    machine pauses mid-sample still does the same work per sample.
    """

    def __init__(self, samples: int, work: int, split_workers: bool) -> None:
        self.samples, self.work = samples, work
        if split_workers:
            self.splits_itself = "ranks_and_workers"

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        split = getattr(self, "splits_itself", None) is not None
        numbers = range(first, self.samples, step) if split else range(self.samples)
        for number in numbers:
            if self.work:
                sum(range(self.work))
            yield torch.full((32,), float(number))


def seconds(loader: Any) -> tuple[float, float]:
    """(wall, main-thread CPU) seconds of one pass."""
    began, cpu = time.perf_counter(), time.thread_time()
    for _ in loader:
        pass
    return time.perf_counter() - began, time.thread_time() - cpu


def contenders(samples: int, batch: int, work: int) -> dict[str, Any]:
    def ours(workers: int) -> Any:
        return make_stream_loader(
            Stream(samples, work, workers > 0), batch, shuffle=False, shuffle_buffer=None,
            pad=True, base_seed=0, rank=0, world_size=1, device=torch.device("cpu"),
            loader_kwargs={"num_workers": workers}, name=None, agree=None,
        )  # fmt: skip

    return {
        "plain, 0 workers": DataLoader(Stream(samples, work, False), batch_size=batch),
        "ddpctx, 0 workers": ours(0),
        "plain, 2 workers": DataLoader(
            Stream(samples, work, True), batch_size=batch, num_workers=2
        ),
        "ddpctx, 2 workers": ours(2),
    }


TARGET = 1.05


def interval_cell(values: list[float], references: list[float]) -> str:
    """``ratio [low, high]: verdict`` of ``values`` paired with ``references`` round by round."""
    middle, low, high = median_interval(ratios(values, references))
    return f"{middle:.3f}x [{low:.3f}, {high:.3f}]: {verdict(low, high, TARGET)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--work", type=float, nargs="+", default=[0.0, 20.0])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# {args.samples} samples, batches of {args.batch}, {args.rounds} rounds")
    print(f"# ratios: median of per-round ratios [95% interval]: verdict for <= {TARGET}x")
    print("| per-sample work | loader | samples/s | wall vs plain | CPU vs plain |")
    print("|---|---|---:|---:|---:|")
    for work in args.work:
        loaders = contenders(args.samples, args.batch, loop_for(work))
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in loaders}
        for round_index in range(args.rounds):
            for name in round_order(list(loaders), round_index):
                times[name].append(seconds(loaders[name]))
        for name in loaders:
            rate = args.samples / statistics.median(wall for wall, _ in times[name])
            if name.startswith("plain"):
                print(f"| {work:g} us | {name} | {rate:,.0f} | 1.000 | 1.000 |")
                continue
            plain = times[name.replace("ddpctx", "plain")]
            cells = [
                interval_cell([t[i] for t in times[name]], [t[i] for t in plain]) for i in (0, 1)
            ]
            print(f"| {work:g} us | {name} | {rate:,.0f} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
