"""A pool of warm rank processes: fork, run tasks with a fresh group each, fail fast, clean up.

The parent side of the engine described in :mod:`ddpctx.launching.launcher`;
the rank side is :mod:`ddpctx.launching.worker`. :class:`RankPool` forks its
workers once and runs many tasks on them; a pool that a failure or a hang may
have spoiled is closed, never reused.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ddpctx.launching.descendants import descendants, start_time
from ddpctx.launching.echo import ECHO_INTERVAL_S, Echo
from ddpctx.launching.failures import (
    RankError,
    RankSkipped,
    RankTimeoutError,
    lost_peer_hint,
    root_cause,
    summary,
    worker_frames,
)
from ddpctx.launching.poolstore import loopback_listener
from ddpctx.launching.preflight import check_before_forking
from ddpctx.launching.worker import STOP_SIGNALS, Outcome, Task, read_from, worker_main
from ddpctx.utils.env import check_timeout
from ddpctx.utils.forking import collector_frozen

#: Seconds the other ranks get, after the first failure, to report their own errors.
FOLLOW_ON_GRACE_S = 1.0
#: Seconds ranks get to write their stacks after SIGUSR1.
STACK_DUMP_WAIT_S = 1.0
#: Seconds a rank that is stopped gets, after SIGTERM, to run its ``finally`` blocks.
FINALLY_GRACE_S = 1.0


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP wait (pending, not lost) until every forked rank is recorded.

    Ranks start their first task as soon as they are forked. A signal that
    lands after a fork but before the parent has recorded that rank left an
    unrecorded rank behind: :meth:`RankPool.close` could not stop it and the
    interpreter's exit waited on it forever. Each rank unblocks them for
    itself (:func:`~ddpctx.launching.worker.worker_main`).
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class RankPool:
    """``world_size`` worker processes that run functions as ranks of a fresh group each time.

    ``run`` returns the per-rank results in rank order, or raises
    :class:`RankError` / :class:`RankTimeoutError`. After a failure or a hang
    the pool is no longer ``healthy``: its workers were killed mid-task.

    Example:
        >>> with RankPool(2) as pool:
        ...     pool.run(sum, ([1, 2],))
        [3, 3]
    """

    def __init__(self, world_size: int, first: Task | None = None) -> None:
        check_before_forking(world_size)
        self.world_size = world_size
        self.healthy = True
        self._directory = Path(tempfile.mkdtemp(prefix="ddpctx-ranks-"))  # mode 0700
        self._tasks = 0
        self._first = first
        #: Each rank's captured ``(stdout, stderr)`` of the last task that succeeded.
        self.last_outputs: list[tuple[str, str]] = []
        #: Where the current task's output starts in each rank's ``(stdout, stderr)`` file.
        self._task_offsets = [(0, 0)] * world_size
        if first is not None:  # handed to the workers at fork time, as task 1
            first.number = 1
        context = multiprocessing.get_context("fork")
        self._conns: list[multiprocessing.connection.Connection] = []
        self._processes: list[Any] = []
        sys.stdout.flush()
        sys.stderr.flush()
        # Non-daemonic workers would be joined at interpreter exit; close them first.
        atexit.register(self.close)
        listener = loopback_listener()  # rank 0 serves the pool's store on it (see poolstore)
        try:
            # A rank never collects the caller's objects: a destroyed process group still
            # in a cycle would hang the rank at its first collection (utils.forking).
            with _stop_signals_held(), collector_frozen():
                for rank in range(world_size):
                    parent_end, child_end = context.Pipe()
                    process = context.Process(
                        target=worker_main,
                        args=(rank, world_size, child_end, self._directory, first, listener),
                        name=f"ddpctx-rank{rank}",
                        daemon=False,  # ranks may start DataLoader workers of their own
                    )
                    process.start()
                    child_end.close()
                    self._conns.append(parent_end)
                    self._processes.append(process)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()  # the ranks hold their own copies

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pids(self) -> list[int]:
        """Process ids of the workers (for tests that check nothing is left behind)."""
        return [p.pid for p in self._processes if p.pid is not None]

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        seed: int | None = None,
        timeout: float | None = None,
        init: bool = True,
        echo: bool = False,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank inside ``distributed(seed=seed)``.

        The ranks run it in this process's environment and working directory.
        ``init=False``: no group is formed and ``fn`` runs outside
        ``distributed()``, with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
        ``MASTER_PORT`` set, to form its own. ``echo=True`` streams each
        rank's output here as it comes, every line prefixed ``[rank N]``.
        """
        if not self.healthy:
            raise RuntimeError("this RankPool was spoiled by an earlier failure; start a new one")
        if timeout is not None:  # before any rank sees it: inf or 1e20 would fail in every rank
            check_timeout(timeout, f"timeout={timeout!r}")
        self._tasks += 1
        if self._first is not None:  # handed over at fork time: nothing to send
            self._first = None  # (its output starts at the start of the files)
        else:
            self._task_offsets = [
                (_size(self._directory / f"rank{r}.out"), _size(self._directory / f"rank{r}.err"))
                for r in range(self.world_size)
            ]
            task = Task(
                fn,
                tuple(args),
                dict(kwargs or {}),
                seed,
                timeout,
                number=self._tasks,
                environ=dict(os.environ),
                cwd=os.getcwd(),
                init=init,
            )
            try:
                payload = pickle.dumps(task)
            except Exception as error:
                raise TypeError(
                    f"{getattr(fn, '__qualname__', fn)!r} or its arguments cannot be sent to "
                    f"the ranks ({error}). Define the function at module level, or use "
                    "ddpctx.launch(), which forks the ranks with the function in memory."
                ) from None
            for conn in self._conns:
                conn.send_bytes(payload)
        # From where this task's output starts: a quick rank may have written already.
        echoer = Echo(self._directory, self._task_offsets) if echo else None
        try:
            outcomes = self._collect(timeout, echoer)
        except BaseException:
            self.healthy = False
            if echoer is not None:  # before close() removes the files
                echoer.pump(final=True)
                echoer = None
            self.close()
            raise
        finally:
            if echoer is not None:
                echoer.pump(final=True)
        self.last_outputs = [(o.stdout, o.stderr) for o in outcomes]
        return [outcome.value for outcome in outcomes]

    def _collect(self, timeout: float | None, echoer: Echo | None = None) -> list[Outcome]:
        deadline = None if timeout is None else time.monotonic() + timeout
        outcomes: dict[int, Outcome] = {}
        first_bad: Outcome | None = None
        grace_end: float | None = None
        while len(outcomes) < self.world_size:
            now = time.monotonic()
            limits = [t for t in (deadline, grace_end) if t is not None]
            wait = None if not limits else max(0.0, min(limits) - now)
            if echoer is not None:
                echoer.pump()
                wait = ECHO_INTERVAL_S if wait is None else min(wait, ECHO_INTERVAL_S)
            pending = [rank for rank in range(self.world_size) if rank not in outcomes]
            results: dict[Any, int] = {self._conns[rank]: rank for rank in pending}
            deaths: dict[Any, int] = {self._processes[rank].sentinel: rank for rank in pending}
            for item in multiprocessing.connection.wait([*results, *deaths], wait):
                if item in results:
                    rank = results[item]
                    try:
                        outcomes[rank] = self._conns[rank].recv()
                    except (EOFError, OSError):
                        outcomes[rank] = self._died(rank)
                elif (rank := deaths[item]) not in outcomes and not self._conns[rank].poll():
                    outcomes[rank] = self._died(rank)
            if first_bad is None:
                first_bad = root_cause(outcomes)
                if first_bad is not None:
                    grace_end = time.monotonic() + FOLLOW_ON_GRACE_S
            if grace_end is not None and time.monotonic() >= grace_end:
                break
            if deadline is not None and time.monotonic() >= deadline and first_bad is None:
                raise self._timeout_error(timeout, outcomes)
        first_bad = root_cause(outcomes)  # later reports may hold the real cause
        if first_bad is not None:
            self.healthy = False
            raise self._failure(first_bad, outcomes)
        return [outcomes[rank] for rank in range(self.world_size)]

    def _died(self, rank: int) -> Outcome:
        process = self._processes[rank]
        process.join(1.0)
        code = process.exitcode
        how = (
            f"was killed by signal {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
        return Outcome(rank, "error", error_text=f"RuntimeError: rank {rank} {how}")

    def _outputs(self) -> list[tuple[str, str]]:
        """Each rank's ``(stdout, stderr)`` of the current task so far, read from its files.

        Also for ranks that have not reported (still running when another
        failed, or killed): what they printed is kept, not only the failing
        rank's output.
        """
        outputs = []
        for rank, (out_start, err_start) in enumerate(self._task_offsets):
            texts = []
            for path, start in (
                (self._directory / f"rank{rank}.out", out_start),
                (self._directory / f"rank{rank}.err", err_start),
            ):
                try:
                    texts.append(read_from(path, start))
                except OSError:  # a rank that died before it opened its files
                    texts.append("")
            outputs.append((texts[0], texts[1]))
        return outputs

    def _failure(self, first: Outcome, outcomes: dict[int, Outcome]) -> RankError:
        outputs = self._outputs()
        secondary = [
            (o.rank, o.error_text)
            for o in sorted(outcomes.values(), key=lambda o: o.rank)
            if o.kind == "error" and o is not first
        ]
        if first.kind == "skip":
            return RankSkipped(first.error_text, rank=first.rank, outputs=outputs)
        message = f"rank {first.rank} failed: {first.error_text}"
        hint = lost_peer_hint(first, outcomes)
        if hint:
            message += f"\n({hint})"
        if secondary:
            message += (
                "\n(then, as a consequence: "
                + "; ".join(f"rank {rank}: {summary(text)}" for rank, text in secondary)
                + ")"
            )
        return RankError(
            message,
            rank=first.rank,
            original=first.error,
            remote_traceback=first.remote_traceback,
            outputs=outputs,
            secondary=secondary,
            hint=hint,
        )

    def _timeout_error(self, timeout: float | None, outcomes: dict[int, Outcome]) -> RankError:
        stuck = [rank for rank in range(self.world_size) if rank not in outcomes]
        for rank in stuck:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(self._processes[rank].pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
        stacks = "\n".join(
            f"--- rank {rank} ---\n"
            + worker_frames(read_from(self._directory / f"rank{rank}.stack", 0))
            for rank in stuck
        )
        finished = ", ".join(str(rank) for rank in sorted(outcomes)) or "none"
        rank0_err = read_from(self._directory / "rank0.err", 0)
        diagnoses = re.findall(r"^diagnosis: .*$", rank0_err, re.MULTILINE)
        return RankTimeoutError(
            f"ranks {', '.join(map(str, stuck))} did not finish within {timeout:g} s "
            f"(finished: {finished}). {diagnoses[-1] + ' ' if diagnoses else ''}"
            f"Python stack of every unfinished rank:\n{stacks}",
            outputs=self._outputs(),
        )

    def close(self) -> None:
        """Stop every worker and what it started; then remove the files.

        Idle workers are asked to stop; busy ones get SIGTERM (``distributed()``
        turns it into ``SystemExit``, so the rank's ``finally`` blocks run) and
        :data:`FINALLY_GRACE_S` to go. Then every worker's process group gets
        SIGKILL: a rank's own subprocesses never outlive it. So do the
        processes a rank started in a session of their own
        (``start_new_session=True``, ``setsid``), which that SIGKILL misses: they
        are found as the workers' descendants before the workers go.
        """
        escaped = descendants([process.pid for process in self._processes])
        for conn in self._conns:
            with contextlib.suppress(Exception):
                if self.healthy:
                    conn.send(None)
        if self.healthy:
            for process in self._processes:
                process.join(0.5)
        busy = [process for process in self._processes if process.is_alive()]
        for process in busy:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + FINALLY_GRACE_S
        for process in busy:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            if process.is_alive():  # killed before it had a process group of its own
                process.kill()
            process.join(5)
        for pid, started in escaped:
            if start_time(pid) == started:  # the same process, not a reused pid
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        for conn in self._conns:
            conn.close()
        self._conns, self._processes = [], []
        for note in self._directory.glob("rank*.pymp"):  # see worker._record_multiprocessing_dir
            with contextlib.suppress(OSError):
                folder = Path(note.read_text())
                if folder.name.startswith("pymp-") and folder != own_multiprocessing_dir():
                    shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(self._directory, ignore_errors=True)
        atexit.unregister(self.close)


def own_multiprocessing_dir() -> Path | None:
    """This process's ``pymp-*`` folder, if it has one (forked ranks inherit it: keep it)."""
    folder = multiprocessing.current_process()._config.get("tempdir")  # type: ignore[attr-defined]
    return Path(folder) if folder else None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
