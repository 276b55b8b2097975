"""One writer per checkpoint directory: rank 0 holds a lock on it for the job's lifetime.

Two jobs saving into one directory reuse numbers and prune each other's
newest checkpoints, so the newest checkpoint may hold the *other* job's
weights. At its first save into a directory, rank 0 takes an exclusive
``fcntl.flock`` on ``<directory>/.ddpctx-writer.lock`` and keeps it until the
``distributed()`` block ends (then removes the file); it writes who it is into the file (host, pid,
the launcher's job id, the rendezvous address, the start time and the
command). A second job's first save into that directory finds the lock
taken and is refused on every rank with a ``RuntimeError`` naming the holder.

Why ``flock`` and no heartbeat file: the kernel drops the lock when the
holding process dies, however it dies (SIGKILL, OOM killer), so a dead job
never locks the directory: the next run -- a torchrun restart of the same
job, or a new one -- takes it over at once, with no timeout to wait out and
no clock to trust. A process forked after the claim (a DataLoader worker, a
``multiprocessing`` pool) shares the locked open file, which would keep a
dead writer's lock for as long as the child lives: every forked child closes
its copies of the held descriptors at once (``os.register_at_fork``), so only
the claiming process holds the lock. On NFS (v4, or v3 with lockd) Linux emulates ``flock``
with POSIX byte-range locks that the server arbitrates across hosts; a
client host that crashes loses its locks when its lease expires (about 90 s
by default). An NFS mount with ``-o nolock`` keeps locks local to each host:
two jobs on different hosts are then not told apart by the lock. File
systems without locking (Lustre without ``-o flock``, some FUSE mounts)
answer ``ENOLCK``/``EOPNOTSUPP``: the save then goes on with a warning,
guarded only by the weaker check of
:func:`~ddpctx.checkpoint.files.check_single_writer` (a newer checkpoint this
run did not write).

Each :meth:`Claims.claim` of a directory already held (every save) checks,
with one ``stat``, that the lock file is still the one locked: removed or
replaced under the job (an ``rm`` of the directory), it is claimed again, or,
when another job took the new file in between, refused naming that job. A
lock file of another user that this user cannot open is refused naming its
owner's uid.

Loading takes no lock: reading a directory another job writes is allowed.

This module knows nothing of ranks: the caller runs :meth:`Claims.claim` on
rank 0 and :meth:`Claims.release` when its block ends.

Example:
    >>> import tempfile
    >>> claims = Claims()
    >>> claims.claim(Path(tempfile.mkdtemp()))
    >>> len(claims.held)
    1
    >>> claims.release()
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpctx.utils.atomic import pid_alive
from ddpctx.utils.warn import warn_user

LOCK_FILE = ".ddpctx-writer.lock"

#: Environment variables that identify a job, per launcher, in the order they are named.
JOB_IDS = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID")

_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def who_am_i() -> dict[str, Any]:
    """What the lock file says about its holder."""
    jobs = {name: os.environ[name] for name in JOB_IDS if os.environ.get(name)}
    address = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job": jobs,
        "rendezvous": ":".join(filter(None, address)) or None,
        "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv])[:300],
    }


def describe(owner: dict[str, Any] | None) -> str:
    """A holder as a person reads it: host, pid, job ids, rendezvous, since, command."""
    if not owner:
        return "a job that has not written its name yet (it is taking the lock right now)"
    jobs = ", ".join(f"{name}={value}" for name, value in (owner.get("job") or {}).items())
    parts = [f"host {owner.get('host')!r}", f"pid {owner.get('pid')}"]
    if jobs:
        parts.append(jobs)
    if owner.get("rendezvous"):
        parts.append(f"rendezvous {owner['rendezvous']}")
    parts.append(f"since {owner.get('since')}")
    parts.append(f"running {owner.get('command')!r}")
    return ", ".join(parts)


def _read_owner(descriptor: int) -> dict[str, Any] | None:
    try:
        text = os.pread(descriptor, 65536, 0).decode("utf-8", "replace")
        owner = json.loads(text)
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


#: The lock descriptors this process opened and has not closed, and every live
#: :class:`Claims`: a forked child closes the first and empties the second.
_OPEN_LOCKS: set[int] = set()
_ALL_CLAIMS: weakref.WeakSet[Claims] = weakref.WeakSet()


@dataclass(eq=False)
class Claims:
    """The checkpoint directories this job writes, each with its held lock's descriptor."""

    held: dict[Path, int] = field(default_factory=dict)  # -1: unlockable file system

    def __post_init__(self) -> None:
        _ALL_CLAIMS.add(self)

    def claim(self, directory: Path) -> None:
        """Hold ``directory``'s writer lock from now on; an error naming the job that holds it."""
        key = directory.resolve()
        path = key / LOCK_FILE
        held = self.held.get(key)
        if held is not None:
            if held < 0 or _same_file(held, path):  # one stat per save, nothing per step
                return
            del self.held[key]  # removed or replaced under this job: claim it again
            _close(held)
            try:
                self._take(key, path)
            except RuntimeError as error:
                raise RuntimeError(
                    f"the writer lock {str(path)!r} was removed while this job held it, and "
                    f"could not be taken again: {error}"
                ) from None
            return
        self._take(key, path)

    def _take(self, key: Path, path: Path) -> None:
        for _ in range(100):  # the holder may unlink the file between our open and our lock
            descriptor = _open(path)
            if descriptor is None:  # a read-only file system: the save itself says so
                return
            _OPEN_LOCKS.add(descriptor)
            try:
                locked = _lock(descriptor, path)
            except BaseException:
                _close(descriptor)
                raise
            if not locked:
                self.held[key] = -1
                _close(descriptor)
                return
            if _same_file(descriptor, path):
                break
            _close(descriptor)  # we locked a file its holder had just removed: again
        else:
            raise RuntimeError(f"could not take the writer lock {str(path)!r}: it kept changing.")
        with contextlib.suppress(OSError):  # opened read-only: locked, but nameless
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, json.dumps(who_am_i()).encode(), 0)
        self.held[key] = descriptor

    def release(self) -> None:
        """Let every lock go (the block ended); the kernel does the same for a dead process."""
        held, self.held = self.held, {}
        for directory, descriptor in held.items():
            if descriptor >= 0:  # removed while still held, so no one locks a stale file
                if _same_file(descriptor, directory / LOCK_FILE):  # not another job's new one
                    with contextlib.suppress(OSError):
                        os.unlink(directory / LOCK_FILE)
                _close(descriptor)


def _close(descriptor: int) -> None:
    _OPEN_LOCKS.discard(descriptor)
    os.close(descriptor)


def _forget_in_child() -> None:
    """In a forked child: close its copies of the lock descriptors; it holds no lock."""
    for claims in list(_ALL_CLAIMS):
        claims.held = {}
    for descriptor in list(_OPEN_LOCKS):
        with contextlib.suppress(OSError):
            os.close(descriptor)
    _OPEN_LOCKS.clear()


# flock belongs to the open file, which fork shares: a child that kept it would hold a dead
# writer's lock for as long as it lives (a DataLoader worker, a pool process).
os.register_at_fork(after_in_child=_forget_in_child)


def _open(path: Path) -> int | None:
    """The lock file, created if needed; read-only if another user's; None if nothing can be."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:  # another user's lock file (umask 022): lock it read-only
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None  # no right to create files here: the save says so, naming the path
        except PermissionError:
            _refuse_unreadable(path)
            raise
    except OSError as error:
        if error.errno == errno.EROFS:
            return None
        raise


def _refuse_unreadable(path: Path) -> None:
    """Raise naming the owner of a lock file this user cannot even read (umask 077)."""
    try:
        info = os.stat(path)
    except OSError:
        return  # gone, or not even stat-able: the raw PermissionError names the path
    try:
        import pwd

        owner = f"uid {info.st_uid} ({pwd.getpwuid(info.st_uid).pw_name})"
    except (ImportError, KeyError):
        owner = f"uid {info.st_uid}"
    raise RuntimeError(
        f"another job may be writing checkpoints to {str(path.parent)!r}: its writer lock "
        f"{str(path)!r} belongs to {owner} (mode {stat.filemode(info.st_mode)}), and this "
        f"process (uid {os.getuid()}) cannot open it to see whether it is held. Two writers "
        "would reuse numbers and prune each other's newest checkpoints, so this save is "
        "refused. Give this run its own checkpoint directory; if no job of that user runs "
        "here any more, that user can remove the file."
    ) from None


def _same_file(descriptor: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(descriptor), os.stat(path))
    except FileNotFoundError:
        return False


def _lock(descriptor: int, path: Path) -> bool:
    """Take the lock: True; False on a file system without locks (warned); else an error."""
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _read_owner(descriptor) or {}
        pid, here = owner.get("pid"), owner.get("host") == socket.gethostname()
        dead = here and isinstance(pid, int) and pid > 0 and not pid_alive(pid)
        stop = (
            "stop the other job (a job that died releases the lock at once; nothing needs removing)"
        )
        hint = ""
        if here and pid == os.getpid():
            hint = (
                " It is this very process, through another distributed() block that has not "
                "ended: end that block first."
            )
        elif dead:
            hint = (
                f" Its process {pid} is dead, but a process it started still holds the lock "
                f"(find it with `fuser -v {str(path)!r}`, `lsof {str(path)!r}` or in "
                "/proc/locks)."
            )
            stop = "stop that process (nothing needs removing)"
        raise RuntimeError(
            f"another job is writing checkpoints to {str(path.parent)!r}: {describe(owner)} "
            f"holds its writer lock ({str(path)!r}).{hint} Two writers would reuse numbers and "
            "prune each other's newest checkpoints, so this save is refused. Give this run its "
            f"own checkpoint directory, or {stop}."
        ) from None
    except OSError as error:
        if error.errno not in _UNSUPPORTED:
            raise
        warn_user(
            f"cannot lock {str(path)!r} ({error.strerror}): this file system does not support "
            "flock, so a second job writing the same checkpoint directory is detected only "
            "when it writes a newer checkpoint. Give each run its own directory (or mount with "
            "locking, e.g. Lustre's -o flock).",
            RuntimeWarning,
        )
        return False
    return True
