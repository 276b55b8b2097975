"""Telling a rank's own failure from the errors it causes on the others.

When a rank dies, its peers' pending collectives fail too ("Connection closed
by peer", an aborted communicator). Those follow-on errors are consequences:
reports should name the rank that failed first, and list the others as
secondary. Pure text matching; no torch import.

Example:
    >>> is_follow_on("RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:5")
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


def is_follow_on(text: str) -> bool:
    """True if an error's text says it happened because another rank went away."""
    return any(fragment in text for fragment in PEER_GONE)
