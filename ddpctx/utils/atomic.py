"""Files and directories that appear whole or not at all.

- :func:`atomic_save`: ``torch.save`` into a temporary file beside the target
  (created with the process umask, never in a shared temporary location),
  fsync, rename over the target, fsync the directory. A crash leaves the old
  file or the new one, never a torn one.
- :func:`replace_dir`: the same for a directory someone else's code writes
  (e.g. ``save_pretrained``): it is written under a temporary name and then
  swapped in with one rename (``renameat2(RENAME_EXCHANGE)`` on Linux).

Temporary names say who writes them: ``.<name>.<host>.<pid>.<random>.tmp``.
A later save removes a temporary only when it is provably abandoned: written
by a process of this host that no longer exists, or untouched for
:data:`ABANDONED_AFTER_S` seconds. Another writer's file in progress is never
touched.

The bytes go to the file through ``os.write``, so a full disk is reported as
``OSError(ENOSPC)`` naming the file ("no space left on device"), not as
whatever the serializer makes of a short write; the target is left as it was.

:func:`without_zip_crc`: while a checksum of ddpctx's own records a file
(its manifest), ``torch.save`` leaves its zip records' CRC-32 fields at
zero instead of computing them: ``torch.load`` never checks them (a flipped
bit in a tensor loads silently), and computing them is ~30% of a
``torch.save`` of large tensors here (134 MB to memory: 103 ms with them,
72 ms without). The manifest's hash, computed as the bytes are written, is
what a load verifies. A file with no manifest (``ctx.save``, an export)
keeps torch's CRC-32, for the zip tools that check it.

Example:
    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "weights.pt"
    >>> atomic_save({"w": torch.ones(2)}, target)
    >>> torch.load(target, weights_only=True)["w"]
    tensor([1., 1.])
"""

from __future__ import annotations

import contextvars
import ctypes
import errno
import functools
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ddpctx.utils.digest import chosen, hasher

#: A temporary untouched this long is taken as abandoned even if its writer's
#: pid cannot be checked (another host on a shared filesystem).
ABANDONED_AFTER_S = 24 * 3600

_HOST = socket.gethostname().replace(".", "_") or "host"


def temporary_name(target: Path, suffix: str = "tmp") -> Path:
    """A fresh temporary path beside ``target`` that names this host and process."""
    return target.parent / f".{target.name}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}.{suffix}"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def is_abandoned(temporary: Path, now: float | None = None) -> bool:
    """True if ``temporary``'s writer provably gave up on it (dead pid here, or long untouched).

    >>> is_abandoned(Path(f".x.pt.{_HOST}.{os.getpid()}.0a1b2c3d.tmp"))
    False
    """
    parts = temporary.name.split(".")
    try:
        age = (now or time.time()) - temporary.stat().st_mtime
    except FileNotFoundError:
        return False
    if age > ABANDONED_AFTER_S:
        return True
    # .<name...>.<host>.<pid>.<random>.tmp -> host and pid are the 4th and 3rd from the end
    if len(parts) >= 5 and parts[-4] == _HOST and parts[-3].isdigit():
        return int(parts[-3]) != os.getpid() and not pid_alive(int(parts[-3]))
    return False  # another host's, or an unknown name: only age tells


def remove_abandoned(target: Path, suffix: str = "tmp") -> None:
    """Remove temporaries of ``target`` that their writers provably abandoned."""
    for stale in target.parent.glob(f".{target.name}.*.{suffix}"):
        if is_abandoned(stale):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


class _FileSink:
    """A write-only file object over a descriptor: every byte goes through ``os.write``."""

    def __init__(self, descriptor: int) -> None:
        self.descriptor = descriptor
        self.written = 0
        self.sum = hasher(chosen())  # of every byte written, for a checksum manifest
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sum.update(view)
        try:
            while view:
                count = os.write(self.descriptor, view)
                self.written += count
                view = view[count:]
        except OSError as error:
            self.error = error
            raise
        return len(data) if isinstance(data, (bytes, bytearray)) else memoryview(data).nbytes

    def flush(self) -> None:
        pass


def no_space_error(path: Path, error: OSError, written: int) -> OSError:
    """The error a full disk becomes: it names the file and says nothing was replaced."""
    return OSError(
        errno.ENOSPC,
        f"no space left on device while saving {str(path)!r} ({written} bytes written before "
        f"the disk filled; {os.strerror(error.errno or errno.ENOSPC)}). Nothing was replaced: "
        "the previous file and older checkpoints are intact. Free space on that filesystem "
        "or save elsewhere, then save again.",
    )


class _ZipCrc:
    """A process-wide switch: how many blocks are inside, and what the first one found."""

    lock = threading.Lock()
    inside = 0
    found = True


def _switches() -> tuple[Callable[[bool], None], Callable[[], bool]] | None:
    serialization: Any = torch.serialization
    switch = getattr(serialization, "set_crc32_options", None)
    current = getattr(serialization, "get_crc32_options", None)
    return None if switch is None or current is None else (switch, current)


@functools.cache
def _context_local() -> bool:
    """Whether torch's switch holds per thread (torch's config in a ``ContextVar``, as in 2.13)
    rather than for the whole process: set in a copied context, is it unchanged here?"""
    switches = _switches()
    if switches is None:
        return False
    switch, current = switches
    with _ZipCrc.lock:
        before = bool(current())
        contextvars.copy_context().run(switch, not before)
        if bool(current()) == before:
            return True
        switch(before)  # process-wide: put back at once
        return False


@contextmanager
def without_zip_crc() -> Iterator[None]:
    """``torch.save`` without its zip records' CRC-32 while inside; the setting restored after.

    Where torch's switch holds per thread (torch 2.13) each block sets and restores
    its own thread's. Where it holds for the whole process, blocks may nest and
    overlap across threads (a sync save beside an async one), and the setting found
    by the first is restored when the last one ends. A torch without the switch
    computes them.
    """
    switches = _switches()
    if switches is None:
        yield
        return
    switch, current = switches
    if _context_local():
        found = bool(current())
        switch(False)
        try:
            yield
        finally:
            switch(found)
        return
    with _ZipCrc.lock:
        if _ZipCrc.inside == 0:
            _ZipCrc.found = bool(current())
            switch(False)
        _ZipCrc.inside += 1
    try:
        yield
    finally:
        with _ZipCrc.lock:
            _ZipCrc.inside -= 1
            if _ZipCrc.inside == 0:
                switch(_ZipCrc.found)


def atomic_save(
    obj: Any, path: Path, before_publish: Callable[[tuple[int, str]], None] | None = None
) -> None:
    """``torch.save`` that never leaves a torn file at ``path``.

    ``before_publish`` gets the file's size and checksum (hex digits, in the
    algorithm of :func:`~ddpctx.utils.digest.chosen`) once it is written and
    synced, before it is renamed into place (to record them); the zip's own
    CRC-32 fields are then not computed (:func:`without_zip_crc`).
    """
    directory = path.parent
    if not directory.is_dir():
        raise FileNotFoundError(
            f"cannot save to {str(path)!r}: the directory {str(directory)!r} does not exist. "
            "Create it first (os.makedirs), or save elsewhere."
        )
    remove_abandoned(path)
    temporary = temporary_name(path)
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except PermissionError as error:
        raise PermissionError(
            f"cannot save to {str(path)!r}: no permission to create files in "
            f"{str(directory)!r} ({error.strerror}). Save to a directory you can write."
        ) from error
    except OSError as error:
        if error.errno != errno.EROFS:
            raise
        raise OSError(
            errno.EROFS,
            f"cannot save to {str(path)!r}: {str(directory)!r} is on a read-only file system. "
            "Nothing was written; save to a writable directory (loading from this one works).",
        ) from error
    sink = _FileSink(descriptor)
    try:
        try:
            if before_publish is None:  # no manifest: the zip's CRC-32 is the only check
                torch.save(obj, sink)  # type: ignore[arg-type]
            else:
                with without_zip_crc():
                    torch.save(obj, sink)  # type: ignore[arg-type]
            os.fsync(descriptor)
        except Exception as error:
            failure = sink.error if sink.error is not None else error
            if isinstance(failure, OSError) and failure.errno in (errno.ENOSPC, errno.EDQUOT):
                raise no_space_error(path, failure, sink.written) from error
            raise
        finally:
            os.close(descriptor)
        if before_publish is not None:
            before_publish((sink.written, sink.sum.hexdigest()))
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(directory)


def fsync_directory(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open directories
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


_RENAME_EXCHANGE = 2


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2``); False where that is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_cwd = -100
    result = renameat2(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), _RENAME_EXCHANGE)
    if result != 0:
        code = ctypes.get_errno()
        if code in (errno.ENOSYS, errno.EINVAL):  # kernel or filesystem without it
            return False
        raise OSError(code, os.strerror(code), str(first))
    return True


def replace_dir(written: Path, path: Path) -> None:
    """Put the directory ``written`` at ``path`` in one step; the old ``path`` is removed."""
    fsync_directory(written)
    if not path.exists():
        os.rename(written, path)
    elif _exchange(written, path):
        shutil.rmtree(written)  # now holds the old directory
    else:  # two renames: a crash in between leaves the old one under a .old name
        old = temporary_name(path, "old")
        os.rename(path, old)
        os.rename(written, path)
        shutil.rmtree(old)
    fsync_directory(path.parent)
