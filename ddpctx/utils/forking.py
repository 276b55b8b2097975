"""Forking a process that holds torch's C++ objects: the children never collect them.

A forked child has one thread, but a copy of every object of its parent --
including garbage the parent's collector has not reached yet, such as a
destroyed process group still held in a reference cycle (a traceback, a
closure). If a collection in the child finalizes such an object, its C++
destructor joins threads that exist only in the parent: gloo's
``~ProcessGroupGloo`` waits on them forever, and other objects abort
(``Fatal Python error: Aborted`` while ``Garbage-collecting``). Freezing the
collector across the fork moves everything that exists at that moment into the
children's permanent generation, which a collection never examines; the parent
unfreezes at once and collects as usual.

Example:
    >>> import gc
    >>> with collector_frozen():
    ...     frozen = gc.get_freeze_count() > 0
    >>> frozen
    True
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_frozen"]


@contextlib.contextmanager
def collector_frozen() -> Iterator[None]:
    """While inside, every object tracked now is frozen: fork the children here."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
