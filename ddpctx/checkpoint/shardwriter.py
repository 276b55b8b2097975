"""DCP's file writer, with the ``errno`` of a failed write kept rather than lost.

DCP writes each rank's shards with ``torch.save`` into a Python file. When
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
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future


class _RecordingStream:
    """A file whose ``write`` failures are remembered by its file system; the rest passes."""

    def __init__(self, stream: Any, path: Path, failures: list[tuple[Path, OSError]]) -> None:
        self._stream = stream
        self._path = path
        self._failures = failures

    def write(self, data: Any) -> int:
        try:
            return int(self._stream.write(data))
        except OSError as error:
            self._failures.append((self._path, error))
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class RecordingFileSystem(FileSystem):
    """DCP's local file system; ``failures`` holds every failed write's path and error."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[tuple[Path, OSError]] = []
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode and "a" not in mode:
                yield stream
                return
            seen: list[tuple[Path, OSError]] = []
            try:
                yield _RecordingStream(stream, Path(path), seen)
            except OSError as error:  # e.g. the close flushed into a full disk
                seen.append((Path(path), error))
                raise
            finally:
                with self._lock:
                    self.failures.extend(seen)


class Writer(FileSystemWriter):
    """``FileSystemWriter`` whose failed writes raise the ``OSError`` that caused them.

    ``written`` (if given) receives each entry written on this rank: its file's
    name, offset and length (what :func:`~ddpctx.checkpoint.sharded.confirm_parts`
    checksums one by one).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        written: list[tuple[str, int, int]] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(path, **options)
        self.fs = RecordingFileSystem()
        self._written = written

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
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
