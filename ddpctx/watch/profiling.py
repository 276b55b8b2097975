"""``ctx.profile``: ``torch.profiler`` traces of chosen steps on chosen ranks, one file per rank.

Two ways to ask:

- ``ctx.profile(steps=(10, 12))`` (or ``DDPCTX_PROFILE=10-12``, optionally
  ``10-12@0,2`` for ranks 0 and 2) arms a profiler that starts when step 10
  begins and stops after step 12, counting the steps of ``ctx.dataloader``'s
  iterators from 0 (:mod:`ddpctx.watch.clock`): no code in the loop.
- ``with ctx.profile():`` profiles the body of the ``with``.

Each profiled rank writes ``log_dir/profile/rank<r>.pt.trace.json`` (the
current directory's ``profile/`` without ``log_dir``): a Chrome trace that
Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open, and TensorBoard's
profiler plugin finds under ``log_dir``. Ranks not chosen do nothing.

Example:
    >>> spec = parse_profile_env("10-12@0,2")
    >>> spec
    ((10, 12), (0, 2))
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

#: The environment variable that arms a profile: ``FIRST-LAST`` steps, ``@RANKS`` optional.
ENV = "DDPCTX_PROFILE"


def parse_profile_env(value: str) -> tuple[tuple[int, int], tuple[int, ...] | None]:
    """``"10-12@0,2"`` -> ``((10, 12), (0, 2))``; a bad value names the variable and a good one.

    >>> parse_profile_env("5")
    ((5, 5), None)
    >>> parse_profile_env("x")
    Traceback (most recent call last):
    ...
    ValueError: DDPCTX_PROFILE='x': expected FIRST-LAST steps, optionally @RANKS, e.g. 10-12@0,1.
    """
    try:
        steps, _, ranks = value.strip().partition("@")
        first, _, last = steps.partition("-")
        span = (int(first), int(last or first))
        chosen = tuple(int(r) for r in ranks.split(",")) if ranks else None
    except ValueError:
        raise ValueError(
            f"{ENV}={value!r}: expected FIRST-LAST steps, optionally @RANKS, e.g. 10-12@0,1."
        ) from None
    if span[0] < 0 or span[1] < span[0]:
        raise ValueError(f"{ENV}={value!r}: steps {span} must satisfy 0 <= FIRST <= LAST.")
    return span, chosen


class Profiling:
    """One requested profile of this rank (see the module docstring).

    ``path`` is the trace file this rank writes (None on a rank not chosen);
    ``done`` turns True once it is written.
    """

    def __init__(
        self,
        rank: int,
        log_dir: Path | None,
        steps: tuple[int, int] | None,
        ranks: Sequence[int] | None,
        profiler_kwargs: dict[str, Any],
    ) -> None:
        if steps is not None:
            first, last = steps
            if not (isinstance(first, int) and isinstance(last, int) and 0 <= first <= last):
                raise ValueError(
                    f"ctx.profile(steps={steps!r}): a pair of step numbers (first, last) with "
                    "0 <= first <= last is needed, e.g. steps=(10, 12)."
                )
        chosen = ranks is None or rank in ranks
        folder = (log_dir if log_dir is not None else Path.cwd()) / "profile"
        self.path: Path | None = folder / f"rank{rank}.pt.trace.json" if chosen else None
        self.steps = steps
        self.done = False
        self._kwargs = profiler_kwargs
        self._profiler: Any = None

    def on_step(self, closed: int) -> None:
        """Called as step ``closed`` begins (``closed`` steps are over)."""
        if self.path is None or self.steps is None or self.done:
            return
        first, last = self.steps
        if closed == first and self._profiler is None:
            self.start()
        elif closed == last + 1 and self._profiler is not None:
            self.stop()

    def start(self) -> None:
        if self.path is None or self._profiler is not None:
            return
        import torch.profiler

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._kwargs.setdefault("activities", activities)
        self._profiler = torch.profiler.profile(**self._kwargs)
        self._profiler.start()

    def stop(self) -> None:
        """Stop and write the trace (a profile still running at the end of the block too)."""
        profiler, self._profiler = self._profiler, None
        if profiler is None or self.path is None:
            return
        profiler.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))
        self.done = True

    def __enter__(self) -> Profiling:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
