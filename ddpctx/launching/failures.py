"""How a task on N ranks failed: the error types ``launch()`` and the plugin raise, and their text.

- :class:`RankError`: a rank raised; it names the rank and carries the original
  exception, its traceback, and every rank's output. The rank that failed first
  is the cause; follow-on errors on the others (see :mod:`ddpctx.utils.errors`)
  are listed as secondary.
- :class:`RankTimeoutError`: the ranks ran past the timeout; every rank's stack.
- :class:`RankSkipped`: a rank called ``pytest.skip``.
"""

from __future__ import annotations

import re
from pathlib import Path

from ddpctx.launching.worker import Outcome
from ddpctx.session.departures import NOTE_PREFIX, note_of
from ddpctx.utils.errors import is_follow_on


class RankError(RuntimeError):
    """A rank failed (or hung) while running a function under :func:`launch`.

    Attributes:
        rank: the first rank that failed (None for a hang).
        original: that rank's exception, rebuilt in this process (or None).
        remote_traceback: its formatted traceback, as the rank saw it.
        outputs: each rank's captured ``(stdout, stderr)`` of this task, in rank
            order: also what ranks still running when another failed had printed.
        secondary: ``(rank, text)`` of the errors other ranks raised afterwards.
        hint: what the ranks' outcomes together say about the cause, when
            the error alone does not (e.g. a rank that lost its peer because the
            peer had returned), else "".

    Example:
        >>> from ddpctx import current, launch
        >>> def fail():
        ...     print("shard", current().rank)
        ...     if current().rank == 1:
        ...         raise ValueError("bad shard")
        >>> try:
        ...     launch(fail, world_size=2)
        ... except RankError as error:
        ...     print(error.rank, type(error.original).__name__, error.outputs[0][0])
        [rank 0] shard 0
        [rank 1] shard 1
        1 ValueError shard 0
        <BLANKLINE>
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
        hint: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.original = original
        self.remote_traceback = remote_traceback
        self.outputs = outputs or []
        self.secondary = secondary or []
        self.hint = hint


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


def lost_peer_hint(first: Outcome, outcomes: dict[int, Outcome]) -> str:
    """What to say when ``first`` only lost its peer and some ranks had returned normally.

    No rank failed on its own: a peer left while ``first`` still waited for it,
    which gloo reports as a remote worker crashing. The failing rank's own
    account wins (:mod:`ddpctx.session.departures`: it knows whether the peers
    had issued its collective -- a collective on some ranks only -- or had
    taken part and left -- calls that did not match, such as tensors of
    different shapes). Without it: the generic hint. "" otherwise.
    """
    finished = sorted(o.rank for o in outcomes.values() if o.kind == "ok")
    if not finished or not is_follow_on(first.error_text):
        return ""
    own = note_of(first.error)
    if own:
        return own.removeprefix(NOTE_PREFIX)
    who = f"rank{'s' if len(finished) > 1 else ''} {', '.join(map(str, finished))}"
    return (
        f"{who} had already finished while rank {first.rank} was waiting in a collective, "
        "which lost its peer: a collective issued on some ranks only. Every rank must issue "
        "the same collectives in the same order; decide data-dependent branches together "
        "with ctx.any(flag) / ctx.all(flag)."
    )


def worker_frames(dump: str) -> str:
    r"""A faulthandler dump as the user reads it: their thread first, ddpctx's own threads last.

    faulthandler lists the newest thread first, so ddpctx's watchdog would
    come before the frame the user is looking for. The main thread (the one
    running the task) is put first and cut below ``worker_main`` (the frames a
    forked worker inherited from its parent); then threads the user's code
    started; then threads that ddpctx itself runs.

    >>> dump = (
    ...     "Thread 0x2 (most recent call first):\n"
    ...     '  File "/site/ddpctx/hang/watchdog.py", line 167 in _run\n'
    ...     '  File "/lib/threading.py", line 1002 in _bootstrap\n'
    ...     "\n"
    ...     "Current thread 0x1 (most recent call first):\n"
    ...     '  File "/home/me/train.py", line 4 in body\n'
    ...     '  File "/site/ddpctx/launching/worker.py", line 125 in worker_main\n'
    ...     '  File "/lib/multiprocessing/popen_fork.py", line 71 in _launch\n'
    ... )
    >>> print(worker_frames(dump))
    Current thread 0x1 (most recent call first):
      File "/home/me/train.py", line 4 in body
      File "/site/ddpctx/launching/worker.py", line 125 in worker_main
    <BLANKLINE>
    Thread 0x2 (most recent call first):
      File "/site/ddpctx/hang/watchdog.py", line 167 in _run
      File "/lib/threading.py", line 1002 in _bootstrap
    """
    threads: list[list[str]] = []
    for line in dump.strip().splitlines():
        if THREAD_HEADER.match(line) or not threads:
            threads.append([])
        if line.strip():
            threads[-1].append(line)
    main: list[list[str]] = []
    for thread in threads:
        for index, line in enumerate(thread):
            if line.rstrip().endswith(" in worker_main"):
                del thread[index + 1 :]
                main.append(thread)
                break
    others = [thread for thread in threads if not any(thread is m for m in main)]
    others.sort(key=_started_by_ddpctx)  # stable: faulthandler's order within each kind
    return "\n\n".join("\n".join(thread) for thread in main + others)


#: The first line of each thread in a faulthandler dump.
THREAD_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+ ")
#: The folder of the ddpctx package, as it appears in stack frames.
PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)


def _started_by_ddpctx(thread: list[str]) -> bool:
    """Whether the thread's outermost frame outside ``threading.py`` is ddpctx's own code."""
    files = [FRAME_FILE.findall(line) for line in thread]
    ours = [f[0] for f in files if f and not f[0].endswith("threading.py")]
    return bool(ours) and ours[-1].startswith(PACKAGE_DIR)


FRAME_FILE = re.compile(r'^\s*File "([^"]+)"')


def summary(text: str, limit: int = 120) -> str:
    """The first line of an error text, without native source paths, cut to ``limit`` characters.

    gloo and c10d open their messages with the C++ file they came from; a
    transport error caused by another rank's failure is cut after the
    sentence that names what happened.

    >>> summary("RuntimeError: [/__w/pytorch/third_party/gloo/pair.cc:553] "
    ...         "Connection closed by peer [127.0.0.1]:5. This is typically caused by ...")
    'RuntimeError: Connection closed by peer [127.0.0.1]:5'
    """
    line = text.splitlines()[0] if text else "?"
    line = NATIVE_LOCATION.sub("", line)
    if is_follow_on(line):
        line = line.split(". ")[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


#: The C++ source location gloo and c10d put before a message: ``[/path/to/pair.cc:553] ``.
NATIVE_LOCATION = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cxx|c|h|hpp):\d+\] ")
