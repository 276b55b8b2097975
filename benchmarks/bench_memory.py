"""Peak memory per rank: DDP (``ctx.wrap``) against ``ctx.shard``, float32, Adam.

Run:  python benchmarks/bench_memory.py [--sizes 4M 15M 60M 250M] [--world-size 2]

Prints markdown rows for BENCHMARKS.md. Each (way, size) runs as its own
torchrun job of fresh processes (gloo, CPU), so one run's peak never counts
in the next. Each rank reads its peak resident memory (``VmHWM`` in
``/proc/self/status``) once inside ``distributed()`` before the model exists
(the *base*: Python, torch, the process group) and once after three Adam
steps; the table gives the peak and the peak minus the base (what the model,
its gradients, the optimizer state and the training step cost).

Each job runs twice: with glibc's default, *dynamic* mmap threshold, and
with ``MALLOC_MMAP_THRESHOLD_`` fixed (1 MiB). FSDP2 allocates and frees
each block's unsharded weights and gradients in every step; with the
dynamic threshold glibc serves those from its heaps after the first free
and does not give the memory back, so a sharded rank's peak grows step by
step on CPU.

The model is ``BLOCKS`` ``Linear(width, width)`` layers in an
``nn.ModuleList`` (``ctx.shard``'s default: one FSDP2 unit per layer). Ways:

- ``wrap``: every rank builds the model; DDP broadcasts rank 0's weights.
- ``shard``: every rank builds the model, ``ctx.shard`` broadcasts rank 0's
  weights and keeps 1/N of them.
- ``shard-meta``: the model is built on the meta device and rank 0's weights
  come in through ``ctx.shard(model, full_state_dict=...)`` (rank 0 holds the
  whole state dict in memory, the other ranks never hold the whole model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: the repository, not benchmarks/, heads sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
from torch import nn

from benchmarks.processes import torchrun

BLOCKS = 15
WIDTHS = {"4M": 512, "15M": 1024, "60M": 2048, "250M": 4096}
WAYS = ("wrap", "shard", "shard-meta")
BATCH, STEPS = 16, 3


class Stack(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def peak_rss_mib() -> float:
    """This process's peak resident memory (``VmHWM``), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (this benchmark needs Linux)")


def rank_main(way: str, width: int, out: Path) -> None:
    """One rank of one job, inside ``distributed()``: see :func:`measure`."""
    from ddpctx import distributed

    with distributed(seed=0):
        measure(way, width, out)


def measure(way: str, width: int, out: Path) -> None:
    """Train three Adam steps in the active context; write the peaks to ``out/rank<r>.json``."""
    from ddpctx import current

    ctx = current()
    if ctx is None:
        raise RuntimeError("measure() runs inside distributed(); use rank_main() from a job")
    ctx.barrier()
    base = peak_rss_mib()
    started = time.perf_counter()
    if way == "wrap":
        model: nn.Module = ctx.wrap(Stack(width))
    elif way == "shard":
        model = ctx.shard(Stack(width))
    else:
        with torch.device("meta"):
            bare = Stack(width)
        weights = Stack(width).state_dict() if ctx.is_main else None
        model = ctx.shard(bare, full_state_dict=weights)
        del weights
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(BATCH, width)
    for _ in range(STEPS):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    ctx.barrier()
    row = {"rank": ctx.rank, "base": base, "peak": peak_rss_mib()}
    row["seconds"] = time.perf_counter() - started
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(row))


def run_job(
    way: str, size: str, world_size: int, timeout: float, mmap_threshold: int | None
) -> list[dict[str, float]]:
    command = torchrun(world_size, __file__, "--rank-main", way, WIDTHS[size])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    with tempfile.TemporaryDirectory() as out:
        command.append(out)
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"{way} {size} failed:\n{done.stderr[-3000:]}")
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=list(WAYS))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument(
        "--mmap-thresholds",
        nargs="+",
        default=["dynamic", "1048576"],
        help="glibc's MALLOC_MMAP_THRESHOLD_ for the ranks: 'dynamic' (unset) or bytes",
    )
    parser.add_argument("--rank-main", nargs=3, help=argparse.SUPPRESS)  # way, width, out dir
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.rank_main[0], int(args.rank_main[1]), Path(args.rank_main[2]))
        return
    params = {size: BLOCKS * (width * width + width) for size, width in WIDTHS.items()}
    print(f"{args.world_size} ranks, gloo on CPU, float32, Adam, {STEPS} steps, batch {BATCH}")
    print()
    print(
        "| parameters | way | glibc mmap threshold | peak per rank (MiB) "
        "| peak - base per rank (MiB) | seconds |"
    )
    print("|---|---|---|---:|---:|---:|")
    for size in args.sizes:
        for threshold in args.mmap_thresholds:
            fixed = None if threshold == "dynamic" else int(threshold)
            shown = "dynamic (default)" if fixed is None else f"{fixed / 2**20:g} MiB"
            for way in args.ways:
                rows = run_job(way, size, args.world_size, args.timeout, fixed)
                peaks = " / ".join(f"{row['peak']:.0f}" for row in rows)
                costs = " / ".join(f"{row['peak'] - row['base']:.0f}" for row in rows)
                seconds = max(row["seconds"] for row in rows)
                print(
                    f"| {params[size] / 1e6:.1f}M | {way} | {shown} | {peaks} | {costs} "
                    f"| {seconds:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
