"""Which rank left: after a collective lost its peer, a roll call in the job's store names it.

A rank killed (SIGKILL, the OOM killer) or interrupted (Ctrl-C) in the middle
of a collective leaves the others with the transport's words only -- gloo's
"Connection closed by peer [127.0.0.1]:41203" -- an address, never a rank.
Such a rank records nothing on its way out (:mod:`ddpctx.session.departures`
covers the ranks that finish their block), so the survivors ask instead: each
rank whose collective failed so writes its name under the job's store
(``ddpctx/rollcall/<n>/rank<r>``, ``n`` counting this process's roll calls,
the same on every survivor of the same collective) and waits, at most
:data:`ROLL_CALL_S`, for the others'. A rank that did not answer has left (or
is stuck where it cannot answer: the message says both). Every survivor
answers at once, so the wait is only that of the missing ranks.

The store is the default group's. When it is gone too (rank 0 served it and
was the one that left) the survivors cannot compare notes; in a job of two
the other rank is the one, elsewhere nobody is named.

This module knows torch.distributed and nothing of the session.

Example:
    >>> is_peer_gone(RuntimeError("[pair.cc:537] Read error [::1]:5: Connection reset by peer"))
    True
    >>> who_left_text([1]), who_left_text([1, 3])
    ('rank 1', 'ranks 1, 3')
"""

from __future__ import annotations

import contextlib
import itertools
import time
from datetime import timedelta
from typing import Any

from torch.distributed import distributed_c10d as c10d

from ddpctx.utils.errors import PEER_GONE

#: How long a survivor waits for the other survivors' answers, at most (seconds).
ROLL_CALL_S = 3.0

_calls = itertools.count(1)


def is_peer_gone(error: BaseException) -> bool:
    """Whether ``error`` is a collective's failure because a peer process went away."""
    text = str(error)
    return any(fragment in text for fragment in PEER_GONE)


def missing_ranks(rank: int, world_size: int, wait_s: float = ROLL_CALL_S) -> list[int] | None:
    """The ranks that did not answer this roll call within ``wait_s``; None: no store to ask.

    Every rank whose collective lost its peer calls it once (see the module docstring).
    """
    call = next(_calls)
    if world_size == 1:
        return []
    try:
        store: Any = c10d._get_default_store()
    except Exception:
        store = None
    if store is None:
        return [1 - rank] if world_size == 2 else None
    keys = {other: f"ddpctx/rollcall/{call}/rank{other}" for other in range(world_size)}
    previous = None
    try:
        previous = store.timeout
        store.set_timeout(timedelta(seconds=max(wait_s, 0.1)))
        store.set(keys[rank], "here")
        deadline = time.monotonic() + wait_s
        missing = [other for other in range(world_size) if other != rank]
        while missing:
            missing = [other for other in missing if not store.check([keys[other]])]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return missing
    except Exception:  # the store went with the rank that served it
        return [1 - rank] if world_size == 2 else None
    finally:
        with contextlib.suppress(Exception):
            if previous is not None:
                store.set_timeout(previous)


def who_left_text(missing: list[int]) -> str:
    """``"rank 1"`` / ``"ranks 1, 3"`` for the ranks that did not answer."""
    if len(missing) == 1:
        return f"rank {missing[0]}"
    return "ranks " + ", ".join(map(str, missing))
