"""Telling a rank's own failure from the errors it causes on the others.

When a rank fails, its peers fail too: their pending collectives break
("Connection closed by peer", an aborted communicator), and ddpctx itself
raises on them on purpose, so that nobody waits -- ``RankZeroError`` when
rank 0's rank-zero work failed, a ``ReductionError`` when another rank could
not reduce or send its value. Those follow-on errors are consequences:
reports (``launch()``, the pytest plugin, torchrun's root cause through the
error file) must name the rank that failed first, and list the others as
secondary. Pure text matching on ``"TypeName: message"`` or a formatted
traceback, so it works on text that crossed a process boundary; no torch
import.

Example:
    >>> is_follow_on("RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:5")
    True
    >>> is_follow_on("RankZeroError: rank 0 raised OSError: disk full")
    True
    >>> is_follow_on("ValueError: bad shard")
    False
"""

from __future__ import annotations

#: Fragments of the errors a collective raises when a peer process is gone.
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Read error [",
    "remote process exited",
    "communicator was aborted",
)

#: Fragments of the errors ddpctx raises on a rank *because* another rank failed.
PEER_FAILED = (
    "RankZeroError: ",
    "could not reduce its result, so no rank can",
    "could not pickle its object, so nothing was sent",
)


def is_follow_on(text: str) -> bool:
    """True if an error's text says it happened because another rank failed or went away."""
    return any(fragment in text for fragment in PEER_GONE + PEER_FAILED)


def describe(error: BaseException) -> str:
    """``"TypeName: message"``, the form :func:`is_follow_on` reads.

    >>> describe(KeyError("epoch"))
    "KeyError: 'epoch'"
    """
    return f"{type(error).__name__}: {error}"
