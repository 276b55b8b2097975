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
import threading
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
_occupant_thread: threading.Thread | None = None  # the thread that entered distributed()
_occupant_pid: int | None = None  # its process: a process it forks is not a rank


def occupy(context: Placed | None) -> None:
    """Put the active context in the slot (None empties it), from the thread that owns it."""
    global _occupant, _occupant_thread, _occupant_pid
    _occupant = context
    _occupant_thread = threading.current_thread() if context is not None else None
    _occupant_pid = os.getpid() if context is not None else None


def collective_thread() -> threading.Thread:
    """The thread whose collectives are this process's: the one that entered
    ``distributed()``, else the main thread (see :mod:`ddpctx.reduce.guard`).

    >>> collective_thread() is threading.main_thread()
    True
    """
    return _occupant_thread if _occupant_thread is not None else threading.main_thread()


def collective_process() -> int | None:
    """The pid of the process that entered ``distributed()`` (None outside it): a process it
    forks keeps the context but is no rank (see :mod:`ddpctx.reduce.guard`).

    >>> collective_process() is None  # outside distributed()
    True
    """
    return _occupant_pid


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
