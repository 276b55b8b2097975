"""DCP's file writer: each shard hashed as it is written; a failed write's ``errno`` kept.

Checksums while writing: every byte DCP writes into a shard passes through
:class:`_RecordingStream`, which hashes it (:mod:`ddpctx.utils.digest`)
into the checksum of the current *segment*. DCP asks the stream's position
(``tell``) before and after each entry it writes, so each segment between
two ``tell`` calls is exactly one entry: its checksum is that entry's part
in the manifest (:mod:`ddpctx.checkpoint.sums`). The entries cover the
shard end to end, so the shard is recorded as its parts, each byte hashed
once, and no shard is read back to checksum it. Those hashes being what a
load verifies, ``torch.save`` skips its zip records' CRC-32 meanwhile
(:func:`~ddpctx.utils.atomic.without_zip_crc`; ``torch.load`` never checks it).
:class:`Hashed` is what a file's stream recorded.

Errors: DCP writes each rank's shards with ``torch.save`` into a Python file. When
the disk fills, the ``OSError(ENOSPC)`` of ``write`` is swallowed by torch's
C++ zip writer, which then reports ``[enforce fail at inline_container.cc]
... unexpected pos 704 vs 598``: nothing says the disk is full. The
:class:`Writer` here hands DCP files whose ``write`` remembers the first
``OSError``; a failed ``write_data`` is then re-raised as that ``OSError``
naming the file, which :mod:`ddpctx.checkpoint.writefailures` turns into the
error a single-file checkpoint raises.

This module is imported when a sharded checkpoint is first saved (DCP costs
about a second of import time).

Example:
    >>> import tempfile
    >>> writer = Writer(tempfile.mkdtemp())
    >>> type(writer.fs).__name__
    'RecordingFileSystem'
"""

from __future__ import annotations

import os
import threading
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ddpctx.utils.atomic import without_zip_crc
from ddpctx.utils.digest import Hasher, chosen, hasher


@dataclass
class Hashed:
    """What the stream of one written file hashed: its size and its segments' checksums.

    ``segments``: (offset, length) -> checksum of each stretch between two ``tell`` calls.
    """

    algorithm: str
    size: int = 0
    segments: dict[tuple[int, int], str] = field(default_factory=dict)


class _RecordingStream:
    """A file that hashes what is written, segment by segment, and whose ``write``
    failures are remembered by its file system; the rest passes."""

    def __init__(self, stream: Any, path: Path, failures: list[tuple[Path, OSError]]) -> None:
        self._stream = stream
        self._path = path
        self._failures = failures
        self.hashed = Hashed(chosen())
        self._segment: Hasher = hasher(self.hashed.algorithm)
        self._start = 0  # where the current segment began
        self._position = 0  # bytes written so far

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            count = int(self._stream.write(view))
        except OSError as error:
            self._failures.append((self._path, error))
            raise
        self._segment.update(view[:count])
        self._position += count
        return count

    def tell(self) -> int:
        """The position, and the end of a segment: DCP asks it around every entry."""
        self._cut()
        return int(self._stream.tell())

    def _cut(self) -> None:
        if self._position > self._start:
            span = (self._start, self._position - self._start)
            self.hashed.segments[span] = self._segment.hexdigest()
            self._segment = hasher(self.hashed.algorithm)
            self._start = self._position

    def finished(self) -> Hashed:
        """The file's sums, once every byte is written."""
        self._cut()
        self.hashed.size = self._position
        return self.hashed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class RecordingFileSystem(FileSystem):
    """DCP's local file system; ``failures`` holds every failed write's path and error,
    ``hashed`` each file written whole: its name -> :class:`Hashed`."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[tuple[Path, OSError]] = []
        self.hashed: dict[str, Hashed] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode and "a" not in mode:
                yield stream
                return
            seen: list[tuple[Path, OSError]] = []
            recording = _RecordingStream(stream, Path(path), seen)
            try:
                yield recording
            except OSError as error:  # e.g. the close flushed into a full disk
                seen.append((Path(path), error))
                raise
            finally:
                with self._lock:
                    self.failures.extend(seen)
            if "w" in mode and "+" not in mode and not seen:  # written from its first byte
                with self._lock:
                    self.hashed[Path(path).name] = recording.finished()


class Writer(FileSystemWriter):
    """``FileSystemWriter`` whose failed writes raise the ``OSError`` that caused them.

    ``written`` (if given) receives each entry written on this rank: its file's
    name, offset and length; ``hashed`` (if given) each file's :class:`Hashed`
    (what :func:`~ddpctx.checkpoint.sharded.confirm_parts` records).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        written: list[tuple[str, int, int]] | None = None,
        hashed: dict[str, Hashed] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(path, **options)
        fs = RecordingFileSystem()
        if hashed is not None:
            fs.hashed = hashed  # filled as each file is closed
        self.fs = fs
        self._written = written

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            with without_zip_crc():  # the manifest's hashes, taken here, are what loads check
                future = super().write_data(plan, planner)
        except BaseException as error:
            self._raise_recorded(error)
            raise
        if self._written is not None:
            future.add_done_callback(self._record)
        return future

    def _record(self, future: Future[list[WriteResult]]) -> None:
        assert self._written is not None
        try:
            results = future.value()
        except BaseException:  # a failed write: DCP reports it; nothing is published
            return
        for result in results:
            info = result.storage_data
            name = getattr(info, "relative_path", None)
            if isinstance(name, str):
                self._written.append((name, int(info.offset), int(info.length)))

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        try:
            super().finish(metadata, results)
        except BaseException as error:
            self._raise_recorded(error)
            raise

    def _raise_recorded(self, error: BaseException) -> None:
        """Raise the first recorded write failure instead of ``error``; never for a
        ``KeyboardInterrupt``/``SystemExit``, which must stay what they are."""
        fs = self.fs
        if isinstance(error, Exception) and isinstance(fs, RecordingFileSystem) and fs.failures:
            path, cause = fs.failures[0]
            raise OSError(cause.errno, f"{cause.strerror} (writing {str(path)!r})") from error
