"""``ctx.profile``: ``torch.profiler`` traces of chosen steps on chosen ranks, one file per rank.

Two ways to ask:

- ``ctx.profile(steps=(10, 12))`` (or ``DDPCTX_PROFILE=10-12``, optionally
  ``10-12@0,2`` for ranks 0 and 2) arms a profiler that starts when step 10
  begins and stops after step 12, counting the steps the step clock times
  from 0 (:mod:`ddpctx.watch.clock`: optimizer steps, or ``ctx.dataloader``
  batches in a loop without an optimizer): no code in the loop.
- ``with ctx.profile():`` profiles the body of the ``with``.

Each profiled rank writes ``log_dir/profile/rank<r>.pt.trace.json``: a Chrome
trace that Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open, and
TensorBoard's profiler plugin finds under ``log_dir``. A trace never replaces
another: when that name is taken (a second profile of the block, an earlier
run), the next free of ``rank<r>.1.pt.trace.json``, ``rank<r>.2...`` is
written. Without ``log_dir`` the folder is the current directory's
``profile/``, and a warning names the file. Ranks not chosen do nothing;
ranks that do not exist (at or above the world size) are refused.

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

from ddpctx.utils.warn import warn_user

#: The environment variable that arms a profile: ``FIRST-LAST`` steps, ``@RANKS`` optional.
ENV = "DDPCTX_PROFILE"


def parse_profile_env(
    value: str, world_size: int | None = None
) -> tuple[tuple[int, int], tuple[int, ...] | None]:
    """``"10-12@0,2"`` -> ``((10, 12), (0, 2))``; a bad value names the variable and a good one.

    With ``world_size``, ranks outside ``0 .. world_size - 1`` are refused too.

    >>> parse_profile_env("5")
    ((5, 5), None)
    >>> parse_profile_env("x")
    Traceback (most recent call last):
    ...
    ValueError: DDPCTX_PROFILE='x': expected FIRST-LAST steps, optionally @RANKS, e.g. 10-12@0,1.
    """
    try:
        steps, at, ranks = value.strip().partition("@")
        first, _, last = steps.partition("-")
        span = (int(first), int(last or first))
        chosen = tuple(int(r) for r in ranks.split(",")) if ranks or at else None
    except ValueError:
        raise ValueError(
            f"{ENV}={value!r}: expected FIRST-LAST steps, optionally @RANKS, e.g. 10-12@0,1."
        ) from None
    if span[0] < 0 or span[1] < span[0]:
        raise ValueError(f"{ENV}={value!r}: steps {span} must satisfy 0 <= FIRST <= LAST.")
    if chosen is not None:
        check_ranks(chosen, world_size, f"{ENV}={value!r}")
    return span, chosen


def check_ranks(ranks: Sequence[int], world_size: int | None, what: str) -> None:
    """Refuse ranks no process has (nothing would ever be profiled), naming them and the fix.

    >>> check_ranks([0, 7], 2, "ctx.profile(ranks=[0, 7])")
    Traceback (most recent call last):
    ...
    ValueError: ctx.profile(ranks=[0, 7]): rank 7 does not exist at world size 2 ...
    """
    for rank in ranks:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(
                f"{what}: {rank!r} is not a rank; pass ranks as whole numbers from 0, "
                "e.g. ranks=[0, 1]."
            )
        if world_size is not None and rank >= world_size:
            raise ValueError(
                f"{what}: rank {rank} does not exist at world size {world_size} (ranks are "
                f"0 to {world_size - 1}), so nothing would be profiled; choose ranks below "
                f"{world_size}."
            )


def free_path(folder: Path, rank: int) -> Path:
    """``folder/rank<r>.pt.trace.json``, or the first free ``rank<r>.<n>.pt.trace.json``."""
    path = folder / f"rank{rank}.pt.trace.json"
    number = 0
    while path.exists():
        number += 1
        path = folder / f"rank{rank}.{number}.pt.trace.json"
    return path


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
        world_size: int | None = None,
    ) -> None:
        if steps is not None:
            pair = tuple(steps) if isinstance(steps, (tuple, list)) else ()
            first, last = pair if len(pair) == 2 else (None, None)
            if not (isinstance(first, int) and isinstance(last, int) and 0 <= first <= last):
                raise ValueError(
                    f"ctx.profile(steps={steps!r}): a pair of step numbers (first, last) with "
                    "0 <= first <= last is needed, e.g. steps=(10, 12)."
                )
        if ranks is not None:
            if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
                raise ValueError(
                    f"ctx.profile(ranks={ranks!r}): pass a list of ranks, e.g. ranks=[0, 1]."
                )
            check_ranks(ranks, world_size, f"ctx.profile(ranks={list(ranks)!r})")
        chosen = ranks is None or rank in ranks
        self.rank = rank
        self.in_cwd = log_dir is None
        self.folder = (log_dir if log_dir is not None else Path.cwd()) / "profile"
        #: The trace file this rank writes: the first free name now, fixed when written.
        self.path: Path | None = free_path(self.folder, rank) if chosen else None
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
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = free_path(self.folder, self.rank)  # another profile may have taken it
        profiler.export_chrome_trace(str(self.path))
        self.done = True
        if self.in_cwd:
            warn_user(
                f"ctx.profile: rank {self.rank} wrote its trace to {self.path.resolve()} (the "
                "current directory's profile/, as this block has no log_dir); pass "
                "distributed(log_dir=...) to keep traces with the run."
            )

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
