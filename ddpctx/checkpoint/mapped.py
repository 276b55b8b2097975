"""Shard files mapped read-only, and views of them that ``torch.load`` reads with one copy.

A sharded load verifies each entry's bytes before ``torch.load`` sees them
(:mod:`ddpctx.checkpoint.dcpread`). Read into a ``bytes`` object first, each
entry's tensor would be copied twice on its way into the model (file ->
bytes -> tensor) where DCP's own reader copies it once. Mapping each entry
instead (one at a time, so a load holds no more than one entry's pages), the
checksum runs over the mapped pages, and :class:`View` hands them to
``torch.load``, which reads a tensor's bytes with ``readinto``
straight into its storage: one copy, as DCP's. A file system that cannot map
files is read as before.

Example:
    >>> view = View(memoryview(b"abcdef"))
    >>> view.seek(2)
    2
    >>> view.read(3)
    b'cde'
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
from collections.abc import Iterator
from typing import IO, Any

#: Shared, read-only, and its page table filled in one call (where the platform can): the
#: checksum and the copy then read the pages without a page fault per few pages.
_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


@contextlib.contextmanager
def entry_bytes(stream: IO[bytes], size: int, offset: int, length: int) -> Iterator[memoryview]:
    """The bytes ``offset..offset+length`` of the file ``stream`` (``size`` bytes long).

    A view of just that stretch mapped read-only, unmapped when the block ends
    (so no more than one entry's pages are mapped at a time); read instead where
    the file system cannot map files. Shorter than ``length`` when the file is.
    """
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    end = min(offset + length, size)
    mapped = None
    if end > offset:
        try:
            mapped = mmap.mmap(stream.fileno(), end - start, _FLAGS, mmap.PROT_READ, offset=start)
        except (OSError, ValueError):  # a file system that cannot map files: read them
            mapped = None
    if mapped is None:
        stream.seek(offset)
        yield memoryview(stream.read(length))
        return
    try:
        yield memoryview(mapped)[offset - start : end - start]
    finally:
        with contextlib.suppress(BufferError):  # a view still held: unmapped when it goes
            mapped.close()


class View(io.RawIOBase):
    """A seekable file over bytes in memory that copies only into the caller's buffer.

    ``torch.load`` reads a tensor's bytes with ``readinto`` straight into its
    storage: from a view of a mapped shard, that is the one copy of them.
    """

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data = data
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: len(self._data)}
        self._position = max(0, base[whence] + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        count = max(0, min(len(target), len(self._data) - self._position))
        target[:count] = self._data[self._position : self._position + count]
        self._position += count
        return count
