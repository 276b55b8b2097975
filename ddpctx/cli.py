"""``python -m ddpctx`` (also the ``ddpctx`` command): ``env`` and ``check``.

- ``ddpctx env [--json]``: what ddpctx detects here -- launcher, ranks, the
  backend and device ``distributed()`` would choose, GPUs, torch / CUDA /
  NCCL / gloo versions, and the environment variables that steer them. It
  never forms a process group, so it also works when forming one is the
  problem. Under torchrun every rank prints its own block, headed by its rank:
  ranks differ in ``LOCAL_RANK`` and device, and across nodes in host and GPUs.
- ``ddpctx check [--world-size N] [--sizes 1024,262144]``: starts N local
  ranks with ``ddpctx.launch`` (or, under torchrun, uses the job's ranks)
  and checks every collective ddpctx relies on -- all_reduce, broadcast,
  all_gather, barrier, the object collectives and ``@all_reduced`` --
  verifying the numbers, with latency and bandwidth per message size. Sizes
  are float32 element counts; the table shows elements and bytes. A
  ``GLOO_SOCKET_IFNAME`` that names no interface here is a failed check of
  its own. Exits non-zero, naming what failed. The first thing to run on a
  new cluster.

Example:
    >>> describe_environment()["launcher"]
    'single'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
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
        "host": socket.gethostname(),
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


def format_environment(report: dict[str, Any], *, header: bool = False) -> str:
    """``ddpctx env``'s text for ``report``; ``header=True`` starts it with the rank.

    Under torchrun every rank prints its own block, so each block says whose
    it is (and each is written at once, so blocks do not interleave).

    Example:
        >>> report = {"launcher": "torchrun", "rank": 1, "world_size": 2, "local_rank": 1,
        ...           "host": "node7", "environment": {"RANK": "1"}}
        >>> print(format_environment(report, header=True))
        == rank 1 of 2 (local rank 1 on node7) ==
        launcher     torchrun
        rank         1
        world_size   2
        local_rank   1
        host         node7
        environment:
          RANK=1
    """
    width = max(len(key) for key in report)
    lines = []
    if header:
        rank = report.get("rank", os.environ.get("RANK", "?"))  # "?" when detection failed
        world = report.get("world_size", os.environ.get("WORLD_SIZE", "?"))
        local = report.get("local_rank", os.environ.get("LOCAL_RANK", "?"))
        lines.append(f"== rank {rank} of {world} (local rank {local} on {report.get('host')}) ==")
    lines += [f"{key:<{width}}  {value}" for key, value in report.items() if key != "environment"]
    lines.append("environment:" + ("" if report["environment"] else " (none of the variables set)"))
    lines += [f"  {name}={value}" for name, value in report["environment"].items()]
    return "\n".join(lines)


def _in_a_multi_rank_job() -> bool:
    """True when a launcher started this process as one of several ranks."""
    for name in ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            return True
    return False


def interface_problems(value: str | None, interfaces: Sequence[str]) -> list[str]:
    """What is wrong with a ``GLOO_SOCKET_IFNAME`` value, given this host's interfaces.

    gloo takes one interface name or several separated by commas, and fails
    to form a group (a raw ``enforce fail ... Unable to find address``) when
    one of them does not exist here.

    Example:
        >>> interface_problems("eth0", ["lo", "eth0"])
        []
        >>> interface_problems("eth9", ["lo", "eth0"])  # doctest: +ELLIPSIS
        ["GLOO_SOCKET_IFNAME='eth9': no network interface 'eth9' on this host ...]
    """
    if value is None:
        return []
    names = [name.strip() for name in value.split(",")]
    missing = [name for name in names if name not in interfaces]
    if not missing and all(names):
        return []
    return [
        f"GLOO_SOCKET_IFNAME={value!r}: no network interface "
        f"{', '.join(repr(name) for name in missing) or 'with an empty name'} on this host "
        f"(interfaces here: {', '.join(interfaces) or 'none found'}), so gloo cannot form a "
        "group. Set it to one of those (the one that reaches the other nodes), or unset it."
    ]


def _environment_rows() -> list[dict[str, Any]]:
    """Checks of the environment itself, shown as rows of the ``check`` table."""
    value = os.environ.get("GLOO_SOCKET_IFNAME")
    if value is None:
        return []
    failures = interface_problems(value, [name for _, name in socket.if_nameindex()])
    return [
        {
            "collective": "GLOO_SOCKET_IFNAME",
            "elements": None,
            "bytes": None,
            "ok": not failures,
            "failures": failures,
        }
    ]


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
        row: dict[str, Any] = {
            "collective": name,
            "elements": size or None,
            "bytes": size * 4 or None,
            "ok": False,
        }
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


def _sizes(text: str) -> list[int]:
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
    return sizes


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown (not for flags), descriptions and examples kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0:  # a flag: "(default: False)" says nothing
            return action.help
        return super()._get_help_string(action)


_DESCRIPTION = "Inspect and check the distributed set-up that ddpctx sees on this machine."

_EXAMPLES = """\
examples:
  ddpctx env
  ddpctx check --world-size 2 --sizes 256,65536
  torchrun --nproc_per_node=8 -m ddpctx check    # the job's own ranks (NCCL on GPUs)
"""


def _parser() -> argparse.ArgumentParser:
    from ddpctx import __version__

    parser = argparse.ArgumentParser(
        prog="ddpctx",
        description=_DESCRIPTION,
        epilog=_EXAMPLES,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ddpctx {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{env,check}")
    env = commands.add_parser(
        "env",
        help="what ddpctx detects: launcher, ranks, backend, device, GPUs, versions",
        description="Show what ddpctx detects here: launcher, ranks, backend, device, GPUs,\n"
        "versions, and the environment variables that steer them. It forms no process\n"
        "group. Under torchrun every rank prints its own block, headed by its rank.",
        formatter_class=_HelpFormatter,
    )
    env.add_argument(
        "--json", action="store_true", help="print JSON (one line per rank under a launcher)"
    )
    check = commands.add_parser(
        "check",
        help="check every collective ddpctx relies on, with timings; non-zero exit on failure",
        description="Check every collective ddpctx relies on, with latency and bandwidth, on\n"
        "--world-size local ranks started here or, under torchrun, on the job's ranks.\n"
        "Exits non-zero naming what failed.",
        formatter_class=_HelpFormatter,
    )
    check.add_argument(
        "--world-size",
        type=int,
        default=2,
        help="local ranks to start (ignored under torchrun, which sets the ranks)",
    )
    check.add_argument(
        "--sizes",
        type=_sizes,
        default="256,65536,1048576",
        help="message sizes in float32 elements (4 bytes each), separated by commas",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)

    if args.command == "env":
        report = describe_environment()
        several = _in_a_multi_rank_job()
        if args.json:
            text = json.dumps(report) if several else json.dumps(report, indent=2)
        else:
            text = format_environment(report, header=several)
        sys.stdout.write(text + "\n")  # one write: ranks' blocks do not interleave
        sys.stdout.flush()
        return 0 if report.get("problem") is None else 1

    if args.world_size < 1:
        parser.error(f"--world-size {args.world_size}: must be at least 1")
    from ddpctx import distributed, launch
    from ddpctx.group import record_for_torchrun

    environment = _environment_rows()
    if any(not row["ok"] for row in environment):
        # gloo would fail with a raw traceback on every rank: report it as a check instead.
        # Under torchrun, local rank 0 reports and fails the job (and names the problem in
        # torchrun's summary); the node's other ranks exit quietly, so that torchrun cannot
        # stop the reporting rank before it has printed.
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return 0
        world_size = int(os.environ.get("WORLD_SIZE", args.world_size))
        print(format_table(environment, world_size, "none (ranks not started)"), flush=True)
        print("FAILED: GLOO_SOCKET_IFNAME", file=sys.stderr)
        record_for_torchrun(ValueError(environment[0]["failures"][0]), os.environ)
        return 1
    if "RANK" in os.environ:  # already one of torchrun's ranks: check the job itself
        with contextlib.ExitStack() as stack:
            try:
                ctx = stack.enter_context(distributed())
            except (ValueError, RuntimeError) as error:
                print(f"ddpctx check: FAILED forming the process group: {error}", file=sys.stderr)
                record_for_torchrun(error, os.environ)
                return 1
            per_rank = _check_everywhere(args.sizes)
            world_size, backend, is_main = ctx.world_size, ctx.backend, ctx.is_main
    else:
        import torch

        per_rank = launch(_check_everywhere, args.sizes, world_size=args.world_size, timeout=300)[0]
        world_size, is_main = args.world_size, True
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    rows = environment + _merge(per_rank)
    if is_main:
        print(format_table(rows, world_size, backend))
    failed = [row["collective"] for row in rows if not row["ok"]]
    if failed and is_main:
        print(f"FAILED: {', '.join(dict.fromkeys(failed))}", file=sys.stderr)
    return 1 if failed else 0


def console() -> None:
    """The ``ddpctx`` console script."""
    raise SystemExit(main())
