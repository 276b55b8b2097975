"""Which ddpctx reduction the main thread is issuing collectives for, if any.

The reduction engine (:mod:`ddpctx.reduce`) writes it; debug mode's lockstep
check (:mod:`ddpctx.hang.lockstep`) reads it, so that ranks in two different
``@all_reduced`` functions -- the same ``all_reduce`` to torch -- are told
apart. Only a decorated function names its site: it is the same function on
every rank, whatever line calls it, while a ``ctx.all_reduce`` written on two
lines of a rank-dependent ``if`` is one reduction and must stay one.

A context variable, so a reduction on another thread never labels the main
thread's collectives (only the main thread's are checked).

Example:
    >>> ISSUING.get() is None
    True
"""

from __future__ import annotations

from contextvars import ContextVar

#: The ``@all_reduced`` site whose collectives this thread is issuing now, or None.
ISSUING: ContextVar[str | None] = ContextVar("ddpctx_issuing", default=None)
