"""Where ``ctx.log`` writes: JSON lines, CSV, TensorBoard, or an object of the user's.

A logger is anything with ``log_metrics(metrics, step)``; these methods are
used when it has them (:class:`Logger` spells the protocol out):

- ``log_hparams(params)``: the run's configuration, once per run: only when
  the trail starts fresh, never by a resumed run.
- ``resume(step)``: called before anything else is written. Points after
  ``step`` came from an attempt that was killed and must go (``step`` may be
  -1: none is kept); ``None`` means a fresh run (nothing of an earlier run in
  this directory is kept). A resumed run whose first point is at the
  checkpoint's own step redoes that step: ``step`` is then the one before it.
- ``flush()``: everything written so far is durable (called at every
  checkpoint, so what a checkpoint covers is never lost).
- ``close()``: at the end of the ``distributed()`` block.

Only rank 0 calls loggers, each logger from a thread of its own
(:mod:`ddpctx.watch.lanes`), one call at a time: a logger needs no locks,
and one that hangs holds up neither the others nor training. ``metrics`` is
a flat ``{name: number}`` (ints stay exact ints); nested dicts given to
``ctx.log`` arrive as ``"outer/inner"`` names.

The built-in files (:mod:`ddpctx.watch.files`) are rewritten atomically on
``resume`` (a line torn by a kill is dropped with the points after the
checkpoint) and appended to as points arrive. TensorBoard's own mechanism is
used for its event files: a writer opened with ``purge_step=step + 1`` makes
readers discard the killed attempt's points.

:func:`check_log_dir` is ``distributed()``'s check that rank 0 can write
``log_dir`` at all (a file in its place, no permission, a full disk), made
before the block starts rather than found by the writer thread later.

Example:
    >>> import tempfile, json, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> logger = JsonlLogger(folder)
    >>> logger.resume(None)
    >>> logger.log_metrics({"loss": 0.5}, step=0)
    >>> logger.close()
    >>> json.loads((folder / "metrics.jsonl").read_text())
    {'step': 0, 'loss': 0.5}
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ddpctx.utils.atomic import temporary_name
from ddpctx.watch.files import CsvLogger, FileLogger, JsonlLogger, Point, atomic_write_bytes
from ddpctx.watch.trackers import TRACKERS

__all__ = [
    "BUILT_IN",
    "CsvLogger",
    "JsonlLogger",
    "Logger",
    "TensorBoardLogger",
    "atomic_write_bytes",
    "check_log_dir",
    "make_loggers",
]

#: The names ``distributed(loggers=...)`` accepts for the built-in loggers.
BUILT_IN = ("jsonl", "csv", "tensorboard", *TRACKERS)
#: How often TensorBoard's own writer puts its events on disk (seconds).
TB_FLUSH_S = 5


@runtime_checkable
class Logger(Protocol):
    """What ``distributed(loggers=(...))`` accepts besides a built-in name.

    Only ``log_metrics`` is required; ``log_hparams``, ``resume``, ``flush``
    and ``close`` are called when present (see the module docstring).

    Example:
        >>> class Printer:
        ...     def log_metrics(self, metrics, step):
        ...         print(step, metrics)
        >>> isinstance(Printer(), Logger)
        True
    """

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...


class TensorBoardLogger(FileLogger):
    """Event files under ``log_dir`` (``pip install ddpctx[tensorboard]``).

    A resume opens the writer with ``purge_step=step + 1``: TensorBoard then
    drops the killed attempt's points at those steps and later ones. The
    hparams go in as a text summary (``config``) at step 0. TensorBoard's
    writer puts its events on disk every :data:`TB_FLUSH_S` and at every
    checkpoint.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.path = log_dir
        self._writer: Any = None
        _summary_writer()  # refuse at once, naming the extra, when tensorboard is missing

    def resume(self, step: int | None) -> None:
        if self._writer is not None:
            self._writer.close()
        # A fresh run purges every earlier point in the directory: purge_step=0.
        self._writer = _summary_writer()(
            str(self.log_dir),
            purge_step=0 if step is None else step + 1,
            flush_secs=TB_FLUSH_S,
        )

    def write_points(self, points: list[Point]) -> None:
        if self._writer is None:
            self.resume(None)
        for step, metrics in points:
            for name, value in metrics.items():
                self._writer.add_scalar(name, value, global_step=step)

    def log_hparams(self, params: dict[str, Any]) -> None:
        if self._writer is None:
            self.resume(None)
        text = json.dumps(params, indent=2, sort_keys=True, default=str)
        self._writer.add_text("config", f"```\n{text}\n```", global_step=0)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError(
            f"distributed(loggers=('tensorboard',)) needs the tensorboard package ({error}). "
            "Install it with `pip install ddpctx[tensorboard]`, or drop 'tensorboard' from loggers."
        ) from error
    return SummaryWriter


def make_loggers(loggers: Sequence[object], log_dir: Path | None) -> list[Any]:
    """The loggers ``distributed(loggers=...)`` names, built; refused with the fix when unusable.

    >>> make_loggers(["parquet"], None)
    Traceback (most recent call last):
    ...
    ValueError: loggers=...: 'parquet' is not a logger. ...
    """
    if isinstance(loggers, (str, bytes)):
        raise ValueError(
            f"loggers={loggers!r} is one string; pass a tuple of names or objects, "
            f"e.g. loggers=({loggers!r},)."
        )
    made = []
    for logger in loggers:
        if isinstance(logger, str):
            if logger not in BUILT_IN:
                raise ValueError(
                    f"loggers={tuple(loggers)!r}: {logger!r} is not a logger. Use one of "
                    f"{', '.join(map(repr, BUILT_IN))}, or an object with "
                    "log_metrics(metrics, step) (the Logger protocol: "
                    "from ddpctx.watch import Logger)."
                )
            if log_dir is None:
                raise ValueError(
                    f"loggers=({logger!r},) writes files but no log_dir was given. "
                    f"Pass distributed(log_dir='runs/name', loggers=({logger!r},))."
                )
            made.append(_BUILT[logger](log_dir))
        elif callable(getattr(logger, "log_metrics", None)):
            made.append(logger)
        else:
            raise ValueError(
                f"loggers=...: {logger!r} (a {type(logger).__name__}) has no "
                "log_metrics(metrics, step) method. Give it one (the Logger protocol: "
                "from ddpctx.watch import Logger), "
                f"or use a built-in name: {', '.join(map(repr, BUILT_IN))}."
            )
    return made


_BUILT: dict[str, Any] = {"jsonl": JsonlLogger, "csv": CsvLogger, "tensorboard": TensorBoardLogger}
_BUILT.update(TRACKERS)  # mlflow, wandb: ddpctx.watch.trackers


def check_log_dir(log_dir: Path) -> str | None:
    """Why rank 0 cannot keep a trail in ``log_dir`` (None: it can); creates the folder.

    A probe file is written, fsynced and removed: a file where the folder
    should be, a folder without write permission, a read-only filesystem and
    a full disk all show here, each with the fix.

    >>> import tempfile, pathlib
    >>> check_log_dir(pathlib.Path(tempfile.mkdtemp()) / "runs" / "a") is None
    True
    """
    fix = "Pass a log_dir that rank 0 can write (it is created if missing)"
    blocker = next((p for p in (log_dir, *log_dir.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        return (
            f"distributed(log_dir={str(log_dir)!r}): {str(blocker)!r} is a file, not a folder, "
            f"so the metrics trail cannot be written there. {fix}, or move that file away."
        )
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        probe = temporary_name(log_dir / "probe")
        try:
            with open(probe, "wb") as file:
                file.write(b"ddpctx log_dir probe\n" * 64)
                file.flush()
                os.fsync(file.fileno())
        finally:
            probe.unlink(missing_ok=True)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            why = "has no room left (the disk or the quota is full)"
            hint = "Free space there, or pass another log_dir"
        elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            why = "is not writable (no permission, or a read-only filesystem)"
            hint = f"Give the job write access to it, or {fix[0].lower()}{fix[1:]}"
        else:
            why = "cannot be written"
            hint = fix
        return f"distributed(log_dir={str(log_dir)!r}): the folder {why}: {error!r}. {hint}."
    return None
