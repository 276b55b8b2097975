"""The pool's rendezvous store: one loopback ``TCPStore`` for the pool's life, a prefix per task.

Every task of a :class:`~ddpctx.launching.pool.RankPool` forms a fresh
process group, so the store it is formed on is on the path of every test the
pytest plugin runs. A ``FileStore`` polls its file: forming a 2-rank gloo
group over one took about 11.5 ms here, against 2.0 ms over a ``TCPStore``.
The pool therefore keeps one ``TCPStore`` for its whole life, served by rank
0, and each task works under a prefix of its own (``task<n>/``), so no key of
one task is ever seen by the next. Rank 0 deletes a task's keys once every
rank is done with it -- when it has finished the task after it, which the
parent sends only once every rank has finished the one before -- so a long
session holds the keys of about two tasks, not of every test it ran
(``num_keys()`` counts the whole store's keys, as torch's ``PrefixStore``
does under any launcher).

Off the network: the parent binds the listening socket to ``127.0.0.1``
before it forks (a ``TCPStore`` left to bind for itself listens on every
interface, whatever host name it is given) and rank 0's store serves that very socket. The other
ranks close their inherited copy and connect to its port. Like the loopback
sockets of gloo's own transport, the port is reachable by local processes
only, for as long as the pool lives.

Example:
    >>> import socket
    >>> listener = loopback_listener()
    >>> listener.getsockname()[0]
    '127.0.0.1'
    >>> listener.close()
"""

from __future__ import annotations

import contextlib
import socket
from datetime import timedelta
from typing import Any


def loopback_listener() -> socket.socket:
    """A socket listening on ``127.0.0.1`` at a free port, bound by the parent for its pool."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1024)
    except BaseException:
        listener.close()
        raise
    return listener


class PoolStore:
    """One rank's side of the pool's store: rank 0 serves it on ``listener``, the others connect.

    The store is made at the first task (when torch is imported anyway) and
    kept for the worker's life; :meth:`for_task` hands out a fresh prefix of it.
    """

    def __init__(self, rank: int, world_size: int, listener: socket.socket) -> None:
        self._rank = rank
        self._world_size = world_size
        self._port: int = listener.getsockname()[1]
        self._listener: socket.socket | None = listener
        if rank != 0:  # only rank 0 serves; the others' inherited copies must not linger
            listener.close()
            self._listener = None
        self._store: Any = None
        self._previous: int | None = None  # the task before the one that ran last

    def for_task(self, number: int, timeout: timedelta) -> Any:
        """The store for task ``number``: the shared store under the prefix ``task<number>/``."""
        import torch.distributed as dist

        if self._store is None:
            if self._listener is not None:
                self._store = dist.TCPStore(  # type: ignore[attr-defined]
                    "127.0.0.1",
                    self._port,
                    self._world_size,
                    True,
                    timeout,
                    wait_for_workers=False,
                    master_listen_fd=self._listener.detach(),  # the store owns and closes it
                )
                self._listener = None
            else:
                self._store = dist.TCPStore(  # type: ignore[attr-defined]
                    "127.0.0.1", self._port, self._world_size, False, timeout
                )
        self._store.set_timeout(timeout)
        return dist.PrefixStore(f"task{number}", self._store)  # type: ignore[attr-defined]

    def finished(self, number: int) -> None:
        """Task ``number`` ended on this rank: rank 0 deletes the keys of the task before it.

        Every rank is done with that one (the parent sent task ``number`` only
        once they were); this rank has just sent its outcome, so the deletion
        overlaps what the parent does before the next task. A torch without
        ``list_keys`` keeps the keys, as a ``FileStore`` per task did its files.
        """
        previous, self._previous = self._previous, number
        if self._rank != 0 or self._store is None or previous is None:
            return
        prefix = f"task{previous}/"
        with contextlib.suppress(RuntimeError, AttributeError, ValueError):
            for key in self._store.list_keys():
                if key.startswith(prefix):
                    self._store.delete_key(key)
