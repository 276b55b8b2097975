"""Which ranks have left ``distributed()``: a lost peer explained under every launcher.

A collective whose peer has gone fails with the transport's words only --
gloo's ``Connection closed by peer ... typically caused by a remote worker
crashing`` -- though nothing crashed: the peer finished its block. So every
rank that leaves its block normally records that in the job's store (the
group's own, under the formation's key prefix), with how many collectives it
had entered, just before its group is destroyed. A rank whose block then ends
with such an error reads those records and says what happened:

- the ranks that left had entered fewer collectives than this rank: they
  finished while it waited -- a collective issued on some ranks only;
- they had entered as many or more: they took part in this collective and
  finished, yet this rank's call failed -- the ranks' calls did not match
  (different operations, or tensors of different shapes or dtypes, on which
  gloo returns garbage on one rank and drops the connection on the other).

The explanation is added to the exception as a note (``BaseException.add_note``),
written to torchrun's error file with it, and read back by ``launch()`` and
the pytest plugin (:data:`NOTE_PREFIX`). Counts come from the hang doctor's
tracker; with the doctor off, the note says both possible causes.

Reading is best effort and bounded: a store that is gone (a rank 0 that
served it and exited) gives no note, never a second error.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

#: Every note this module adds opens with this.
NOTE_PREFIX = "ddpctx: "
#: How long a failing rank waits for the store, at most, per read.
READ_TIMEOUT = timedelta(seconds=5)

_KEY = "ddpctx/left/{rank}"


def record_departure(store: Any, rank: int, entered: int | None) -> None:
    """Note in ``store`` that ``rank`` left its block normally, after ``entered`` collectives."""
    with contextlib.suppress(Exception):  # a store that is gone: nobody is left to read it
        store.set(_KEY.format(rank=rank), str(-1 if entered is None else entered))


def departed(store: Any, rank: int, world_size: int) -> dict[int, int | None]:
    """The other ranks that left their block normally: rank -> collectives entered (or None)."""
    found: dict[int, int | None] = {}
    previous = None
    with contextlib.suppress(Exception):
        previous = store.timeout
        store.set_timeout(READ_TIMEOUT)
    try:
        for other in range(world_size):
            key = _KEY.format(rank=other)
            if other == rank or not store.check([key]):
                continue
            count = int(bytes(store.get(key)).decode())
            found[other] = None if count < 0 else count
    except Exception:
        return found
    finally:
        with contextlib.suppress(Exception):
            if previous is not None:
                store.set_timeout(previous)
    return found


def departure_note(rank: int, entered: int | None, left: dict[int, int | None]) -> str:
    """What ``left`` (from :func:`departed`) says about this rank's lost peer; "" if nothing.

    >>> print(departure_note(0, 3, {1: 2}))  # doctest: +NORMALIZE_WHITESPACE
    ddpctx: rank 1 had already left distributed() (finished its block) after 2 collective(s),
    while rank 0 waited in its collective #3: a collective was issued on some ranks only.
    Every rank must issue the same collectives in the same order; decide data-dependent
    branches together with ctx.any(flag) / ctx.all(flag).
    """
    if not left:
        return ""
    ranks = sorted(left)
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    counts = [left[r] for r in ranks]
    same_order = (
        "Every rank must issue the same collectives in the same order; decide data-dependent "
        "branches together with ctx.any(flag) / ctx.all(flag)."
    )
    matching = (
        "Pass every rank tensors of the same shape and dtype, to the same operation, in the "
        "same order (ctx.all_reduce and @all_reduced check this and name the difference)."
    )
    if entered is None or any(count is None for count in counts):
        return (
            f"{NOTE_PREFIX}{who} had already left distributed() (finished its block) while "
            f"rank {rank} waited in a collective: a collective was issued on some ranks only, "
            "or the ranks' collectives did not match (different operations, or tensors of "
            f"different shapes or dtypes). {same_order}"
        )
    if all(count is not None and count < entered for count in counts):
        after = ", ".join(str(count) for count in counts)
        return (
            f"{NOTE_PREFIX}{who} had already left distributed() (finished its block) after "
            f"{after} collective(s), while rank {rank} waited in its collective #{entered}: a "
            f"collective was issued on some ranks only. {same_order}"
        )
    took_part = [r for r in ranks if (left[r] or 0) >= entered]
    also = f"rank{'s' if len(took_part) > 1 else ''} {', '.join(map(str, took_part))}"
    return (
        f"{NOTE_PREFIX}{also} entered collective #{entered} too and then left distributed() "
        f"(finished its block), yet rank {rank}'s collective #{entered} lost its peer: the "
        "ranks' calls did not match -- different operations, or tensors of different shapes "
        "or dtypes (gloo then returns garbage on one rank and drops the connection on the "
        f"other). {matching}"
    )


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``, also before Python 3.11 (the list travels when pickled)."""
    notes = list(getattr(error, "__notes__", []))
    if note not in notes:
        setattr(error, "__notes__", [*notes, note])  # noqa: B010 -- not declared before 3.11


def note_of(error: BaseException | None) -> str:
    """The note :func:`add_note` put on ``error`` from this module, or ""."""
    notes = getattr(error, "__notes__", None) or []
    return next((n for n in notes if isinstance(n, str) and n.startswith(NOTE_PREFIX)), "")
