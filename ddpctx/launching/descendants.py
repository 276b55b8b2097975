"""Processes a rank started, found through ``/proc``: also those in a session of their own.

A rank's subprocesses share its process group, so one ``killpg`` ends them;
one started with ``start_new_session=True`` (or ``setsid``) does not, and
would outlive the rank. While the rank lives, such a process is still its
descendant: :func:`descendants` lists them (with their start times, so that
a pid reused later is never killed). Without ``/proc`` (not Linux) the list
is empty.

Example:
    >>> descendants([])  # no roots, no descendants
    []
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, from /proc); None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(roots: list[int]) -> list[tuple[int, str]]:
    """Every live descendant of ``roots`` with its start time; [] without /proc (not Linux)."""
    parents: dict[int, tuple[int, str]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = (int(fields[1]), fields[19])
            except (OSError, IndexError, ValueError):
                continue  # gone while read
    found: list[tuple[int, str]] = []
    frontier = set(roots)
    while frontier:
        children = [(pid, start) for pid, (ppid, start) in parents.items() if ppid in frontier]
        found += children
        frontier = {pid for pid, _ in children}
    return found
