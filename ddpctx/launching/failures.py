"""How a task on N ranks failed: the error types ``launch()`` and the plugin raise, and their text.

- :class:`RankError`: a rank raised; it names the rank and carries the original
  exception, its traceback, and every rank's output. The rank that failed first
  is the cause; follow-on errors on the others (see :mod:`ddpctx.utils.errors`)
  are listed as secondary.
- :class:`RankTimeoutError`: the ranks ran past the timeout; every rank's stack.
- :class:`RankSkipped`: a rank called ``pytest.skip``.
"""

from __future__ import annotations

from ddpctx.launching.worker import Outcome
from ddpctx.utils.errors import is_follow_on


class RankError(RuntimeError):
    """A rank failed (or hung) while running a function under :func:`launch`.

    Attributes:
        rank: the first rank that failed (None for a hang).
        original: that rank's exception, rebuilt in this process (or None).
        remote_traceback: its formatted traceback, as the rank saw it.
        outputs: each rank's captured ``(stdout, stderr)``.
        secondary: ``(rank, text)`` of the errors other ranks raised afterwards.

    Example:
        >>> from ddpctx import launch
        >>> from ddpctx.session.context import current
        >>> def fail():
        ...     if current().rank == 1:
        ...         raise ValueError("bad shard")
        >>> try:
        ...     launch(fail, world_size=2)
        ... except RankError as error:
        ...     print(error.rank, type(error.original).__name__)
        1 ValueError
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        original: BaseException | None = None,
        remote_traceback: str = "",
        outputs: list[tuple[str, str]] | None = None,
        secondary: list[tuple[int, str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.original = original
        self.remote_traceback = remote_traceback
        self.outputs = outputs or []
        self.secondary = secondary or []


class RankSkipped(RankError):
    """A rank called ``pytest.skip``; the message is its reason."""


class RankTimeoutError(RankError, TimeoutError):
    """The ranks did not finish within the timeout; the message holds every rank's stack.

    Example:
        >>> import time
        >>> from ddpctx import launch
        >>> try:
        ...     launch(time.sleep, 30, world_size=2, timeout=1)
        ... except RankTimeoutError as error:
        ...     print(str(error).split(". ")[0])
        ranks 0, 1 did not finish within 1 s (finished: none)
    """


class RemoteTraceback(Exception):
    """Carries a rank's traceback text as the ``__cause__`` of a re-raised exception."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def root_cause(outcomes: dict[int, Outcome]) -> Outcome | None:
    """The failure to report: a rank's own error before any follow-on error, earliest first."""
    bad = [o for o in outcomes.values() if o.kind != "ok"]
    if not bad:
        return None
    # A hang report (HangError) explains the exits it caused on other ranks.
    return min(
        bad,
        key=lambda o: (is_follow_on(o.error_text), "HangError" not in o.error_text, o.finished),
    )


def worker_frames(dump: str) -> str:
    """A faulthandler dump without the frames a forked worker inherited from its parent."""
    lines = dump.strip().splitlines()
    for index, line in enumerate(lines):
        if line.rstrip().endswith(" in worker_main"):
            return "\n".join(lines[: index + 1])
    return "\n".join(lines)


def summary(text: str, limit: int = 120) -> str:
    """The first line of an error text, cut to ``limit`` characters."""
    line = text.splitlines()[0] if text else "?"
    return line if len(line) <= limit else line[: limit - 3] + "..."
