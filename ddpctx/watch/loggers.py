"""Where ``ctx.log`` writes: JSON lines, CSV, TensorBoard, or an object of the user's.

A logger is anything with ``log_metrics(metrics, step)``; these methods are
used when it has them (:class:`Logger` spells the protocol out):

- ``log_hparams(params)``: the run's configuration, once per run (a resumed
  run does not record it again).
- ``resume(step)``: called before anything else is written. ``step`` is the
  last step the loaded checkpoint had logged: points after it came from the
  attempt that was killed and must go; ``None`` means a fresh run (nothing
  of an earlier run in this directory is kept).
- ``flush()``: everything written so far is durable (called at every
  checkpoint, so what a checkpoint covers is never lost).
- ``close()``: at the end of the ``distributed()`` block.

Only rank 0 calls loggers, and only from ddpctx's writer thread
(:mod:`ddpctx.watch.trail`), one call at a time: a logger needs no locks.
``metrics`` is a flat ``{name: float}``; nested dicts given to ``ctx.log``
arrive as ``"outer/inner"`` names.

The built-in files are rewritten atomically on ``resume`` (a line torn by
a kill is dropped with the points after the checkpoint). TensorBoard's own
mechanism is used for its event files: a writer opened with
``purge_step=step + 1`` makes readers discard the killed attempt's points.

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

import csv
import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ddpctx.utils.atomic import fsync_directory, temporary_name
from ddpctx.watch.trackers import TRACKERS

#: The names ``distributed(loggers=...)`` accepts for the built-in loggers.
BUILT_IN = ("jsonl", "csv", "tensorboard", *TRACKERS)


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


class _AppendedFile:
    """A logger writing one file it appends to: flushed to disk on checkpoint, closed at the end."""

    _file: io.TextIOWrapper | None = None

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None


class JsonlLogger(_AppendedFile):
    """``log_dir/metrics.jsonl``: one JSON object per ``ctx.log`` call, ``"step"`` first.

    Example:
        >>> import tempfile, pathlib
        >>> JsonlLogger(pathlib.Path(tempfile.mkdtemp())).path.name
        'metrics.jsonl'
    """

    def __init__(self, log_dir: Path) -> None:
        self.path = log_dir / "metrics.jsonl"
        self._file: io.TextIOWrapper | None = None

    def resume(self, step: int | None) -> None:
        kept = [] if step is None else _kept_lines(self.path, step)
        atomic_write_bytes(self.path, "".join(line + "\n" for line in kept).encode())
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 -- closed in close()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._file is None:
            self.resume(None)
        assert self._file is not None
        self._file.write(json.dumps({"step": step, **metrics}, allow_nan=True) + "\n")

    def log_hparams(self, params: dict[str, Any]) -> None:
        text = json.dumps(params, indent=2, sort_keys=True, default=str)
        atomic_write_bytes(self.path.with_name("config.json"), (text + "\n").encode())


class CsvLogger(_AppendedFile):
    """``log_dir/metrics.csv``: a ``step`` column, then one column per metric name.

    A name that first appears later rewrites the file with the wider header
    (rare: the columns are usually fixed after the first call).

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
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = ["step"]
        self._file: io.TextIOWrapper | None = None

    def resume(self, step: int | None) -> None:
        rows = [] if step is None else _kept_rows(self.path, step)
        self._rows = rows
        self._columns = ["step"]
        for row in rows:
            self._columns += [name for name in row if name not in self._columns]
        self._rewrite()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._file is None:
            self.resume(None)
        row = {"step": step, **metrics}
        self._rows.append(row)
        if any(name not in self._columns for name in row):
            self._columns += [name for name in row if name not in self._columns]
            self._rewrite()
            return
        assert self._file is not None
        csv.DictWriter(self._file, self._columns).writerow(row)

    def _rewrite(self) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, self._columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self._rows)
        if self._file is not None:
            self._file.close()
        atomic_write_bytes(self.path, text.getvalue().encode())
        self._file = open(self.path, "a", encoding="utf-8", newline="")  # noqa: SIM115


class TensorBoardLogger:
    """Event files under ``log_dir`` (``pip install ddpctx[tensorboard]``).

    A resume opens the writer with ``purge_step=step + 1``: TensorBoard then
    drops the killed attempt's points at those steps and later ones. The
    hparams go in as a text summary (``config``) at step 0.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._writer: Any = None
        _summary_writer()  # refuse at once, naming the extra, when tensorboard is missing

    def resume(self, step: int | None) -> None:
        if self._writer is not None:
            self._writer.close()
        # A fresh run purges every earlier point in the directory: purge_step=0.
        self._writer = _summary_writer()(
            str(self.log_dir), purge_step=0 if step is None else step + 1
        )

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._writer is None:
            self.resume(None)
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


def flat_metrics(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """``{"a": {"b": x}}`` -> ``{"a/b": float(x)}``; a value that is not one number is refused.

    >>> flat_metrics({"loss": 0.25, "val": {"acc": 1}})
    {'loss': 0.25, 'val/acc': 1.0}
    """
    flat: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flat_metrics(value, name + "/"))
            continue
        try:
            flat[name] = float(value)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(
                f"ctx.log: {name!r} is {type(value).__name__} {_short(value)}, not one number "
                f"({error}). Log a scalar (e.g. tensor.mean()), or a dict of scalars."
            ) from None
    return flat


def check_scalars(values: Mapping[str, Any], prefix: str = "") -> None:
    """Refuse, on the calling rank and before any collective, a value that is not one number.

    Looks at shapes only (no device sync).

    >>> check_scalars({"loss": [0.1, 0.2]})
    Traceback (most recent call last):
    ...
    ValueError: ctx.log: 'loss' is list [0.1, 0.2], not one number. Log a scalar ...
    """
    if not isinstance(values, Mapping):
        raise ValueError(
            f"ctx.log got {type(values).__name__} {_short(values)}; it takes a dict of "
            "metrics, e.g. ctx.log({'loss': loss})."
        )
    if not prefix and "step" in values:
        raise ValueError(
            "ctx.log got a metric named 'step', which is the trail's own column. Pass the step "
            "as ctx.log(metrics, step=...), or name the metric otherwise (e.g. 'global_step')."
        )
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            check_scalars(value, name + "/")
        elif isinstance(value, (bool, int, float)) or (
            hasattr(value, "shape") and math.prod(getattr(value, "shape", ())) == 1
        ):
            continue
        else:
            raise ValueError(
                f"ctx.log: {name!r} is {type(value).__name__} {_short(value)}, not one number. "
                "Log a scalar (e.g. tensor.mean()), or a dict of scalars."
            )


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` at once: a temporary file, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(path)
    with open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    fsync_directory(path.parent)


def _short(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"of shape {tuple(shape)}" if shape is not None else repr(value)[:60]


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
                rows.append(
                    {"step": row_step, **{k: _number(v) for k, v in row.items() if k != "step"}}
                )
    return rows


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text if text else math.nan
