"""A checkpoint's files are regular files: anything else is said as what it is, never waited on.

Opening a FIFO (a named pipe) for reading waits until some process opens it
for writing -- forever, for a FIFO named like a checkpoint that an untrusted
archive unpacked (``tar`` makes them) or that someone made with ``mkfifo``.
Its size is 0, so a reader that asked only for the size would call it "0
bytes", as if torn. A device can be endless. So every checkpoint file a
reader opens -- a ``.pt``, its manifest, a sharded checkpoint's files -- is
opened with :func:`open_regular`, which never waits (``O_NONBLOCK``) and
refuses anything but a regular file with :class:`NotRegular`, saying what
the file is (:func:`not_regular`). A checkpoint with such a file is
*damaged*, as one with a missing file is: skipped with a warning naming the
file, on every rank and by every reader alike.

Example:
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> os.mkfifo(folder / "checkpoint-000003.pt")
    >>> print(not_regular(folder / "checkpoint-000003.pt"))
    'checkpoint-000003.pt' is a FIFO (a named pipe), not a regular file
    >>> not_regular(folder / "missing.pt") is None
    True
"""

from __future__ import annotations

import fcntl
import io
import os
import stat
from pathlib import Path
from typing import cast

__all__ = ["NOT_REGULAR", "NotRegular", "describe", "not_regular", "open_regular", "what_it_is"]

#: How every message about such a file ends (a reader's advice differs for them).
NOT_REGULAR = "not a regular file"

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (a named pipe)"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotRegular(OSError):
    """A checkpoint file that is no regular file (a FIFO, a device, a directory): its message is
    :func:`describe` of it (``'name' is a FIFO (a named pipe), not a regular file``)."""


def what_it_is(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, in words: ``a FIFO (a named pipe)``."""
    return next((said for test, said in _KINDS if test(mode)), "a special file")


def describe(path: Path, mode: int) -> str:
    """``'name' is a FIFO (a named pipe), not a regular file``."""
    return f"{path.name!r} is {what_it_is(mode)}, {NOT_REGULAR}"


def not_regular(path: Path) -> str | None:
    """Why ``path`` is no regular file (following links); None when it is one, or is not there."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else describe(path, mode)


def open_regular(path: Path, buffering: int = -1) -> io.BufferedReader | io.FileIO:
    """``path`` opened for reading; :class:`NotRegular` (never a wait) when it is no regular file.

    ``FileNotFoundError`` (and other ``OSError`` s) as ``open`` raises them.
    """
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO's open waits otherwise
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegular(describe(path, mode))
        flags = fcntl.fcntl(descriptor, fcntl.F_GETFL)
        fcntl.fcntl(descriptor, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        stream = os.fdopen(descriptor, "rb", buffering=buffering)
        return cast("io.BufferedReader | io.FileIO", stream)  # FileIO when unbuffered
    except BaseException:
        os.close(descriptor)
        raise
