"""What a failed sharded write becomes: an ``OSError`` naming the path, not a ``BaseException``.

``torch.distributed.checkpoint`` reports a failed write on every rank as a
``CheckpointException``, a ``BaseException``: ``except OSError`` and
``except Exception`` miss it, and a full disk reads as ``[enforce fail at
inline_container.cc] ... No space left on device``. :func:`as_os_error` turns
it into what a single-file checkpoint raises:

- a full disk or quota (on any rank) -> ``OSError(ENOSPC)`` ("no space
  left on device", or ``EDQUOT``: "disk quota exceeded") naming the
  checkpoint's final and temporary paths, the ranks that ran out of space
  (any other rank's failure named apart), and that nothing was published;
- any other failure -> an ``OSError`` (when a rank's failure was one, with
  its errno) or a ``RuntimeError``, with the same names and the ranks' own
  messages; the original is chained.

Anything but DCP's ``CheckpointException`` (``KeyboardInterrupt``, a plain
error) is not this module's to convert.

A write that rank 0 makes alone (a DDP checkpoint, ``ctx.save``) goes through
:func:`written_by_rank_zero`: an ``OSError`` there is raised on **every** rank
as the same ``OSError`` (its type, errno, file name and message), so the
documented ``except OSError:`` fallback runs on every rank alike, as it does
for a sharded write; the other ranks' copy says it was raised on rank 0.
Any other failure reaches the others as :class:`~ddpctx.RankZeroError`.

Example:
    >>> error = as_os_error(OSError(28, "No space left on device"), Path("/d/c.dcp"), Path("/d/t"))
    >>> error.errno, "no space left on device while saving '/d/c.dcp'" in str(error)
    (28, True)
"""

from __future__ import annotations

import errno
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ddpctx.rankzero.outcome import on_rank_zero
from ddpctx.utils.identity import Place

T = TypeVar("T")

_FULL = {
    errno.ENOSPC: "No space left on device",
    errno.EDQUOT: "Disk quota exceeded",
}


def _failures(error: BaseException) -> dict[int, BaseException]:
    """Each failed rank's exception (a plain error: rank -1, this rank)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):
        return {
            int(rank): pair[0] if isinstance(pair, tuple) else pair
            for rank, pair in failures.items()
        }
    return {-1: error}


def _full_code(error: BaseException) -> int | None:
    """ENOSPC/EDQUOT if ``error`` (or its message, as torch's C++ writer words it) says so."""
    code = getattr(error, "errno", None)
    if code in _FULL:
        return int(code)
    text = str(error)
    for code, words in _FULL.items():
        if words in text:
            return code
    return None


def _ranks(failed: dict[int, int]) -> str:
    return ", ".join("this rank" if rank < 0 else str(rank) for rank in sorted(failed))


def is_write_failure(error: BaseException) -> bool:
    """Whether ``error`` is DCP's report of a failed write (a ``CheckpointException``)."""
    return type(error).__name__ == "CheckpointException"


def as_os_error(error: BaseException, final: Path, temporary: Path) -> Exception:
    """What a failed sharded write of ``final`` (written in ``temporary``) becomes."""
    failures = _failures(error)
    full = {rank: code for rank, exc in failures.items() if (code := _full_code(exc)) is not None}
    if full:
        code = full[min(full)]
        others = "".join(
            f"; rank {'?' if rank < 0 else rank} failed otherwise: {type(exc).__name__}: "
            f"{str(exc)[:300]}"
            for rank, exc in sorted(failures.items())
            if rank not in full
        )
        what, fix = (
            ("disk quota exceeded", "Free space within your quota (or have it raised)")
            if code == errno.EDQUOT
            else ("no space left on device", "Free space on that filesystem")
        )
        return OSError(
            code,
            f"{what} while saving {str(final)!r} (rank(s) {_ranks(full)} could not write into "
            f"{str(temporary)!r}: {_FULL[code]}{others}). Nothing was published: the previous "
            f"checkpoints are intact. {fix} or save elsewhere, then save again.",
        )
    summary = "; ".join(
        f"rank {'?' if rank < 0 else rank}: {type(exc).__name__}: {str(exc)[:300]}"
        for rank, exc in sorted(failures.items())
    )
    message = (
        f"the sharded checkpoint {str(final)!r} could not be written (into {str(temporary)!r}; "
        f"{summary}). Nothing was published: the previous checkpoints are intact. Fix the cause "
        "named above (a writable, shared directory with room for every rank's shards), then "
        "save again."
    )
    os_errors = [exc for exc in failures.values() if isinstance(exc, OSError)]
    if os_errors and isinstance(os_errors[0].errno, int):
        return OSError(os_errors[0].errno, message)
    return RuntimeError(message)


def _portable(error: OSError) -> OSError:
    """``error`` as the other ranks will raise it: a copy that unpickles to the same thing."""
    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error) and (copy.errno, str(copy)) == (error.errno, str(error)):
            return copy
    except Exception:
        pass  # an OSError subclass that does not pickle: the builtin type it maps to
    rebuilt = OSError(*error.args)
    rebuilt.filename, rebuilt.filename2 = error.filename, error.filename2
    return rebuilt


def written_by_rank_zero(place: Place, work: Callable[[], T]) -> T:
    """Run ``work`` on rank 0 while the others wait; every rank gets its value.

    An ``OSError`` raised by ``work`` is raised on every rank: rank 0 raises its
    own, the others a copy (same type, errno, file name and message) noting it
    was raised on rank 0. Any other error is rank 0's own there and a
    :class:`~ddpctx.RankZeroError` on the others.
    """
    failed: list[OSError] = []

    def guarded() -> tuple[bool, Any]:
        try:
            return True, work()
        except OSError as error:
            failed.append(error)
            return False, _portable(error)

    _, (ok, value) = on_rank_zero(place, guarded, broadcast=True)
    if failed:
        raise failed[0]  # rank 0 (or a rank running alone): its own, with its traceback
    if not ok:
        value.add_note(
            f"(raised on rank 0, which writes this file; rank {place.rank} raises the same "
            "OSError so that every rank's `except OSError:` runs alike)"
        )
        raise value
    return value  # type: ignore[no-any-return]
