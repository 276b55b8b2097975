"""The hang report: each rank's state and stack, exchanged over the job's store, and the diagnosis.

Side channel: the store the process group was formed on -- torchrun's
``TCPStore`` (a client connection that already exists), the loopback
``TCPStore`` of ``launch()`` and the pytest plugin, the ``HashStore`` of a
single process. No new listening port, and never the process group itself,
which is what is stuck. Keys live under ``ddpctx/hang/`` of that store:

- ``open``: the number of the newest incident. A rank whose wait passed
  ``hang_timeout`` opens the next one with an atomic compare-and-set, so ranks
  that notice together open it once.
- ``<n>/opened``: the wall-clock time incident ``n`` opened (the first rank to
  note it wins); a silent rank's silence is counted to it, as the waits are.
- ``<n>/rank<r>``: rank ``r``'s :class:`RankState` for incident ``n``, written
  by its watchdog thread (which runs while the main thread is blocked).
- ``<n>/reporter``: a counter; the rank that bumps it first writes the report
  (rank 0 at once; another rank when rank 0 has not after a few seconds).
- ``<n>/report``: the report, for ranks that must raise it.
- ``alive/rank<r>``: the wall-clock time rank ``r``'s watchdog last ran, so a
  rank that does not answer is named with how long it has been silent.

Formatting and diagnosis are pure functions of the states.

Example:
    >>> waiting = RankState(0, "barrier()", 61.0, "train.py:57 in main", "")
    >>> stuck = RankState(1, None, 0.0, "data.py:40 in __iter__", "")
    >>> print(diagnose([waiting, stuck], 2).split(":")[1])
     rank 1 is not in any collective while 1 rank waits for it (rank 0 in barrier())
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

from ddpctx.hang.inflight import is_library_file, short_path, user_site
from ddpctx.hang.peers import ranks_text

PREFIX = "ddpctx/hang/"


@dataclass(frozen=True)
class RankState:
    """One rank at the moment it answered: what it waits in (None: nothing), where, its stack."""

    rank: int
    op: str | None
    waited: float
    site: str
    stack: str
    peers: list[int] | None = None  # the ranks ``op`` waits with (None: every rank)
    stalled: float = 0.0  # seconds it could not run just before it answered (0: it could)

    def awaits(self, world_size: int) -> set[int]:
        """The other ranks this rank's wait depends on (none when it waits in nothing)."""
        if self.op is None:
            return set()
        ranks = range(world_size) if self.peers is None else self.peers
        return set(ranks) - {self.rank}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> RankState:
        return cls(**json.loads(text))


def main_thread_frame(thread: int | None = None) -> FrameType | None:
    """The current frame of thread ``thread`` (default: the main thread), read from another."""
    import threading

    ident = threading.main_thread().ident if thread is None else thread
    return sys._current_frames().get(ident or -1)


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


def snapshot(
    rank: int,
    op: str | None,
    waited: float,
    peers: tuple[int, ...] | None = None,
    stalled: float = 0.0,
    thread: int | None = None,
) -> RankState:
    """This rank's state (``thread``'s stack; default the main thread's), from the watchdog."""
    frame = main_thread_frame(thread)
    members = None if peers is None or op is None else list(peers)
    site, stack = user_site(frame), folded_stack(frame)
    return RankState(rank, op, round(waited, 1), site, stack, members, round(stalled, 1))


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
        # when it opened (the first rank to note it wins): the report's moment
        self.store.compare_set(f"{PREFIX}{seen + 1}/opened", "", repr(time.time()))
        return self.newest()

    def opened(self, incident: int) -> float | None:
        """The wall-clock time incident ``incident`` was opened (None: not noted)."""
        key = f"{PREFIX}{incident}/opened"
        return float(self.store.get(key)) if self.store.check([key]) else None

    def beat(self) -> None:
        """Note that this rank's watchdog ran now (the report says how long a silent rank was)."""
        self.store.set(f"{PREFIX}alive/rank{self.rank}", repr(time.time()))

    def silence(self, ranks: list[int], at: float | None = None) -> dict[int, float]:
        """Seconds each of ``ranks`` had not beat at time ``at`` (default: now).

        Ranks that never beat are left out.
        """
        moment = time.time() if at is None else at
        ages = {}
        for rank in ranks:
            key = f"{PREFIX}alive/rank{rank}"
            if self.store.check([key]):
                value = self.store.get(key)
                ages[rank] = max(0.0, moment - float(value))
        return ages

    def claim(self, incident: int) -> bool:
        """True for the one rank that writes incident ``incident``'s report (the first to ask)."""
        return int(self.store.add(f"{PREFIX}{incident}/reporter", 1)) == 1

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


def diagnose(states: list[RankState], world_size: int | None = None) -> str:
    """The ``diagnosis:`` line for the ranks that answered, in a job of ``world_size``.

    A rank outside collectives counts as stuck only when a waiting rank waits
    for it: it is in that rank's subgroup, or its point-to-point peer.
    """
    size = world_size if world_size is not None else max(s.rank for s in states) + 1
    waiting = [s for s in states if s.op is not None]
    outside = {s.rank for s in states if s.op is None}
    stuck = sorted(outside & set().union(*(s.awaits(size) for s in waiting)))
    if stuck:
        who = ranks_text(stuck)
        verb = "is" if len(stuck) == 1 else "are"
        count = f"{len(waiting)} rank{'s' if len(waiting) > 1 else ''}"
        blocked = [s for s in waiting if s.awaits(size) & set(stuck)]
        details = "; ".join(f"rank {s.rank} in {s.op}" for s in blocked)
        return (
            f"diagnosis: {who} {verb} not in any collective while {count} "
            f"wait{'s' if len(waiting) == 1 else ''} for {'it' if len(stuck) == 1 else 'them'} "
            f"({details}): it is stuck, or it took a branch the others did not."
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


def _silent_diagnosis(silent: list[int], answered: list[RankState], world_size: int) -> str:
    """Ranks wait for ``silent`` ranks, which did not answer."""
    one = len(silent) == 1
    return (
        f"diagnosis: {ranks_text(silent)} {'is' if one else 'are'} not answering while "
        f"{_waiting_for(silent, answered, world_size)}: it may hold the GIL in native "
        "code, be stopped (SIGSTOP, a debugger), or be gone."
    )


def _stalled_diagnosis(stalled: list[RankState], answered: list[RankState], size: int) -> str:
    """Ranks waited for ``stalled`` ranks, which answered only once they could run again."""
    ranks = [s.rank for s in stalled]
    longest = _seconds(max(s.stalled for s in stalled))
    return (
        f"diagnosis: {ranks_text(ranks)} could not run for {longest} s "
        f"while {_waiting_for(ranks, answered, size)}: it held the GIL in native "
        "code, was stopped (SIGSTOP, a debugger) or got no CPU, and answered once it ran again."
    )


def _waiting_for(ranks: list[int], answered: list[RankState], world_size: int) -> str:
    """``"2 ranks wait for it (rank 0 in barrier(); rank 2 in barrier())"``."""
    blocked = [s for s in answered if s.awaits(world_size) & set(ranks)]
    details = "; ".join(f"rank {s.rank} in {s.op}" for s in blocked)
    waiters = len(blocked)
    count = f"{waiters} rank{'s' if waiters > 1 else ''} wait{'s' if waiters == 1 else ''}"
    return f"{count} for {'it' if len(ranks) == 1 else 'them'} ({details})"


def _bare_op(op: str | None) -> str:
    return (op or "").removesuffix("()").split(" (", 1)[0]


def _file_line(site: str) -> str:
    return site.split(" in ", 1)[0]


def format_report(
    states: list[RankState | None],
    hang_timeout: float,
    now_waited: float | None = None,
    silent_for: dict[int, float] | None = None,
) -> str:
    """The whole report: headline, one line per rank, the diagnosis, then every stack.

    ``silent_for``: seconds since a rank that did not answer last showed life.
    """
    answered = [s for s in states if s is not None]
    silent = [rank for rank, s in enumerate(states) if s is None]
    silent_for = silent_for or {}
    longest = max([s.waited for s in answered if s.op is not None] + [now_waited or 0.0])
    lines = [
        f"ddpctx hang report: no collective has completed for {longest:.0f} s "
        f"(hang_timeout={hang_timeout:g})"
    ]
    awaited = set().union(*(s.awaits(len(states)) for s in answered))
    for rank, state in enumerate(states):
        if state is None:
            since = f" for {silent_for[rank]:.0f} s" if rank in silent_for else ""
            lines.append(
                f"  rank {rank}: not answering{since} (it may hold the GIL in native code, be "
                "stopped by SIGSTOP or a debugger, or be gone)"
            )
            continue
        what = f"waiting in {state.op}" if state.op else "not in a collective"
        tail = (
            f"({state.waited:.0f} s)" if state.op else ("<- stuck here" if rank in awaited else "")
        )
        if state.stalled:  # it has just come back: where it is now is not where it was
            tail = f"({state.waited:.0f} s) " if state.op else ""
            tail += f"after {_seconds(state.stalled)} s in which it could not run"
        lines.append(f"  rank {rank}: {what:<30} at {state.site:<30} {tail}".rstrip())
    diagnosis = diagnose(answered, len(states)) if answered else "diagnosis: no rank answered."
    silent_awaited = [rank for rank in silent if rank in awaited]
    # Ranks the others waited for that could not run until just before they answered:
    # the stall held the others. Where such a rank is now (just back: outside any
    # collective, or in the next one) says nothing of why the others waited.
    stalled = [s for s in answered if s.stalled and s.rank in awaited]
    if silent_awaited and " is not in any collective" not in diagnosis:
        diagnosis = _silent_diagnosis(silent_awaited, answered, len(states))
    elif stalled:
        diagnosis = _stalled_diagnosis(stalled, answered, len(states))
        if silent:
            diagnosis += f" ({ranks_text(silent)} did not answer.)"
    elif silent:
        diagnosis += f" ({ranks_text(silent)} did not answer.)"
    lines.append(diagnosis)
    lines.append("full stacks follow (main thread, outermost call first):")
    for state in answered:
        lines.append(f"--- rank {state.rank} ---")
        lines.append(state.stack)
    return "\n".join(lines)


def _seconds(stalled: float) -> int:
    """A stall in whole seconds, rounded down: it lasted at most a tick less than measured."""
    return int(stalled)
