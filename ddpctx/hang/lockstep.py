"""Debug mode: ranks in different collectives fail at once, per process group.

With ``debug=True`` (or ``DDPCTX_DEBUG=collectives``) every collective is
preceded by a check on *its own* process group: the members exchange
(sequence number on that group, operation) in one two-number all-gather over
that group. Ranks that are not members of a subgroup neither count nor check
its collectives, so a collective on ``new_group([0])`` never shifts rank 1's
numbers. Point-to-point operations (``send``/``recv``, ``isend``/``irecv``,
``batch_isend_irecv``) pair two ranks in any order relative to the group's
collectives, so they are not checked here; a send without its receive shows in
the hang report as ``waiting in recv from rank N``.

When the operations differ, the call sites travel in one object all-gather
and every member raises :class:`~ddpctx.hang.inflight.HangError` naming the
group, each rank's operation and its ``file:line``. A correct program -- the
same collectives in the same order on every member of each group -- never
raises.

Collectives issued for an ``@all_reduced`` function are labelled with it (see
:mod:`ddpctx.utils.issuing`): two such functions called in swapped order on two
ranks are two different collectives, not one ``all_reduce`` that would mix
their values.

What it cannot see at once: a rank that skips a collective whose successor on
that group is the same operation (the numbers still pair up), or ranks waiting
in collectives of *different* groups (each check waits on its own group).
Those stay hangs, and the hang report names them.

torch's own ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` is not turned on: with torch
2.13's gloo it makes DDP crash the process (SIGSEGV).

Example:
    >>> from ddpctx import distributed
    >>> with distributed(hang_timeout=0):
    ...     check = Lockstep()
    ...     check("barrier", None, None)  # one process: nothing to compare
    ...     check.sequences
    {None: 1}
"""

from __future__ import annotations

import zlib
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ddpctx.hang.inflight import HangError, user_site
from ddpctx.hang.peers import ranks_text
from ddpctx.utils.issuing import ISSUING


class Lockstep:
    """The check of one ``distributed()`` block: a sequence number per process group."""

    def __init__(self) -> None:
        self.sequences: dict[Any, int] = {}  # group (None: the default group) -> collectives

    def __call__(self, op: str, group: Any, caller: FrameType | None) -> None:
        """Raise :class:`HangError` on every member of ``group`` if they are in different ops."""
        if group is c10d.GroupMember.WORLD:
            group = None
        size = dist.get_world_size(group)  # -1 on a rank outside the group: torch skips the call
        if size < 1:
            return
        sequence = self.sequences[group] = self.sequences.get(group, 0) + 1
        if size == 1:
            return
        label = ISSUING.get()
        if label is not None:  # two @all_reduced functions are two collectives
            op = f"{op} in {label}"
        device = _comm_device(group)
        mine = torch.tensor([sequence, zlib.crc32(op.encode())], dtype=torch.int64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(size)]
        c10d.all_gather(everyone, mine, group=group)  # the untracked original: part of the wait
        if all(torch.equal(theirs, everyone[0]) for theirs in everyone):
            return
        sites: list[Any] = [None] * size
        c10d.all_gather_object(sites, (op, sequence, user_site(caller)), group=group)
        members = dist.get_process_group_ranks(group) if group is not None else range(size)
        places: dict[tuple[str, str], list[int]] = {}
        for rank, (their_op, _, site) in zip(members, sites, strict=True):
            places.setdefault((their_op, site), []).append(rank)
        described = " vs ".join(
            f"{their_op} at {site} ({ranks_text(ranks)})"
            for (their_op, site), ranks in places.items()
        )
        where = (
            "the default group" if group is None else f"the group of {ranks_text(list(members))}"
        )
        raise HangError(
            f"ranks are in different collectives on {where}: {described} (collective "
            f"#{sequence} on that group). Every member of a group must issue the same "
            "collectives on it in the same order; decide data-dependent branches together "
            "with ctx.any(flag) / ctx.all(flag)."
        )


def _comm_device(group: Any) -> torch.device:
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
