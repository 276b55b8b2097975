"""Which ddpctx reduction the main thread is issuing collectives for, if any.

The reduction engine (:mod:`ddpctx.reduce`) writes it; debug mode's lockstep
check (:mod:`ddpctx.hang.lockstep`) reads it, so that ranks in two different
``@all_reduced`` functions -- the same ``all_reduce`` to torch -- are told
apart. Only a decorated function names its site: it is the same function on
every rank, whatever line calls it, while a ``ctx.all_reduce`` written on two
lines of a rank-dependent ``if`` is one reduction and must stay one.

One slot, written and read on the main thread (where collectives are checked).

Example:
    >>> ISSUING[0] is None
    True
"""

from __future__ import annotations

#: The ``@all_reduced`` site whose collectives are being issued now, or None.
ISSUING: list[str | None] = [None]
