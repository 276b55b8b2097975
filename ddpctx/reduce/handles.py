"""The handle of a reduction sent with ``async_op=True``, and the order handles finish in.

A :class:`Reduction` wraps the rest of a reduction whose first collective is
already on its way (see :mod:`ddpctx.reduce.collectives`). Finishing it may
need collectives of its own (a site's first call, a NaN, a mismatch), which
pair with the other ranks' collectives by position. The ranks issue their
handles in the same order, but a program may read them in another order on
one rank -- two first calls of one site read swapped on rank 0 gave
``[102.0, 102.0]`` on every rank instead of ``[3.0, 201.0]``. So handles
finish in the order they were issued: waiting for one first finishes every
handle this process issued before it and has not finished yet. The order is
the same on every rank, whatever order the program reads in.

Every wire of a reduction is sent when it is issued, so in the steady state
finishing one needs no collective: a handle read on one rank only (``if
ctx.is_main:``) or dropped unread pairs nothing wrongly. Only the rare steps
(a site's structure changed on some rank, a NaN in a max/min) communicate
when the handle is read; a site's first call agrees at once, when issued.
Handles that are dropped unread leave the order when they are garbage-collected;
those still open when ``distributed()`` ends are forgotten (:func:`end_of_block`).
Reading a handle that still has to communicate is a collective, so it is
refused on a thread that may not issue one (see :mod:`ddpctx.reduce.guard`).

Example:
    >>> handle = Reduction(lambda: 2.0, "doc")
    >>> handle.is_completed(), handle.result(), handle.is_completed()
    (False, 2.0, True)
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ddpctx.reduce.guard import check_caller

T = TypeVar("T")


class Reduction(Generic[T]):
    """The handle ``async_op=True`` returns: ``.wait()``, then ``.result()``.

    ``.result()`` returns the reduced value, or raises what the synchronous
    call would have raised (on every rank alike).

    Finishing a reduction may need collectives of its own (a site's first
    call, a NaN, a mismatch), which must pair with the same reduction's on
    the other ranks. So handles finish in the order they were issued: waiting
    for one first finishes every handle issued before it on this rank (the
    same handles, in the same order, on every rank), whatever order the
    program reads them in.

    Example:
        >>> handle = Reduction(lambda: {"loss": 0.5}, "doc")  # all_reduce_tree(..., async_op=True)
        >>> handle.result()
        {'loss': 0.5}
    """

    def __init__(
        self,
        finish: Callable[[], T],
        what: str = "",
        communicates: bool = True,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self._finish: Callable[[], T] | None = finish
        self._ready = ready
        self._value: T | None = None
        self._error: Exception | None = None
        self._what = what
        self._number = -1
        if communicates:  # in the issue order, until finished (a dropped one is forgotten)
            number = self._number = next(_ISSUED)
            _OPEN[number] = weakref.ref(self, lambda _: _OPEN.pop(number, None))

    def wait(self) -> None:
        """Block until the reduction is complete (errors are kept for :meth:`result`)."""
        if self._finish is None:
            return
        if self._number >= 0:
            check_caller(f"reading the async handle of {self._what}")
            # issued before this one (a snapshot: a handle dropped on another thread leaves)
            for number in sorted(n for n in list(_OPEN) if n < self._number):
                reference = _OPEN.get(number)
                earlier = reference() if reference is not None else None
                if earlier is not None:
                    earlier.wait()
                _OPEN.pop(number, None)
            _OPEN.pop(self._number, None)
        finish, self._finish = self._finish, None
        try:
            self._value = finish()
        except Exception as error:  # kept for result() to re-raise; Ctrl-C goes through
            self._error = error

    def is_completed(self) -> bool:
        """True once the reduction's collectives are done (:meth:`result` then returns at once).

        Poll it as a torch ``Work``'s: ``while not handle.is_completed(): ...``.
        """
        return self._finish is None or (self._ready is not None and self._ready())

    def result(self) -> T:
        """The reduced value (waits first)."""
        self.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def end_of_block() -> None:
    """Forget the handles still open as ``distributed()`` ends: reading one later raises.

    Their group is about to be destroyed, and a handle left unread on some
    ranks must not finish in the next block, pairing with its collectives.
    """
    for number in list(_OPEN):
        reference = _OPEN.pop(number, None)
        handle = reference() if reference is not None else None
        if handle is not None and handle._finish is not None:
            handle._finish = None
            handle._error = RuntimeError(
                f"the async handle of {handle._what} was read after its distributed() block "
                "ended, so its reduction cannot finish. Read it (.result()) inside the block."
            )


#: Numbers the handles in the order they were issued (see :class:`Reduction`).
_ISSUED = itertools.count()
#: The handles issued and not finished yet, by number: few at any time (one per call in
#: flight); a handle dropped unread leaves when it is garbage-collected.
_OPEN: dict[int, Callable[[], Reduction[Any] | None]] = {}
