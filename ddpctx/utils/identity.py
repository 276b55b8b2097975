"""Who this process is: the one "current context" slot, and :func:`whoami`.

The lowest layer that knows about ranks. :mod:`ddpctx.session.context` fills the
slot on entering ``distributed()`` and empties it on exit; everything that
only needs to know *who* this process is -- the decorators, the rank-0
filter on logging and progress bars -- asks :func:`whoami` here, and so never
imports the context (which would point a layer upwards and close an import
circle). The slot holds any object with the four :class:`Placed` attributes;
:func:`ddpctx.current` gives it back typed as a ``DistContext``.

Example:
    >>> occupant() is None  # outside distributed()
    True
    >>> whoami().rank  # no launcher variables, no group: rank 0 of 1
    0
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from ddpctx.utils.env import detect_launch


@dataclass(frozen=True)
class Place:
    """Who this process is, as far as rank-zero logic needs to know."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int

    def is_zero(self, local: bool) -> bool:
        return (self.local_rank if local else self.rank) == 0


class Placed(Protocol):
    """What the slot's occupant must tell: its place in the job."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def node_rank(self) -> int: ...


_occupant: Placed | None = None


def occupy(context: Placed | None) -> None:
    """Put the active context in the slot (None empties it)."""
    global _occupant
    _occupant = context


def occupant() -> Placed | None:
    """The active context, or None outside ``distributed()``."""
    return _occupant


def whoami() -> Place:
    """This process's rank, world size, local rank and node, from wherever they are known.

    Inside ``distributed()`` from the context; else from a process group
    someone else formed (with the launcher's variables when they agree with
    it); else from ``RANK`` & co. with a world of 1.

    >>> whoami().world_size
    1
    """
    if _occupant is not None:
        context = _occupant
        return Place(context.rank, context.world_size, context.local_rank, context.node_rank)
    info = detect_launch(os.environ, rendezvous=False)  # a malformed RANK is a loud error
    if not dist.is_initialized():
        return Place(info.rank, 1, info.local_rank, info.node_rank)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if (info.rank, info.world_size) == (rank, world_size):
        return Place(rank, world_size, info.local_rank, info.node_rank)
    return Place(rank, world_size, rank, 0)  # a group without launcher variables: one node
