"""What a checkpoint costs against torch's own way, checksums on: the four targets, one run.

Run:  python benchmarks/bench_checkpoint_cost.py [--rounds 9] [--layers 16] [--width 2048]

Measured as a user would, side by side, interleaved round by round (the
contenders' order shuffled anew each round, the same on every rank), gloo on
CPU, a model of ``--layers`` x ``Linear(--width, --width)`` (the default,
16 x 2048: 268 MB of float32 weights):

- ``ctx.shard`` at 2 and 3 ranks: ``ctx.save_checkpoint`` / ``ctx.load_checkpoint``
  against ``dcp.save`` / ``dcp.load`` of ``get_model_state_dict`` (the load then
  ``set_model_state_dict``);
- ``ctx.wrap`` (DDP) at 2 ranks: ``ctx.save_checkpoint`` against rank 0's
  ``torch.save`` + ``fsync`` of the bare model's ``state_dict``, and
  ``ctx.load_checkpoint`` against rank 0's ``torch.load`` + ``load_state_dict``
  + a ``broadcast`` of every tensor to the other ranks.

Each operation is timed on rank 0 from a barrier to its return followed by a
barrier (every rank is done). Each round writes into fresh directories,
removed after the round, untimed; the loads read what the round just wrote
(from the page cache, for both contenders). A round's ratio is ddpctx's time
over torch's in that round; the table gives their median with a 95%
bootstrap interval and reads each target against it (met / not met /
unresolved: run more rounds, on a quieter machine, until it is one).

Prints a markdown table ready for BENCHMARKS.md, with the load average
(``os.getloadavg``) before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run as a file: the repository, not benchmarks/, heads sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.stats import median_interval, ratios, round_order, verdict
from benchmarks.workload import active
from ddpctx import launch

#: (what, ranks, ddpctx's operation, torch's, the target ratio).
TARGETS = [
    ("sharded save", 2, "ctx.shard save", "dcp.save", 1.10),
    ("sharded load", 2, "ctx.shard load", "dcp.load", 1.10),
    ("sharded save", 3, "ctx.shard save", "dcp.save", 1.10),
    ("sharded load", 3, "ctx.shard load", "dcp.load", 1.10),
    ("DDP save", 2, "ctx.wrap save", "torch.save + fsync", 1.10),
    ("DDP load", 2, "ctx.wrap load", "torch.load + broadcast", 1.00),
]


def build(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def timed(work: Callable[[Path], object], where: Path) -> float:
    """Seconds from a barrier to ``work(where)`` done on every rank (rank 0's clock)."""
    dist.barrier()
    start = time.perf_counter()
    work(where)
    dist.barrier()
    return time.perf_counter() - start


def sharded_rank(rounds: int, layers: int, width: int, root: str) -> dict[str, list[float]]:
    """One job's rounds: ctx.shard save/load vs dcp.save/dcp.load, interleaved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ctx = active()
    mine = ctx.shard(build(layers, width), blocks=[nn.Linear])
    raw = build(layers, width)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for layer in raw:
        fully_shard(layer, mesh=mesh)
    fully_shard(raw, mesh=mesh)

    def raw_load(where: Path) -> None:
        state = get_model_state_dict(raw)
        dcp.load(state, checkpoint_id=where)
        set_model_state_dict(raw, state)

    return interleave(
        ctx.rank,
        rounds,
        Path(root) / f"shard{ctx.world_size}",
        saves={
            "ctx.shard save": lambda where: ctx.save_checkpoint(where, model=mine),
            "dcp.save": lambda where: dcp.save(get_model_state_dict(raw), checkpoint_id=where),
        },
        loads={
            "ctx.shard load": lambda where: ctx.load_checkpoint(where, model=mine),
            "dcp.load": raw_load,
        },
    )


def ddp_rank(rounds: int, layers: int, width: int, root: str) -> dict[str, list[float]]:
    """One job's rounds: ctx.wrap save/load vs torch.save + fsync / torch.load + broadcast."""
    ctx = active()
    mine = ctx.wrap(build(layers, width))
    raw = build(layers, width)
    for tensor in raw.state_dict().values():  # DDP's start: rank 0's weights everywhere
        dist.broadcast(tensor, 0)

    def raw_save(where: Path) -> None:
        if ctx.rank == 0:
            where.mkdir(parents=True)
            with open(where / "model.pt", "wb") as stream:
                torch.save(raw.state_dict(), stream)
                stream.flush()
                os.fsync(stream.fileno())

    def raw_load(where: Path) -> None:
        if ctx.rank == 0:
            raw.load_state_dict(torch.load(where / "model.pt", weights_only=True))
        for tensor in raw.state_dict().values():
            dist.broadcast(tensor, 0)

    return interleave(
        ctx.rank,
        rounds,
        Path(root) / "ddp",
        saves={
            "ctx.wrap save": lambda where: ctx.save_checkpoint(where, model=mine),
            "torch.save + fsync": raw_save,
        },
        loads={
            "ctx.wrap load": lambda where: ctx.load_checkpoint(where, model=mine),
            "torch.load + broadcast": raw_load,
        },
    )


def interleave(
    rank: int,
    rounds: int,
    root: Path,
    saves: dict[str, Callable[[Path], object]],
    loads: dict[str, Callable[[Path], object]],
) -> dict[str, list[float]]:
    """``rounds`` timed rounds (after one untimed warm-up): every save, then every load.

    The saves and the loads pair up by position: the n-th load reads what the
    n-th save wrote. Each contender's directory is fresh in every round.
    """
    names = list(saves) + list(loads)
    times: dict[str, list[float]] = {name: [] for name in names}
    readers = dict(zip(loads, saves, strict=True))  # a load -> the save whose files it reads
    for round_index in range(-1, rounds):
        folder = root / f"round{round_index + 1}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in round_order(list(saves), round_index + 1):
                took = timed(saves[name], folder / name.replace(" ", "_"))
                if round_index >= 0:
                    times[name].append(took)
            for name in round_order(list(loads), round_index + 1):
                where = folder / readers[name].replace(" ", "_")
                took = timed(loads[name], where)
                if round_index >= 0:
                    times[name].append(took)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        dist.barrier()
    return times


def rows(times: dict[str, list[float]], ranks: int) -> list[str]:
    """The table's rows of one job: each target it measured, with its interval and verdict."""
    found = []
    for what, world_size, mine, theirs, target in TARGETS:
        if world_size != ranks or mine not in times:
            continue
        paired = ratios(times[mine], times[theirs])
        middle, low, high = median_interval(paired)
        found.append(
            f"| {what} | {ranks} | {statistics.median(times[mine]):.3f} | "
            f"{statistics.median(times[theirs]):.3f} | {middle:.3f} [{low:.3f}, {high:.3f}] | "
            f"<= {target:.2f}x | {verdict(low, high, target)} |"
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per job")
    parser.add_argument("--layers", type=int, default=16, help="Linear layers in the model")
    parser.add_argument("--width", type=int, default=2048, help="each Linear(width, width)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints go")
    args = parser.parse_args()
    mbytes = args.layers * (args.width + 1) * args.width * 4 / 1e6
    started, before = time.perf_counter(), os.getloadavg()
    root = tempfile.mkdtemp(prefix="bench-checkpoint-cost-", dir=args.dir)
    found: list[str] = []
    try:
        for world_size in (2, 3):
            times = launch(
                sharded_rank, args.rounds, args.layers, args.width, root,
                world_size=world_size, timeout=3600,
            )[0]  # fmt: skip
            found += rows(times, world_size)
        times = launch(
            ddp_rank, args.rounds, args.layers, args.width, root, world_size=2, timeout=3600
        )[0]
        found += rows(times, 2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    after = os.getloadavg()
    print(
        f"{args.layers} x Linear({args.width}, {args.width}): {mbytes:.0f} MB of float32 "
        f"weights; gloo on CPU, torch {torch.__version__}, {os.cpu_count()} cores; "
        f"{args.rounds} rounds per job; {time.perf_counter() - started:.0f} s; load average "
        f"(1 min) {before[0]:.1f} before, {after[0]:.1f} after.\n"
    )
    print(
        "| target | ranks | ddpctx s (median) | torch s (median) | paired ratio [95% CI] "
        "| target | verdict |\n|---|---:|---:|---:|---:|---:|---|"
    )
    print("\n".join(found))


if __name__ == "__main__":
    main()
