"""``ddpctx check``: every collective ddpctx relies on, verified and timed per message size."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

#: The largest message ``check --sizes`` takes: 2**28 float32 elements (1 GiB per buffer).
MAX_SIZE = 2**28


def timed(operation: Callable[[], object], repeats: int) -> float:
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
    from ddpctx.session.context import current

    ctx = current()
    assert ctx is not None, "run_checks must run inside distributed()"
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    rows: list[dict[str, Any]] = []

    def record(
        name: str, size: int, check: Callable[[], bool], operation: Callable[[], object]
    ) -> None:
        row: dict[str, Any] = {
            "collective": name,
            "elements": size or None,
            "bytes": size * 4 or None,
            "ok": False,
        }
        try:
            row["ok"] = bool(check())
            seconds = timed(operation, repeats)
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


def check_everywhere(sizes: Sequence[int]) -> list[list[dict[str, Any]]]:
    from ddpctx.session.context import current

    rows = run_checks(sizes)
    ctx = current()
    assert ctx is not None
    gathered: list[list[dict[str, Any]]] = ctx.all_gather(rows)
    return gathered


def merge(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
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


def format_table(rows: list[dict[str, Any]], world_size: int, backend: str) -> str:
    """The ``check`` table: one row per check and size, float32 elements and bytes.

    Example:
        >>> row = {"collective": "all_reduce", "elements": 256, "bytes": 1024, "ok": True,
        ...        "latency_ms": 0.25, "bandwidth_gbps": 0.004, "failures": []}
        >>> print(format_table([row], 2, "gloo"))
        ddpctx check: 2 ranks, backend gloo
        collective                 elements      bytes      latency    bandwidth  result
        all_reduce                      256       1024     0.250 ms    0.004 GB/s  ok
    """

    def line(*cells: object) -> str:
        name, elements, size, latency, bandwidth, result = cells
        return f"{name:26} {elements:>8} {size:>10} {latency:>12} {bandwidth:>12}  {result}"

    lines = [
        f"ddpctx check: {world_size} ranks, backend {backend}",
        line("collective", "elements", "bytes", "latency", "bandwidth", "result"),
    ]
    for row in rows:
        latency = f"{row['latency_ms']:9.3f} ms" if "latency_ms" in row else "-"
        timed = row.get("bytes") and "bandwidth_gbps" in row
        bandwidth = f"{row['bandwidth_gbps']:8.3f} GB/s" if timed else "-"
        result = "ok" if row["ok"] else "FAILED: " + "; ".join(row["failures"])
        elements, size = row.get("elements") or "-", row.get("bytes") or "-"
        lines.append(line(row["collective"], elements, size, latency, bandwidth, result))
    return "\n".join(lines)


def sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sizes {text!r}: give float32 element counts separated by commas, e.g. 1024,262144"
        ) from None
    if not sizes or any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(
            f"--sizes {text!r}: each size must be a positive element count, e.g. 1024,262144"
        )
    too_large = [size for size in sizes if size > MAX_SIZE]
    if too_large:
        raise argparse.ArgumentTypeError(
            f"--sizes {text!r}: {too_large[0]} elements is more than the largest message "
            f"checked, {MAX_SIZE} float32 elements ({MAX_SIZE * 4 // 2**30} GiB); give sizes "
            "up to that, e.g. 1024,262144"
        )
    return sizes
