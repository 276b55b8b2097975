"""Running something on rank 0 without ever leaving the other ranks hanging.

The rule: whenever other ranks wait for rank 0 (a barrier after a
checkpoint write, a broadcast of its result, ``rank_zero_first``), rank 0
sends them an :class:`Outcome` -- its result, or its exception as text --
instead of a bare barrier. A failure on rank 0 therefore reaches every rank
as an exception within one message, rather than as a 10-minute timeout.

With ``local=True`` "rank 0" means local rank 0 of each node; the outcome of
each node's local main is then shared with one ``all_gather_object``, with no
per-node subgroups to create.

Rank-zero work inside rank-zero work: while (local) rank 0 runs a
rank-zero function (or the body of a ``ctx.rank_zero()`` block or of
``ctx.atomic_dir()``), the other ranks are not running it, so a nested call with
``barrier`` / ``broadcast`` must not wait for them: it simply runs (there is
nothing to synchronise with). Inside a ``rank_zero_first`` block the others
run the block later, so a nested wait can never be matched: it is refused
with an error that reaches every rank through the outer block.

This module sits below :mod:`ddpctx.session.context`: callers say who they are with a
:class:`Place`.

Example:
    >>> outcome = Outcome.failure(ValueError("disk full"))
    >>> try:
    ...     outcome.result(source=0)
    ... except RankZeroError as error:
    ...     print(error.rank, error.error_type, error.message)
    0 ValueError disk full
"""

from __future__ import annotations

import contextlib
import pickle
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ddpctx.reduce.guard import inside_rank_zero_work, running_alone
from ddpctx.reduce.objects import all_gather_objects, broadcast_object
from ddpctx.utils.identity import Place


class RankZeroError(RuntimeError):
    """Raised on the other ranks when rank 0 (or a node's local rank 0) failed.

    Attributes:
        rank: the rank that failed.
        error_type: the name of its exception class, e.g. ``"OSError"``.
        message: ``str()`` of its exception.
        remote_traceback: its formatted traceback.

    Example:
        >>> error = RankZeroError(0, "OSError", "disk full", "Traceback ...")
        >>> str(error).splitlines()[0]
        'rank 0 raised OSError: disk full'
    """

    def __init__(self, rank: int, error_type: str, message: str, remote_traceback: str) -> None:
        self.rank = rank
        self.error_type = error_type
        self.message = message
        self.remote_traceback = remote_traceback
        super().__init__(
            f"rank {rank} raised {error_type}: {message}\n\n"
            f"Traceback on rank {rank}:\n{remote_traceback}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.error_type, self.message, self.remote_traceback))


@dataclass(frozen=True)
class Outcome:
    """What rank 0's work came to: a value, or an exception described as text."""

    ok: bool
    value: Any = None
    error_type: str = ""
    message: str = ""
    remote_traceback: str = ""

    @classmethod
    def failure(cls, error: BaseException) -> Outcome:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return cls(False, None, type(error).__name__, str(error), text)

    def result(self, source: int) -> Any:
        """The value, or a :class:`RankZeroError` describing the failure on ``source``."""
        if not self.ok:
            raise RankZeroError(source, self.error_type, self.message, self.remote_traceback)
        return self.value


def refuse_inside_first(what: str) -> None:
    raise RuntimeError(
        f"{what} was called inside a rank_zero_first block. Rank 0 runs that block before "
        "the other ranks, so they can never wait for it there and the job would hang. "
        "Call it before or after the block."
    )


def share(outcome: Outcome | None, place: Place, local: bool) -> tuple[Outcome, int]:
    """Deliver the outcome of (local) rank 0 to every rank; returns it and its source rank.

    Every rank of the job must call this; those that are (local) rank 0 pass
    their outcome, the others None. It doubles as the barrier.
    """
    if place.world_size == 1 or not dist.is_initialized():
        if outcome is None:  # a rank other than 0 with nobody to wait for
            raise RuntimeError(
                f"rank {place.rank} cannot wait for rank 0: no process group is initialised "
                "(the rank comes from the environment, e.g. RANK). Call this inside "
                "`with distributed():`, or after torch.distributed.init_process_group()."
            )
        return outcome, place.rank
    if not local:
        return broadcast_object(outcome, src=0), 0
    entries = all_gather_objects((place.node_rank, outcome))
    for rank, (node, theirs) in enumerate(entries):
        if node == place.node_rank and theirs is not None:
            return theirs, rank
    raise RuntimeError(
        f"no rank on node {place.node_rank} has local rank 0, so nobody ran the function "
        "there. Check LOCAL_RANK / GROUP_RANK as set by the launcher."
    )


def on_rank_zero(
    place: Place,
    work: Callable[[], Any],
    *,
    broadcast: bool,
    local: bool = False,
    what: str = "a rank-zero-only function",
) -> tuple[bool, Any]:
    """Run ``work`` on (local) rank 0 while the others wait; returns ``(ran_here, value)``.

    The others get rank 0's value when ``broadcast`` (else None), or raise
    :class:`RankZeroError` if ``work`` raised there; rank 0 re-raises its own.
    A value rank 0 cannot send (it does not pickle) is a failure on every rank.
    Nested in other rank-zero work, see the module docstring.
    """
    nested = inside_rank_zero_work()
    if nested == "first":
        refuse_inside_first("a rank-zero function with barrier=True or broadcast=True")
    if nested == "function":
        if place.is_zero(local):
            return True, work()
        if broadcast:
            raise RuntimeError(
                f"a rank_zero_only(broadcast=True) function was called on rank {place.rank} "
                "inside a function that only a local rank 0 runs; global rank 0 is not "
                "there to send its result. Call it outside, or give the outer one local=False."
            )
        return False, None
    if not place.is_zero(local):
        outcome, source = share(None, place, local)
        return False, outcome.result(source)
    try:
        with running_alone("function", what):
            value = work()
        if broadcast:
            pickle.dumps(value)  # refused here, so the others learn of it below
    except BaseException as error:  # Ctrl-C and sys.exit() too: the others must not wait
        share(Outcome.failure(error), place, local)
        raise
    share(Outcome(True, value if broadcast else None), place, local)
    return True, value


@contextlib.contextmanager
def zero_first(place: Place, local: bool) -> Iterator[None]:
    """The block runs on (local) rank 0 first, then on the others; a failure reaches all."""
    nested = inside_rank_zero_work()
    if nested == "first":
        refuse_inside_first("rank_zero_first")
    if nested == "function" or place.world_size == 1 or not dist.is_initialized():
        yield  # alone already (or alone in the job): nobody to go first for
        return
    if not place.is_zero(local):
        outcome, source = share(None, place, local)
        outcome.result(source)  # raises RankZeroError if rank 0's block failed
        yield
        return
    try:
        with running_alone("first", "a rank_zero_first block"):
            yield
    except BaseException as error:  # Ctrl-C and sys.exit() too: the others must not wait
        share(Outcome.failure(error), place, local)
        raise
    share(Outcome(True), place, local)
