"""The built-in file loggers: ``metrics.jsonl`` and ``metrics.csv``, live and never torn.

Contract (what :mod:`ddpctx.watch.lanes` relies on):

- ``resume(step)`` rewrites the file atomically with the lines whose step is
  at most ``step`` (``None``: an empty trail; a line torn by a kill is
  dropped), then appends to it.
- ``write_points(points)`` appends every ``(step, metrics)`` of a batch with
  one ``os.write`` (no Python buffer): the lines are in the file, readable by
  ``tail -f`` or pandas, as soon as the call returns. A write that fails (a
  full disk) is cut back to the last complete line before the error goes
  up: the file never ends in a torn line.
- ``flush()`` fsyncs (every checkpoint calls it); ``close()`` ends.

``metrics.jsonl`` writes NaN and +/-Infinity as ``null`` (JSON has no such
numbers) and integers exactly. ``metrics.csv`` is appended to; a metric name
that first appears later widens the header, which means rewriting the file
once (the old rows get empty cells): such rewrites are coalesced, at most one
every :data:`REWRITE_EVERY_S`, so a run that adds a name every step (per-class
metrics) never makes the writer fall behind; rows wait for the rewrite at
most that long.
"""

from __future__ import annotations

import abc
import csv
import io
import json
import os
import time
from pathlib import Path
from typing import Any

from ddpctx.utils.atomic import fsync_directory, temporary_name
from ddpctx.watch.metrics import json_number

#: The least time between two rewrites of ``metrics.csv`` for a wider header.
REWRITE_EVERY_S = 1.0
#: The run's configuration (``ctx.log_config``) in ``log_dir``: a name no library writes.
#: ``config.json`` (runs before it) is what Hugging Face's ``save_pretrained`` writes and
#: ``from_pretrained`` reads, and ``log_dir`` is often the folder a model is saved to.
CONFIG_FILE = "ddpctx-config.json"

Point = tuple[int, dict[str, float]]


class FileLogger(abc.ABC):
    """A built-in logger: batches of points, a pending part that :meth:`tick` writes."""

    path: Path

    @abc.abstractmethod
    def write_points(self, points: list[Point]) -> None:
        """Write one batch of points, each line whole (jsonl: a line a point; csv: a row)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.write_points([(step, metrics)])

    def tick(self) -> None:  # noqa: B027 (a default: only the csv holds rows back)
        """Write what waits (the csv's rows behind a header rewrite), if its time has come."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"


class AppendFile:
    """One file appended to with ``os.write``; a failed write is cut back to the last whole line.

    The lines of a failed append that reached the file whole stay (a batch
    the writer thread took in at once may be larger than the room left on a
    full disk: cutting back to the batch's start would lose lines that fit).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._size = 0

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def replace(self, data: bytes) -> None:
        """The file becomes ``data`` at once; later appends go after it."""
        self.close()
        atomic_write_bytes(self.path, data)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._size = len(data)

    def append(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError as error:
            reached = data[: len(data) - len(view)]
            self._size += reached.rfind(b"\n") + 1  # the whole lines that reached the file
            os.ftruncate(self._fd, self._size)  # never a torn last line
            raise OSError(
                error.errno, f"{error.strerror}; {self.path} ends at its last complete line"
            ) from error
        self._size += len(data)

    def sync(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class JsonlLogger(FileLogger):
    """``log_dir/metrics.jsonl``: one JSON object per ``ctx.log`` call, ``"step"`` first.

    Example:
        >>> import tempfile, pathlib
        >>> JsonlLogger(pathlib.Path(tempfile.mkdtemp())).path.name
        'metrics.jsonl'
    """

    def __init__(self, log_dir: Path) -> None:
        self.path = log_dir / "metrics.jsonl"
        self._file = AppendFile(self.path)

    def resume(self, step: int | None) -> None:
        kept = [] if step is None else _kept_lines(self.path, step)
        self._file.replace("".join(line + "\n" for line in kept).encode())

    def write_points(self, points: list[Point]) -> None:
        if not self._file.is_open:
            self.resume(None)
        text = "".join(
            json.dumps(
                {"step": step, **{name: json_number(value) for name, value in metrics.items()}},
                allow_nan=False,
            )
            + "\n"
            for step, metrics in points
        )
        self._file.append(text.encode())

    def log_hparams(self, params: dict[str, Any]) -> None:
        text = json.dumps(params, indent=2, sort_keys=True, default=str)
        atomic_write_bytes(self.path.with_name(CONFIG_FILE), (text + "\n").encode())

    def flush(self) -> None:
        self._file.sync()

    def close(self) -> None:
        self._file.sync()
        self._file.close()


class CsvLogger(FileLogger):
    """``log_dir/metrics.csv``: a ``step`` column, then one column per metric name.

    A name that first appears later widens the header: the file is rewritten
    once for it (coalesced, see the module docstring).

    Example:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> logger = CsvLogger(folder)
        >>> logger.log_metrics({"loss": 0.5}, step=3)
        >>> logger.close()
        >>> (folder / "metrics.csv").read_text().splitlines()
        ['step,loss', '3,0.5']
    """

    def __init__(self, log_dir: Path) -> None:
        self.path = log_dir / "metrics.csv"
        self._file = AppendFile(self.path)
        self._columns: list[str] = ["step"]
        self._known: set[str] = {"step"}
        self._pending: list[Point] = []  # rows behind a header rewrite, in order
        self._rewritten_at = -float("inf")

    def resume(self, step: int | None) -> None:
        rows = [] if step is None else _kept_rows(self.path, step)
        self._columns = ["step"]
        for row in rows:
            self._columns += [name for name in row if name not in self._columns]
        self._known = set(self._columns)
        self._pending = []
        self._file.replace(self._header() + b"".join(self._row(row) for row in rows))

    def write_points(self, points: list[Point]) -> None:
        if not self._file.is_open:
            self.resume(None)
        self._pending += points
        self._drain(force=False)

    def tick(self) -> None:
        if self._pending:
            self._drain(force=False)

    def flush(self) -> None:
        self._drain(force=True)
        self._file.sync()

    def close(self) -> None:
        if self._file.is_open:
            self.flush()
        self._file.close()

    def _drain(self, force: bool) -> None:
        fitting = 0
        for _, metrics in self._pending:
            if not self._known.issuperset(metrics):
                break
            fitting += 1
        if fitting < len(self._pending) and (
            force or time.monotonic() - self._rewritten_at >= REWRITE_EVERY_S
        ):
            self._widen()
            fitting = len(self._pending)
        if fitting:
            rows = [{"step": step, **metrics} for step, metrics in self._pending[:fitting]]
            self._file.append(b"".join(self._row(row) for row in rows))
            del self._pending[:fitting]

    def _widen(self) -> None:
        """Rewrite the file once with every name the pending rows bring, old rows padded."""
        added: list[str] = []
        for _, metrics in self._pending:
            for name in metrics:
                if name not in self._known:
                    self._known.add(name)
                    added.append(name)
        old_header = self._header()
        self._columns += added
        body = self.path.read_bytes()[len(old_header) :] if self.path.exists() else b""
        padding = b"," * len(added)
        lines = body.split(b"\n")[:-1]  # the file ends with a newline: its last piece is empty
        self._file.replace(self._header() + b"".join(line + padding + b"\n" for line in lines))
        self._rewritten_at = time.monotonic()

    def _header(self) -> bytes:
        return self._row({name: name for name in self._columns})

    def _row(self, row: dict[str, Any]) -> bytes:
        text = io.StringIO()
        csv.DictWriter(text, self._columns, lineterminator="\n").writerow(row)
        return text.getvalue().encode()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` at once: a temporary file, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(path)
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def _kept_lines(path: Path, step: int) -> list[str]:
    """The complete JSON lines of ``path`` whose step is at most ``step``, in order."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # torn by the kill
        if (
            isinstance(record, dict)
            and isinstance(record.get("step"), int)
            and record["step"] <= step
        ):
            kept.append(line)
    return kept


def _kept_rows(path: Path, step: int) -> list[dict[str, Any]]:
    """The complete rows of ``path`` whose step is at most ``step``, cells as written."""
    if not path.exists():
        return []
    rows = []
    with open(path, encoding="utf-8", newline="") as file:
        for row in csv.DictReader(file):
            try:
                row_step = int(row["step"])
            except (KeyError, TypeError, ValueError):
                continue
            if row_step <= step and None not in row and all(v is not None for v in row.values()):
                rows.append({**row, "step": row_step})
    return rows
