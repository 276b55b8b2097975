"""``ddpctx env``: what ddpctx detects here, without forming a process group.

Example:
    >>> describe_environment()["launcher"]
    'single'
"""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Mapping, Sequence
from typing import Any

_PREFIXES = ("SLURM_", "OMPI_", "NCCL_", "GLOO_", "TORCH_", "DDPCTX_", "TORCHELASTIC_")
_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
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
    from ddpctx.utils.env import detect_launch, resolve_backend, resolve_device_index

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
    problems = option_problems(os.environ)
    try:
        info = detect_launch(os.environ, pid=os.getpid())
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
        )
    except (ValueError, RuntimeError) as error:
        report.update(launcher=None)
        problems.insert(0, f"{type(error).__name__}: {error}")
    report["problem"] = "; ".join(problems) or None
    report["environment"] = {
        name: value
        for name, value in sorted(os.environ.items())
        if name in _NAMES or name.startswith(_PREFIXES)
    }
    return report


def option_problems(environ: Mapping[str, str]) -> list[str]:
    """What ``distributed()`` would refuse in ``DDPCTX_TIMEOUT``, ``DDPCTX_HANG_TIMEOUT``
    and ``DDPCTX_DEBUG``, each checked on its own so that every bad one is named.

    Example:
        >>> option_problems({"DDPCTX_DEBUG": "bogus"})  # doctest: +ELLIPSIS
        ["ValueError: DDPCTX_DEBUG='bogus' is not a debug mode; ..."]
    """
    from ddpctx.hang.settings import resolve_hang_settings
    from ddpctx.utils.env import DEFAULT_TIMEOUT, resolve_timeout

    problems = []
    timeout_s = DEFAULT_TIMEOUT.total_seconds()
    try:
        timeout_s = resolve_timeout(None, environ).total_seconds()
    except ValueError as error:
        problems.append(f"ValueError: {error}")
    hang_only = {k: v for k, v in environ.items() if k != "DDPCTX_DEBUG"}
    for hang_timeout, variables in ((None, hang_only), (0.0, environ)):
        try:  # hang_timeout=0 leaves DDPCTX_HANG_TIMEOUT unread: DDPCTX_DEBUG alone
            resolve_hang_settings(hang_timeout, "report", False, timeout_s, variables)
        except ValueError as error:
            problems.append(f"ValueError: {error}")
    return problems


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


def in_a_multi_rank_job() -> bool:
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


def environment_rows() -> list[dict[str, Any]]:
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
