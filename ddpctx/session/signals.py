"""SIGTERM from a launcher: leave ``distributed()`` at once, cleaning up where possible.

torchrun (and SLURM, and Kubernetes) stop a job by sending SIGTERM to every
rank, then SIGKILL after a grace period. ddpctx turns SIGTERM into
``SystemExit(143)`` in the rank's main thread so that ``finally`` blocks and
the process-group teardown run. Two things can hold that exit off, and both
are handled here:

- Python runs a signal handler only when the main thread gets back to the
  interpreter. A rank blocked inside a C++ collective (waiting for a peer that
  never comes) would not run it until the collective returns or times out --
  minutes. The C-level handler, however, writes the signal number to the
  *wakeup fd* at once; a watcher thread reads it, and if the main thread has
  not left within :data:`GRACE_S`, ends the process with status 143 itself.
- DataLoader workers are children of the rank. Forked after the handler was
  installed, they inherit it; in a worker it restores the default action and
  re-sends the signal, so a worker dies as it would without ddpctx. The rank
  also terminates its multiprocessing children when it is told to stop, so
  the loader's shutdown does not wait for a batch in progress.

Only the main thread can install any of this, and only when nobody else
installed a SIGTERM handler or a wakeup fd (asyncio, for one, uses it).

Example (in a process with SIGTERM's default action, as a fresh one has):
    >>> import signal
    >>> previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    >>> undo = exit_on_sigterm(rank=0)
    >>> undo is not None  # installed: this doctest runs in the main thread
    True
    >>> undo()
    >>> _ = signal.signal(signal.SIGTERM, previous)
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType

from ddpctx.utils.errors import SIGTERM_STATUS

#: How long the watcher lets the main thread leave on its own after SIGTERM.
GRACE_S = 0.5


def exit_on_sigterm(rank: int) -> Callable[[], None] | None:
    """Make SIGTERM end this rank within :data:`GRACE_S` seconds; returns the undo.

    Returns None (and changes nothing) outside the main thread, or when a
    SIGTERM handler other than the default is already installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        return None
    owner = os.getpid()
    handled = threading.Event()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner:  # a forked child (a DataLoader worker): die as by default
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        handled.set()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends us at once
        _say(
            f"ddpctx: rank {rank} received SIGTERM; leaving distributed() and "
            "destroying the process group.\n"
        )
        # Expected deaths from here on: torch's DataLoader SIGCHLD handler would turn a
        # worker's into a RuntimeError that replaces this exit.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _terminate_children()
        raise SystemExit(SIGTERM_STATUS)

    signal.signal(signal.SIGTERM, on_sigterm)
    stop_watcher = _watch_for_blocked_exit(rank, owner, handled)

    def restore() -> None:
        if stop_watcher is not None:
            stop_watcher()
        signal.signal(signal.SIGTERM, previous)

    return restore


def _watch_for_blocked_exit(
    rank: int, owner: int, handled: threading.Event
) -> Callable[[], None] | None:
    """Start the watcher thread on a wakeup fd of our own; returns its stop, or None."""
    reader, writer = socket.socketpair()
    reader.setblocking(True)
    writer.setblocking(False)
    try:
        earlier = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except (ValueError, OSError):  # not the main thread of the main interpreter
        reader.close()
        writer.close()
        return None
    if earlier != -1:  # someone else's (e.g. an event loop): leave theirs in place
        signal.set_wakeup_fd(earlier)
        reader.close()
        writer.close()
        return None

    def watch() -> None:
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:  # stop() closed the other end
                return
            if signal.SIGTERM in data and os.getpid() == owner:
                if stopping.wait(GRACE_S):  # the block was left in time
                    return
                _exit_now(rank, handled)

    stopping = threading.Event()
    watcher = threading.Thread(target=watch, name="ddpctx-sigterm", daemon=True)
    watcher.start()

    def stop() -> None:
        stopping.set()
        current = signal.set_wakeup_fd(-1)
        if current != writer.fileno():  # someone installed theirs since: keep it
            signal.set_wakeup_fd(current)
        writer.close()
        watcher.join(5)
        reader.close()

    return stop


def _exit_now(rank: int, handled: threading.Event) -> None:
    """End the process: the main thread did not leave within :data:`GRACE_S` of SIGTERM."""
    where = (
        "is still cleaning up"
        if handled.is_set()
        else "is blocked (e.g. in a collective waiting for a peer)"
    )
    _say(
        f"ddpctx: rank {rank} received SIGTERM, but its main thread {where} after "
        f"{GRACE_S} s; exiting now with status {SIGTERM_STATUS}.\n"
    )
    _terminate_children()
    _flush_standard_streams()
    os._exit(SIGTERM_STATUS)


def _terminate_children() -> None:
    """SIGTERM this process's multiprocessing children (DataLoader workers), so none waits."""
    for child in multiprocessing.active_children():
        try:
            child.terminate()
        except (OSError, ValueError):  # already gone, or closed
            continue


def _flush_standard_streams() -> None:
    """Flush stdout/stderr, unless the main thread holds their lock (then give up quickly)."""
    flusher = threading.Thread(
        target=lambda: [stream.flush() for stream in (sys.stdout, sys.stderr) if stream],
        daemon=True,
    )
    flusher.start()
    flusher.join(0.2)


def _say(text: str) -> None:
    """Write to stderr's file descriptor directly: safe from a signal handler or any thread."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())
