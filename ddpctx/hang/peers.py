"""Who a collective or transfer waits with: a subgroup's members, a ``recv``'s peer.

The hang report and debug mode label a wait with the ranks it involves, so a
rank outside a hung subgroup or point-to-point pair is never called stuck.
This module knows torch and nothing of the rest of ddpctx.

Example:
    >>> ranks_text([0, 2])
    'ranks 0, 2'
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def describe(label: str, group: Any) -> tuple[str, tuple[int, ...] | None]:
    """``("all_reduce() on ranks 0, 2", (0, 2))`` for a subgroup; ``("barrier()", None)``."""
    if group is None or group is dist.GroupMember.WORLD:
        return label, None
    try:
        members = tuple(dist.get_process_group_ranks(group))
    except Exception:  # not a group torch knows: torch's own call will say so
        return label, None
    if len(members) == dist.get_world_size():
        return label, None
    return f"{label} on {ranks_text(list(members))}", members


def describe_transfer(
    name: str, group: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[str, tuple[int, ...] | None]:
    """``("recv from rank 0", (0, me))``: a point-to-point wait names its peer (global rank).

    A ``recv`` without ``src`` waits for any rank: ``("recv from any rank", None)``.
    """
    key, direction = ("dst", "to") if name == "send" else ("src", "from")
    peer = kwargs.get(key, args[1] if len(args) > 1 else None)
    in_group = kwargs.get(f"group_{key}")
    with contextlib.suppress(Exception):
        if peer is None and in_group is not None and group is not None:
            peer = dist.get_global_rank(group, in_group)
        if isinstance(peer, int):
            return f"{name} {direction} rank {peer}", (peer, dist.get_rank())
    return f"{name} {direction} any rank", None


@functools.cache  # the doctor is installed per block, on the same few functions every time
def group_position(function: Callable[..., Any]) -> int | None:
    """The index of ``function``'s ``group`` parameter when passed by position, else None."""
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("group") if "group" in names else None


def ranks_text(ranks: list[int]) -> str:
    """``"rank 1"`` or ``"ranks 0, 2"``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
