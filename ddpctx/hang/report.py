"""The hang report: each rank's state and stack, exchanged over the job's store, and the diagnosis.

Side channel: the store the process group was formed on -- torchrun's
``TCPStore`` (a client connection that already exists), the ``FileStore`` of
``launch()`` and the pytest plugin, the ``HashStore`` of a single process.
No new listening port, and never the process group itself, which is what is
stuck. Keys live under ``ddpctx/hang/`` of that store:

- ``open``: the number of the newest incident. A rank whose wait passed
  ``hang_timeout`` opens the next one with an atomic compare-and-set, so ranks
  that notice together open it once.
- ``<n>/rank<r>``: rank ``r``'s :class:`RankState` for incident ``n``, written
  by its watchdog thread (which runs while the main thread is blocked).
- ``<n>/report``: the report rank 0 assembled, for ranks that must raise it.

Formatting and diagnosis are pure functions of the states.

Example:
    >>> waiting = RankState(0, "barrier()", 61.0, "train.py:57 in main", "")
    >>> stuck = RankState(1, None, 0.0, "data.py:40 in __iter__", "")
    >>> print(diagnose([waiting, stuck], [0, 1]).split(":")[1])
     rank 1 is not in any collective while 1 rank waits
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

from ddpctx.hang.inflight import is_library_file, ranks_text, short_path, user_site

PREFIX = "ddpctx/hang/"


@dataclass(frozen=True)
class RankState:
    """One rank at the moment it answered: what it waits in (None: nothing), where, its stack."""

    rank: int
    op: str | None
    waited: float
    site: str
    stack: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> RankState:
        return cls(**json.loads(text))


def main_thread_frame() -> FrameType | None:
    """The main thread's current frame, read from another thread."""
    import threading

    return sys._current_frames().get(threading.main_thread().ident or -1)


def folded_stack(frame: FrameType | None) -> str:
    """The stack, outermost call first, with runs of ddpctx/torch/Python frames folded."""
    if frame is None:
        return "  (no Python stack: the main thread has ended)"
    entries = traceback.extract_stack(frame)
    lines: list[str] = []
    folded = 0
    for entry in entries:
        if is_library_file(entry.filename):
            folded += 1
            last = f"{entry.name} ({short_path(entry.filename)}:{entry.lineno})"
            continue
        if folded:
            lines.append(_fold_line(folded, last))
            folded = 0
        lines.append(f'  File "{short_path(entry.filename)}", line {entry.lineno}, in {entry.name}')
        if entry.line:
            lines.append(f"    {entry.line}")
    if folded:
        lines.append(_fold_line(folded, last))
    return "\n".join(lines)


def _fold_line(count: int, last: str) -> str:
    frames = "frame" if count == 1 else "frames"
    return f"    [{count} library {frames} folded, innermost: {last}]"


def snapshot(rank: int, op: str | None, waited: float) -> RankState:
    """This rank's state, taken from the watchdog thread."""
    frame = main_thread_frame()
    return RankState(rank, op, round(waited, 1), user_site(frame), folded_stack(frame))


class Exchange:
    """The store keys of the hang doctor for one process group (see the module docstring)."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size

    def newest(self) -> int:
        """The number of the newest incident (0: none yet)."""
        return int(self.store.add(PREFIX + "open", 0))

    def open_next(self, seen: int) -> int:
        """Open incident ``seen + 1``, unless another rank already did; returns the newest."""
        key = PREFIX + "open"
        self.store.compare_set(key, str(seen), str(seen + 1))
        return self.newest()

    def answer(self, incident: int, state: RankState) -> None:
        self.store.set(f"{PREFIX}{incident}/rank{state.rank}", state.to_json())

    def collect(self, incident: int, deadline: float) -> list[RankState | None]:
        """Every rank's answer (None for a rank that did not answer before ``deadline``)."""
        keys = [f"{PREFIX}{incident}/rank{rank}" for rank in range(self.world_size)]
        found: dict[int, RankState] = {}
        while True:
            for rank, key in enumerate(keys):
                if rank not in found and self.store.check([key]):
                    found[rank] = RankState.from_json(self.store.get(key))
            if len(found) == self.world_size or time.monotonic() >= deadline:
                return [found.get(rank) for rank in range(self.world_size)]
            time.sleep(0.05)

    def publish(self, incident: int, report: str) -> None:
        self.store.set(f"{PREFIX}{incident}/report", report)

    def published(self, incident: int) -> str | None:
        key = f"{PREFIX}{incident}/report"
        if not self.store.check([key]):
            return None
        value = self.store.get(key)
        return value.decode() if isinstance(value, bytes) else str(value)


def diagnose(states: list[RankState], answered: list[int]) -> str:
    """The ``diagnosis:`` line for the ranks that answered."""
    waiting = [s for s in states if s.op is not None]
    outside = [s for s in states if s.op is None]
    if waiting and outside:
        who = ranks_text([s.rank for s in outside])
        verb = "is" if len(outside) == 1 else "are"
        count = f"{len(waiting)} rank{'s' if len(waiting) > 1 else ''}"
        return (
            f"diagnosis: {who} {verb} not in any collective while {count} "
            f"wait{'s' if len(waiting) == 1 else ''}: it is stuck, or it took a branch "
            "the others did not."
        )
    places: dict[tuple[str, str], list[int]] = {}
    for state in waiting:
        places.setdefault((_bare_op(state.op), state.site), []).append(state.rank)
    if len(places) > 1:
        described = " vs ".join(
            f"{op} at {_file_line(site)} ({ranks_text(ranks)})"
            for (op, site), ranks in places.items()
        )
        return f"diagnosis: ranks are in different collectives: {described}."
    if waiting:
        (op, site), _ = next(iter(places.items()))
        return (
            f"diagnosis: every rank that answered waits in {op} (at {_file_line(site)}): the "
            "collective itself is not completing -- a peer that did not answer, the network, "
            "or GPU work queued before it."
        )
    return "diagnosis: no rank is in a collective any more; the wait ended by itself."


def _bare_op(op: str | None) -> str:
    return (op or "").removesuffix("()").split(" (", 1)[0]


def _file_line(site: str) -> str:
    return site.split(" in ", 1)[0]


def format_report(
    states: list[RankState | None], hang_timeout: float, now_waited: float | None = None
) -> str:
    """The whole report: headline, one line per rank, the diagnosis, then every stack."""
    answered = [s for s in states if s is not None]
    silent = [rank for rank, s in enumerate(states) if s is None]
    longest = max([s.waited for s in answered if s.op is not None] + [now_waited or 0.0])
    lines = [
        f"ddpctx hang report: no collective has completed for {longest:.0f} s "
        f"(hang_timeout={hang_timeout:g})"
    ]
    someone_waits = any(s.op is not None for s in answered)
    for rank, state in enumerate(states):
        if state is None:
            lines.append(
                f"  rank {rank}: did not answer (it holds the GIL in native code, or is gone)"
            )
            continue
        what = f"waiting in {state.op}" if state.op else "not in a collective"
        tail = f"({state.waited:.0f} s)" if state.op else ("<- stuck here" if someone_waits else "")
        lines.append(f"  rank {rank}: {what:<30} at {state.site:<30} {tail}".rstrip())
    diagnosis = diagnose(answered, [s.rank for s in answered])
    if silent:
        diagnosis += f" ({ranks_text(silent)} did not answer.)"
    lines.append(diagnosis)
    lines.append("full stacks follow (main thread, outermost call first):")
    for state in answered:
        lines.append(f"--- rank {state.rank} ---")
        lines.append(state.stack)
    return "\n".join(lines)
