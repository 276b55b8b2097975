"""What runs inside each rank for a marked test: the body, its coroutine, its capsys.

The plugin (:mod:`ddpctx.testing.plugin`) sends :func:`call_test_body` to the
ranks with the test function and its fixture values. Here, in the rank:

- ``dist_ctx`` becomes the rank's own :class:`~ddpctx.DistContext`;
- ``capsys`` / ``capfd`` become a :class:`RankCapture` that records what
  this rank prints (Python-level ``sys.stdout`` / ``sys.stderr``), while the
  output still reaches the rank's report and ``-s`` stream;
- an ``async def`` body runs to completion on a new event loop;
- a ``distributed()`` block the body entered and never left is closed after
  the test, and that test fails naming itself (the next test on the warm rank
  would otherwise fail on "already active ... nesting").

Example:
    >>> capture = RankCapture()
    >>> with capture.installed():
    ...     print("hello")  # still printed, and recorded
    hello
    >>> capture.readouterr().out
    'hello\\n'
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from _pytest.capture import CaptureResult  # what pytest's capsys.readouterr() returns

#: Placeholders the plugin sends instead of fixtures that only make sense in the rank.
RANK_CONTEXT = "<the rank's DistContext>"
RANK_CAPTURE = "<the rank's capsys>"
CAPTURE_FIXTURES = ("capsys", "capfd")


class _Tee(io.TextIOBase):
    """Writes to the rank's stream and to a buffer that ``readouterr`` empties."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.buffer_text = io.StringIO()

    def write(self, text: str) -> int:
        self.buffer_text.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def take(self) -> str:
        text = self.buffer_text.getvalue()
        self.buffer_text.seek(0)
        self.buffer_text.truncate()
        return text


class RankCapture:
    """``capsys`` inside a rank: ``readouterr()`` returns what this rank printed since."""

    def __init__(self) -> None:
        self._out: _Tee | None = None
        self._err: _Tee | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[RankCapture]:
        saved = sys.stdout, sys.stderr
        self._out, self._err = _Tee(sys.stdout), _Tee(sys.stderr)
        sys.stdout, sys.stderr = self._out, self._err
        try:
            yield self
        finally:
            sys.stdout, sys.stderr = saved

    def readouterr(self) -> CaptureResult[str]:
        """``(out, err)`` printed by this rank since the last call."""
        out = self._out.take() if self._out else ""
        err = self._err.take() if self._err else ""
        return CaptureResult(out, err)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Output inside the block is not recorded (it still reaches the rank's report)."""
        saved = sys.stdout, sys.stderr
        if self._out and self._err:
            sys.stdout, sys.stderr = self._out.stream, self._err.stream
        try:
            yield
        finally:
            sys.stdout, sys.stderr = saved


def _outside_the_parents_given() -> contextlib.AbstractContextManager[None]:
    """The body runs outside any hypothesis ``@given`` test of the parent's.

    A rank forked while the parent ran a ``@given`` test (the pool restarted a rank
    from inside one) inherits that test's context, which hypothesis keeps per thread:
    every ``@given`` test the rank ran next failed as "nested" (a CI failure).
    """
    control = sys.modules.get("hypothesis.control")
    variable = getattr(control, "_current_build_context", None)
    with_value = getattr(variable, "with_value", None)
    if with_value is None or getattr(variable, "value", None) is None:
        return contextlib.nullcontext()
    return with_value(None)  # type: ignore[no-any-return]


def call_test_body(test: Callable[..., Any], funcargs: dict[str, Any]) -> None:
    """Run on each rank (inside ``distributed()`` unless the test formed its own group).

    The values sent for ``dist_ctx``, ``capsys`` and ``capfd`` are
    placeholders (:data:`RANK_CONTEXT`, :data:`RANK_CAPTURE`), replaced here.
    """
    from ddpctx.session.context import current

    funcargs = dict(funcargs)
    capture = RankCapture()
    before = current()
    if "dist_ctx" in funcargs:
        funcargs["dist_ctx"] = before
    captured = [name for name in CAPTURE_FIXTURES if name in funcargs]
    for name in captured:
        funcargs[name] = capture
    try:
        with (
            capture.installed() if captured else contextlib.nullcontext(),
            _outside_the_parents_given(),
        ):
            result = test(**funcargs)
            if inspect.iscoroutine(result):
                asyncio.run(result)
            elif inspect.isasyncgen(result):
                raise TypeError(
                    f"{test.__qualname__} is an async generator; a test must be a function or "
                    "an `async def` coroutine function."
                )
    except BaseException:
        _end_leaked_block(before)  # the test's own error is the one to report
        raise
    leaked = _end_leaked_block(before)
    if leaked is not None:
        raise RuntimeError(
            f"{test.__module__}::{test.__qualname__} left distributed() entered "
            f"({leaked!r}): the block was never exited, so the next test on this warm rank "
            "would have found it active. ddpctx closed it (and its process group) after the "
            "test. Use `with ddpctx.distributed() as ctx:` in the test body, or call the "
            "session's __exit__ in a finally block."
        )


def _end_leaked_block(before: object) -> object | None:
    """Close a ``distributed()`` block the test body entered and left open; return its context.

    ``before`` is the block active when the body started (the plugin's own, or
    None with ``init=False``): that one is not the test's to close.
    """
    from ddpctx.session.context import current

    leaked = current()
    if leaked is None or leaked is before:
        return None
    leaked._close()  # what leaving the block would have done: group, watchers, hooks
    return leaked
