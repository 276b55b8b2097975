"""``python -m ddpctx`` (also the ``ddpctx`` command): ``env`` and ``check``.

- ``ddpctx env [--json]``: what ddpctx detects here -- launcher, ranks, the
  backend and device ``distributed()`` would choose, GPUs, torch / CUDA /
  NCCL / gloo versions, and the environment variables that steer them.
- ``ddpctx check [--world-size N] [--sizes 1024,262144]``: starts N local
  ranks with :func:`ddpctx.launch` (or, under torchrun, uses the job's ranks)
  and checks every collective ddpctx relies on -- all_reduce, broadcast,
  all_gather, barrier, the object collectives and ``@all_reduced`` --
  verifying the numbers, with latency and bandwidth per message size. Exits
  non-zero, naming the collective, on any failure. The first thing to run on
  a new cluster.

Example:
    >>> describe_environment()["launcher"]
    'single'
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

_PREFIXES = ("SLURM_", "OMPI_", "NCCL_", "GLOO_", "TORCH_", "DDPCTX_", "TORCHELASTIC_")
_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
)


def describe_environment() -> dict[str, Any]:
    """Everything ``ddpctx env`` reports, as a dict."""
    import torch
    import torch.distributed as dist

    from ddpctx import __version__
    from ddpctx.env import detect_launch, resolve_backend, resolve_device_index

    report: dict[str, Any] = {
        "ddpctx": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
        "nccl": ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
        if torch.cuda.is_available() and dist.is_nccl_available()
        else None,
        "gloo_available": dist.is_gloo_available(),
        "nccl_available": dist.is_nccl_available(),
    }
    try:
        info = detect_launch(os.environ)
        backend = resolve_backend(None, torch.cuda.is_available())
        index = resolve_device_index(
            info,
            torch.cuda.is_available(),
            torch.cuda.device_count(),
            os.environ.get("CUDA_VISIBLE_DEVICES"),
        )
        report.update(
            launcher=info.launcher,
            rank=info.rank,
            world_size=info.world_size,
            local_rank=info.local_rank,
            local_world_size=info.local_world_size,
            node_rank=info.node_rank,
            master=None if info.master_addr is None else f"{info.master_addr}:{info.master_port}",
            backend=backend,
            device="cpu" if index is None else f"cuda:{index}",
            problem=None,
        )
    except (ValueError, RuntimeError) as error:
        report.update(launcher=None, problem=f"{type(error).__name__}: {error}")
    report["environment"] = {
        name: value
        for name, value in sorted(os.environ.items())
        if name in _NAMES or name.startswith(_PREFIXES)
    }
    return report


def _print_environment(report: dict[str, Any]) -> None:
    width = max(len(key) for key in report)
    for key, value in report.items():
        if key == "environment":
            continue
        print(f"{key:<{width}}  {value}")
    print("environment:" + ("" if report["environment"] else " (none of the variables set)"))
    for name, value in report["environment"].items():
        print(f"  {name}={value}")


def _timed(operation: Callable[[], object], repeats: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        operation()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_checks(sizes: Sequence[int], repeats: int = 10) -> list[dict[str, Any]]:
    """Run every check on this rank (inside ``distributed()``); one row per check and size."""
    import torch
    import torch.distributed as dist

    from ddpctx import all_reduced
    from ddpctx.context import current

    ctx = current()
    assert ctx is not None, "run_checks must run inside distributed()"
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    rows: list[dict[str, Any]] = []

    def record(
        name: str, size: int, check: Callable[[], bool], operation: Callable[[], object]
    ) -> None:
        row: dict[str, Any] = {"collective": name, "bytes": size * 4, "ok": False}
        try:
            row["ok"] = bool(check())
            seconds = _timed(operation, repeats)
            row["latency_ms"] = seconds * 1e3
            row["bandwidth_gbps"] = size * 4 / seconds / 1e9
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {error}"
        rows.append(row)

    for size in sizes:

        def all_reduce_check(size: int = size) -> bool:
            value = torch.full((size,), float(rank + 1), device=device)
            dist.all_reduce(value)
            return bool(torch.all(value == world * (world + 1) / 2))

        def broadcast_check(size: int = size) -> bool:
            value = torch.full((size,), float(rank), device=device)
            dist.broadcast(value, src=world - 1)
            return bool(torch.all(value == world - 1))

        def all_gather_check(size: int = size) -> bool:
            parts = [torch.empty(size, device=device) for _ in range(world)]
            dist.all_gather(parts, torch.full((size,), float(rank), device=device))
            return all(bool(torch.all(part == r)) for r, part in enumerate(parts))

        payload = torch.ones(size, device=device)
        parts = [torch.empty(size, device=device) for _ in range(world)]
        record("all_reduce", size, all_reduce_check, partial(dist.all_reduce, payload))
        record("broadcast", size, broadcast_check, partial(dist.broadcast, payload, src=0))
        record("all_gather", size, all_gather_check, partial(dist.all_gather, parts, payload))

    def objects_check() -> bool:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, {"rank": rank, "text": "x" * rank})
        box: list[Any] = [{"from": rank} if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return gathered == [{"rank": r, "text": "x" * r} for r in range(world)] and box == [
            {"from": 0}
        ]

    metrics = all_reduced(weight="count")(lambda: {"loss": float(rank), "count": rank + 1})
    expected = sum(r * (r + 1) for r in range(world)) / (world * (world + 1) / 2)

    def barrier_check() -> bool:
        dist.barrier()
        return True

    record("barrier", 0, barrier_check, dist.barrier)
    record("object collectives", 0, objects_check, objects_check)
    record("@all_reduced (weighted)", 0, lambda: abs(metrics()["loss"] - expected) < 1e-12, metrics)
    return rows


def _check_everywhere(sizes: Sequence[int]) -> list[list[dict[str, Any]]]:
    from ddpctx.context import current

    rows = run_checks(sizes)
    ctx = current()
    assert ctx is not None
    gathered: list[list[dict[str, Any]]] = ctx.all_gather(rows)
    return gathered


def _merge(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rank 0's timings; a row is ok only if it was ok on every rank."""
    merged = []
    for index, row in enumerate(per_rank[0]):
        failures = [
            f"rank {rank}: {rows[index].get('error', 'wrong numbers')}"
            for rank, rows in enumerate(per_rank)
            if not rows[index]["ok"]
        ]
        merged.append({**row, "ok": not failures, "failures": failures})
    return merged


def _print_table(rows: list[dict[str, Any]], world_size: int, backend: str) -> None:
    print(f"ddpctx check: {world_size} ranks, backend {backend}")
    print(f"{'collective':26} {'bytes':>10} {'latency':>12} {'bandwidth':>12}  result")
    for row in rows:
        latency = f"{row['latency_ms']:9.3f} ms" if "latency_ms" in row else "-"
        bandwidth = f"{row['bandwidth_gbps']:8.3f} GB/s" if row.get("bytes") else "-"
        result = "ok" if row["ok"] else "FAILED: " + "; ".join(row["failures"])
        print(f"{row['collective']:26} {row['bytes']:>10} {latency:>12} {bandwidth:>12}  {result}")


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sizes {text!r}: give element counts separated by commas, e.g. 1024,262144"
        ) from None
    if not sizes or any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"--sizes {text!r}: each size must be a positive count")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddpctx", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser("env", help="show what ddpctx detects here")
    env.add_argument("--json", action="store_true", help="print JSON")
    check = commands.add_parser("check", help="check every collective, with timings")
    check.add_argument("--world-size", type=int, default=2, help="local ranks to start")
    check.add_argument(
        "--sizes", type=_sizes, default=[256, 65536, 1048576], help="float32 elements per message"
    )
    args = parser.parse_args(argv)

    if args.command == "env":
        report = describe_environment()
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print_environment(report)
        return 0 if report.get("problem") is None else 1

    if args.world_size < 1:
        parser.error(f"--world-size {args.world_size}: must be at least 1")
    from ddpctx import distributed, launch

    if "RANK" in os.environ:  # already one of torchrun's ranks: check the job itself
        with distributed() as ctx:
            per_rank = _check_everywhere(args.sizes)
            world_size, backend, is_main = ctx.world_size, ctx.backend, ctx.is_main
    else:
        import torch

        per_rank = launch(_check_everywhere, args.sizes, world_size=args.world_size, timeout=300)[0]
        world_size, is_main = args.world_size, True
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    rows = _merge(per_rank)
    if is_main:
        _print_table(rows, world_size, backend)
    failed = [row["collective"] for row in rows if not row["ok"]]
    if failed and is_main:
        print(f"FAILED: {', '.join(dict.fromkeys(failed))}", file=sys.stderr)
    return 1 if failed else 0


def console() -> None:
    """The ``ddpctx`` console script."""
    raise SystemExit(main())
