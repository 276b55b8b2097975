"""The page ``run.py`` says as it goes, and ``BENCHMARKS.md`` made from it with ``--write``.

Contract: a section is a function that takes a :data:`Say` and says its
markdown line by line; :class:`Report` prints each line at once (flushed, so a
long run shows its progress) and keeps it. :func:`write_page` puts the kept
lines into ``benchmarks/BENCHMARKS.template.md`` (its ``{{RESULTS}}``), with
what ``benchmarks/accuracy.py`` prints as its ``{{ACCURACY}}``, and writes
the result to ``BENCHMARKS.md`` (``run.py`` writes the plot beside it).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Callable

from benchmarks.processes import HERE, REPO

#: How a section says a line of its markdown.
Say = Callable[[str], None]


class Report:
    """The run's markdown: each line printed as it is said, and kept for the page."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def machine(quick: bool, rounds: int) -> str:
    """The page's first section: this machine, the versions and the kind of run."""
    import torch

    return (
        f"## Machine\n\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, torch {torch.__version__}, gloo on CPU; "
        f"{'quick' if quick else 'full'} run, {rounds} rounds.\n"
    )


def write_page(lines: list[str]) -> None:
    """``BENCHMARKS.md`` from the template, ``lines`` and a new run of ``accuracy.py``.

    Run after :func:`benchmarks.reduction.plot` has written the page's plot.
    """
    accuracy = subprocess.run(
        [sys.executable, str(HERE / "accuracy.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    ).stdout.strip()
    template = (HERE / "BENCHMARKS.template.md").read_text()
    page = template.replace("{{RESULTS}}", "\n".join(lines))
    (REPO / "BENCHMARKS.md").write_text(page.replace("{{ACCURACY}}", accuracy))
    print("wrote BENCHMARKS.md and benchmarks/reduction.png")
