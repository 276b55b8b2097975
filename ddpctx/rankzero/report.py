"""Output that belongs to the whole job, not to each rank: progress bars and logging.

- :func:`progress`: a tqdm bar on rank 0 when tqdm is installed; the plain
  iterable everywhere else (other ranks, or no tqdm).
- :func:`get_logger`: a logger whose records appear once for the job: rank 0
  emits everything, the other ranks only warnings and errors, prefixed with
  their rank so a problem on one rank is never hidden.

Example:
    >>> list(progress(range(3), disable=True))
    [0, 1, 2]
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from ddpctx.utils.identity import whoami

T = TypeVar("T")


def _rank() -> int:
    return whoami().rank


def progress(iterable: Iterable[T], **tqdm_kwargs: Any) -> Iterable[T]:
    """``iterable`` with a progress bar on rank 0 (tqdm), unchanged elsewhere.

    >>> total = sum(progress(range(4), disable=True))
    """
    return bar_on_main(iterable, _rank() == 0, tqdm_kwargs)


def bar_on_main(iterable: Iterable[T], is_main: bool, tqdm_kwargs: dict[str, Any]) -> Iterable[T]:
    """A tqdm bar around ``iterable`` when ``is_main`` and tqdm is installed."""
    if not is_main:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    bar: Iterable[T] = tqdm(iterable, **tqdm_kwargs)
    return bar


class RankFilter(logging.Filter):
    """Lets everything through on rank 0, warnings and errors (prefixed) on the others."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _rank()
        if rank == 0:
            return True
        if record.levelno < logging.WARNING:
            return False
        record.msg = f"[rank {rank}] {record.msg}"
        return True


def get_logger(name: str, level: int = logging.INFO) -> logging.Logger:
    """A logger that speaks once for the job (see the module docstring).

    It gets a stderr handler of its own the first time (and does not
    propagate, so records are not printed twice by a root handler).

    >>> log = get_logger("ddpctx.doc")
    >>> log.info("epoch 1 done")  # printed by rank 0 only
    """
    logger = logging.getLogger(name)
    if not any(isinstance(f, RankFilter) for f in logger.filters):
        logger.addFilter(RankFilter())
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(
                logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
            )
            logger.addHandler(handler)
            logger.propagate = False
        logger.setLevel(level)
    return logger
