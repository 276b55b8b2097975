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

import contextlib
import json
import os
import signal
import time
import traceback
import warnings
from collections.abc import Mapping

#: The exit status of a rank that SIGTERM stopped (what shells report for it).
SIGTERM_STATUS = 128 + signal.SIGTERM

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


def should_record(exc: BaseException | None) -> bool:
    """Whether an exception leaving ``distributed()`` is a failure worth recording.

    Every exception, ``KeyboardInterrupt`` and a ``SystemExit`` with a failing
    status (``sys.exit(1)``, ``sys.exit("message")``, SIGTERM's 143) are;
    ``sys.exit()`` / ``sys.exit(0)`` and ``GeneratorExit`` are not.

    >>> [should_record(e) for e in (ValueError(), SystemExit(0), SystemExit(2), None)]
    [True, False, True, False]
    """
    if isinstance(exc, SystemExit):
        return exc.code not in (None, 0)
    return isinstance(exc, (Exception, KeyboardInterrupt))


def is_follow_on_exit(exc: BaseException) -> bool:
    """A consequence of another rank's failure: a peer-caused error, or the launcher's SIGTERM."""
    if isinstance(exc, SystemExit):
        return exc.code == SIGTERM_STATUS
    return is_follow_on(describe(exc))


def record_for_torchrun(exc: BaseException, environ: Mapping[str, str], note: str = "") -> None:
    """Write ``exc`` where torchrun looks for a worker's error (torch's ``@record`` format).

    torchrun names as root cause the failure with the smallest timestamp, in
    whole seconds. A rank that fails because a peer failed (see
    :mod:`ddpctx.utils.errors`), or that was stopped by the launcher's SIGTERM,
    usually fails within the same second as that peer; its record is dated
    one second later so the rank that failed first is the one named. ``note``
    (e.g. a hang report printed earlier) is appended to the message.
    """
    path = environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    timestamp = int(time.time()) + (1 if is_follow_on_exit(exc) else 0)
    data = {
        "message": {
            "message": describe(exc) + (f"\n\n{note}" if note else ""),
            "extraInfo": {
                "py_callstack": "".join(
                    traceback.format_exception(type(exc), exc, exc.__traceback__)
                ),
                "timestamp": str(timestamp),
            },
        }
    }
    # Written whole or not at all: torchrun's agent json-loads the file of every rank that
    # exited non-zero, and crashes (taking the restart with it) on a half-written one, which a
    # rank stopped by the launcher's SIGTERM in the middle of this write would leave.
    partial = f"{path}.{os.getpid()}.partial"
    try:
        try:
            with open(partial, "w") as handle:
                json.dump(data, handle)
            os.replace(partial, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(partial)
    except OSError as error:
        warnings.warn(
            f"could not write TORCHELASTIC_ERROR_FILE={path!r}: {error}",
            RuntimeWarning,
            stacklevel=2,
        )
