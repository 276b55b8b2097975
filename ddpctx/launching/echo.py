"""Streaming the ranks' output as it comes, every line prefixed ``[rank N]`` (``pytest -s``).

Each rank of a :class:`~ddpctx.launching.pool.RankPool` writes its stdout and
stderr to files of the pool's folder; :class:`Echo` reads them from where the
current task's output starts and prints whole lines here, so a quick rank's
first lines are never missed and no line is cut in two.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

#: Seconds between two looks at the ranks' output files when it is streamed.
ECHO_INTERVAL_S = 0.1


class Echo:
    """Streams the ranks' output files to this process's stdout/stderr, line by line."""

    def __init__(self, directory: Path, starts: list[tuple[int, int]]) -> None:
        """``starts``: per rank, where its task's output begins in ``(out, err)``."""
        self._files = [
            (rank, directory / f"rank{rank}.{name}", stream)
            for rank in range(len(starts))
            for name, stream in (("out", "stdout"), ("err", "stderr"))
        ]
        self._offsets = {
            directory / f"rank{rank}.{name}": start
            for rank, pair in enumerate(starts)
            for name, start in zip(("out", "err"), pair, strict=True)
        }

    def pump(self, final: bool = False) -> None:
        for rank, path, stream in self._files:
            with contextlib.suppress(OSError):
                with open(path, "rb") as handle:
                    handle.seek(self._offsets[path])
                    data = handle.read()
                if not final:
                    data = data[: data.rfind(b"\n") + 1]  # whole lines only, until the end
                self._offsets[path] += len(data)
                target = getattr(sys, stream)
                for line in data.decode(errors="replace").splitlines():
                    print(f"[rank {rank}] {line}", file=target, flush=True)
