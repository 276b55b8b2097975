"""Run a function on N local ranks: worker processes, rendezvous, fail-fast, stack dumps.

(Named ``launcher`` rather than ``launch`` so that importing this module does
not replace the function ``ddpctx.launch`` on the package.)

This module is the one engine behind :func:`launch` and the pytest plugin
(:mod:`ddpctx.testing`). It owns every hard part:

- **Workers** are forked from the calling process (Linux, macOS with care):
  functions defined in ``__main__``, a REPL or a Jupyter cell need no
  pickling for :func:`launch`, and tests keep pytest's rewritten asserts.
  Each rank runs torch with one intra-op thread, as torchrun's workers do:
  the parent's OpenMP thread pool does not survive the fork.
  A :class:`RankPool` keeps its workers for many tasks; each task gets a
  fresh process group. If CUDA is already initialised in the caller, forking
  is unsafe and :func:`launch` refuses with an explanation.
- **Rendezvous** goes through a ``FileStore`` in a private temporary
  directory (mode 0700): no TCP port at all. gloo's own transport socket is
  pinned to the loopback interface.
- **Fail-fast**: the first rank to fail ends the task; the other ranks get a
  short grace period to report follow-on errors, then they are killed and the
  pool is marked spoiled (a new one is started next time). The error names
  the rank and carries the original exception and its traceback.
- **Hangs**: past ``timeout`` every rank dumps its Python stack (faulthandler
  on SIGUSR1, which works even inside a blocked C++ collective), then all are
  killed. The error carries every rank's stack.
- **Clean-up**: workers die with their parent (``PR_SET_PDEATHSIG`` on
  Linux), and every exit path -- Ctrl-C included -- kills what is still alive.

Example:
    >>> def rank_and_size(offset):
    ...     import ddpctx
    ...     ctx = ddpctx.current()
    ...     return ctx.rank + offset, ctx.world_size
    >>> launch(rank_and_size, 10, world_size=2)
    [(10, 2), (11, 2)]
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpctx.errors import is_follow_on

#: Seconds the other ranks get, after the first failure, to report their own errors.
FOLLOW_ON_GRACE_S = 1.0
#: Seconds ranks get to write their stacks after SIGUSR1.
STACK_DUMP_WAIT_S = 1.0


class RankError(RuntimeError):
    """A rank failed (or hung) while running a function under :func:`launch`.

    Attributes:
        rank: the first rank that failed (None for a hang).
        original: that rank's exception, rebuilt in this process (or None).
        remote_traceback: its formatted traceback, as the rank saw it.
        outputs: each rank's captured ``(stdout, stderr)``.
        secondary: ``(rank, text)`` of the errors other ranks raised afterwards.

    Example:
        >>> from ddpctx.context import current
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


@dataclass
class _Task:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    seed: int | None
    timeout: float | None
    store: str  # FileStore path, fresh per task


@dataclass
class _Outcome:
    """What one rank sends back for one task."""

    rank: int
    kind: str  # "ok", "error", "skip"
    value: Any = None
    error: BaseException | None = None
    error_text: str = ""  # "Type: message"
    remote_traceback: str = ""
    stdout: str = ""
    stderr: str = ""
    finished: float = field(default_factory=time.monotonic)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _redirect_output(directory: Path, rank: int) -> tuple[Path, Path]:
    """Send this worker's stdout/stderr (Python and C level) to files."""
    out_path, err_path = directory / f"rank{rank}.out", directory / f"rank{rank}.err"
    for path, fd, name in ((out_path, 1, "stdout"), (err_path, 2, "stderr")):
        stream = open(path, "a", buffering=1)  # noqa: SIM115 -- lives as long as the worker
        os.dup2(stream.fileno(), fd)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    return out_path, err_path


def _worker(
    rank: int,
    world_size: int,
    conn: multiprocessing.connection.Connection,
    directory: Path,
    first: _Task | None,
) -> None:
    """A worker's whole life: take tasks until told to stop (or the parent is gone)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    out_path, err_path = _redirect_output(directory, rank)
    stacks = open(directory / f"rank{rank}.stack", "w")  # noqa: SIM115 -- worker lifetime
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch = sys.modules.get("torch")
    if torch is not None:
        # The parent's OpenMP thread pool does not survive fork: a forked rank that enters a
        # parallel region deadlocks. One intra-op thread per rank (torchrun's default too)
        # keeps torch from entering one.
        torch.set_num_threads(1)
    task = first
    while True:
        if task is None:
            try:
                task = conn.recv()
            except (EOFError, OSError):
                return
            if task is None:
                return
        out_start, err_start = out_path.stat().st_size, err_path.stat().st_size
        outcome = _run_task(rank, world_size, task)
        sys.stdout.flush()
        sys.stderr.flush()
        outcome.stdout = _read_from(out_path, out_start)
        outcome.stderr = _read_from(err_path, err_start)
        try:
            conn.send(outcome)
        except Exception as error:  # the value or the exception would not pickle
            conn.send(_unpicklable(outcome, error))
        task = None


def _read_from(path: Path, offset: int) -> str:
    with open(path, errors="replace") as handle:
        handle.seek(offset)
        return handle.read()


def _unpicklable(outcome: _Outcome, error: Exception) -> _Outcome:
    what = "result" if outcome.kind == "ok" else "exception"
    return _Outcome(
        outcome.rank,
        "error",
        error_text=outcome.error_text
        or f"TypeError: rank {outcome.rank}'s {what} could not be sent back ({error})",
        remote_traceback=outcome.remote_traceback,
        stdout=outcome.stdout,
        stderr=outcome.stderr,
    )


def _run_task(rank: int, world_size: int, task: _Task) -> _Outcome:
    import torch.distributed as dist

    from ddpctx.context import distributed
    from ddpctx.env import resolve_timeout
    from ddpctx.group import init_kwargs, loopback_gloo

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
    )
    try:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        kwargs = init_kwargs(backend, device, resolve_timeout(task.timeout, os.environ))
        with loopback_gloo():
            store = dist.FileStore(task.store, world_size)  # type: ignore[attr-defined]
            dist.init_process_group(store=store, rank=rank, world_size=world_size, **kwargs)
        with distributed(seed=task.seed, timeout=task.timeout):
            value = task.fn(*task.args, **task.kwargs)
        return _Outcome(rank, "ok", value=value)
    except BaseException as error:
        if _is_pytest_skip(error):
            return _Outcome(rank, "skip", error_text=str(error))
        text = "".join(traceback.format_exception(type(error), error, _user_frames(error)))
        return _Outcome(
            rank,
            "error",
            error=_picklable(error),
            error_text=f"{type(error).__name__}: {error}",
            remote_traceback=text,
        )
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
            os.environ.pop(name, None)


def _root_cause(outcomes: dict[int, _Outcome]) -> _Outcome | None:
    """The failure to report: a rank's own error before any follow-on error, earliest first."""
    bad = [o for o in outcomes.values() if o.kind != "ok"]
    if not bad:
        return None
    return min(bad, key=lambda o: (is_follow_on(o.error_text), o.finished))


_PACKAGE = str(Path(__file__).resolve().parent)


def _user_frames(error: BaseException) -> Any:
    """The exception's traceback without the leading frames of ddpctx's own machinery."""
    frames = error.__traceback__
    while frames is not None and frames.tb_next is not None:
        if not str(Path(frames.tb_frame.f_code.co_filename).resolve()).startswith(_PACKAGE):
            break
        frames = frames.tb_next
    return frames


def _is_pytest_skip(error: BaseException) -> bool:
    pytest = sys.modules.get("pytest")
    return pytest is not None and isinstance(error, pytest.skip.Exception)


def _worker_frames(dump: str) -> str:
    """A faulthandler dump without the frames a forked worker inherited from its parent."""
    lines = dump.strip().splitlines()
    for index, line in enumerate(lines):
        if line.rstrip().endswith(" in _worker"):
            return "\n".join(lines[: index + 1])
    return "\n".join(lines)


def summary(text: str, limit: int = 120) -> str:
    """The first line of an error text, cut to ``limit`` characters."""
    line = text.splitlines()[0] if text else "?"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _picklable(error: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return None
    error.__traceback__ = None  # tracebacks never pickle; the text travels separately
    return error


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

    def __init__(self, world_size: int, first: _Task | None = None) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be a positive int, e.g. 2.")
        if "fork" not in multiprocessing.get_all_start_methods():
            raise RuntimeError(
                "ddpctx starts ranks by forking, which this platform does not offer "
                f"({sys.platform}). Use torchrun to start the ranks instead."
            )
        self.world_size = world_size
        self.healthy = True
        self._directory = Path(tempfile.mkdtemp(prefix="ddpctx-ranks-"))  # mode 0700
        self._tasks = 0
        self._first = first
        if first is not None:  # handed to the workers at fork time, as task 1
            first.store = self._store(1)
        context = multiprocessing.get_context("fork")
        self._conns: list[multiprocessing.connection.Connection] = []
        self._processes: list[Any] = []
        sys.stdout.flush()
        sys.stderr.flush()
        # Non-daemonic workers would be joined at interpreter exit; close them first.
        atexit.register(self.close)
        try:
            for rank in range(world_size):
                parent_end, child_end = context.Pipe()
                process = context.Process(
                    target=_worker,
                    args=(rank, world_size, child_end, self._directory, first),
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

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _store(self, task: int) -> str:
        return str(self._directory / f"store{task}")

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
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank inside ``distributed(seed=seed)``."""
        if not self.healthy:
            raise RuntimeError("this RankPool was spoiled by an earlier failure; start a new one")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds, or None.")
        self._tasks += 1
        if self._first is not None:  # handed over at fork time: nothing to send
            self._first = None
        else:
            task = _Task(
                fn, tuple(args), dict(kwargs or {}), seed, timeout, self._store(self._tasks)
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
        try:
            outcomes = self._collect(timeout)
        except BaseException:
            self.healthy = False
            self.close()
            raise
        return [outcome.value for outcome in outcomes]

    def _collect(self, timeout: float | None) -> list[_Outcome]:
        deadline = None if timeout is None else time.monotonic() + timeout
        outcomes: dict[int, _Outcome] = {}
        first_bad: _Outcome | None = None
        grace_end: float | None = None
        while len(outcomes) < self.world_size:
            now = time.monotonic()
            limits = [t for t in (deadline, grace_end) if t is not None]
            wait = None if not limits else max(0.0, min(limits) - now)
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
                first_bad = _root_cause(outcomes)
                if first_bad is not None:
                    grace_end = time.monotonic() + FOLLOW_ON_GRACE_S
            if grace_end is not None and time.monotonic() >= grace_end:
                break
            if deadline is not None and time.monotonic() >= deadline and first_bad is None:
                raise self._timeout_error(timeout, outcomes)
        first_bad = _root_cause(outcomes)  # later reports may hold the real cause
        if first_bad is not None:
            self.healthy = False
            raise self._failure(first_bad, outcomes)
        return [outcomes[rank] for rank in range(self.world_size)]

    def _died(self, rank: int) -> _Outcome:
        process = self._processes[rank]
        process.join(1.0)
        code = process.exitcode
        how = (
            f"was killed by signal {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
        return _Outcome(rank, "error", error_text=f"RuntimeError: rank {rank} {how}")

    def _outputs(self) -> list[tuple[str, str]]:
        return [
            (
                _read_from(self._directory / f"rank{rank}.out", 0)[-20000:],
                _read_from(self._directory / f"rank{rank}.err", 0)[-20000:],
            )
            for rank in range(self.world_size)
        ]

    def _failure(self, first: _Outcome, outcomes: dict[int, _Outcome]) -> RankError:
        outputs = [
            (o.stdout, o.stderr) if (o := outcomes.get(rank)) else ("", "")
            for rank in range(self.world_size)
        ]
        secondary = [
            (o.rank, o.error_text)
            for o in sorted(outcomes.values(), key=lambda o: o.rank)
            if o.kind == "error" and o is not first
        ]
        if first.kind == "skip":
            return RankSkipped(first.error_text, rank=first.rank, outputs=outputs)
        message = f"rank {first.rank} failed: {first.error_text}"
        if secondary:
            message += (
                "\n(then, as a consequence: "
                + "; ".join(
                    f"rank {rank}: {text.splitlines()[0] if text else '?'}"
                    for rank, text in secondary
                )
                + ")"
            )
        return RankError(
            message,
            rank=first.rank,
            original=first.error,
            remote_traceback=first.remote_traceback,
            outputs=outputs,
            secondary=secondary,
        )

    def _timeout_error(self, timeout: float | None, outcomes: dict[int, _Outcome]) -> RankError:
        stuck = [rank for rank in range(self.world_size) if rank not in outcomes]
        for rank in stuck:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(self._processes[rank].pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
        stacks = "\n".join(
            f"--- rank {rank} ---\n"
            + _worker_frames(_read_from(self._directory / f"rank{rank}.stack", 0))
            for rank in stuck
        )
        finished = ", ".join(str(rank) for rank in sorted(outcomes)) or "none"
        return RankTimeoutError(
            f"ranks {', '.join(map(str, stuck))} did not finish within {timeout:g} s "
            f"(finished: {finished}). Python stack of every unfinished rank:\n{stacks}",
            outputs=self._outputs(),
        )

    def close(self) -> None:
        """Stop every worker: politely if idle, by SIGKILL otherwise; then remove the files."""
        for conn in self._conns:
            with contextlib.suppress(Exception):
                if self.healthy:
                    conn.send(None)
        for process in self._processes:
            process.join(0.5 if self.healthy else 0)
            if process.is_alive():
                process.kill()
                process.join(5)
        for conn in self._conns:
            conn.close()
        self._conns, self._processes = [], []
        shutil.rmtree(self._directory, ignore_errors=True)
        atexit.unregister(self.close)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    seed: int | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks; return the results in rank order.

    Each rank runs inside ``distributed(seed=seed)`` (gloo on the CPU, or one
    GPU per rank when CUDA has at least ``world_size`` devices), so
    ``ddpctx.current()`` and every collective work as under torchrun.

    Ranks are forked from this process, so ``fn`` may be defined anywhere: in
    a script's ``__main__``, in a REPL, in a Jupyter cell, even a lambda.
    Each rank's output is printed here afterwards, prefixed with its rank.

    If one rank raises, every rank is stopped within seconds and
    :class:`RankError` is raised naming the rank, chained from the original
    exception (``error.original``, ``error.remote_traceback``). If the ranks
    run past ``timeout`` seconds, :class:`RankTimeoutError` carries every
    rank's Python stack. No process is left behind on any path, Ctrl-C
    included.

    Example:
        >>> launch(lambda: 1 + 1, world_size=2)
        [2, 2]
    """
    _check_cuda(world_size)
    pool = RankPool(world_size, first=_Task(fn, args, kwargs, seed, timeout, store=""))
    try:
        results = pool.run(fn, args, kwargs, seed=seed, timeout=timeout)
        outputs = pool._outputs()
    except RankError as error:
        _echo(error.outputs)
        if error.original is not None:
            error.original.__cause__ = RemoteTraceback(error.remote_traceback)
            raise error from error.original
        raise
    finally:
        pool.close()
    _echo(outputs)
    return results


def _echo(outputs: list[tuple[str, str]]) -> None:
    for rank, (out, err) in enumerate(outputs):
        for text, stream in ((out, sys.stdout), (err, sys.stderr)):
            for line in text.splitlines():
                print(f"[rank {rank}] {line}", file=stream)


def _check_cuda(world_size: int) -> None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA is already initialised in this process, and forked ranks cannot use it. "
            "Call ddpctx.launch() before touching the GPU (e.g. before model.cuda()), or "
            "start the ranks with torchrun."
        )
    count = torch.cuda.device_count()
    if count < world_size:
        raise RuntimeError(
            f"world_size={world_size} but only {count} CUDA device(s) are visible; each rank "
            f"needs its own GPU. Pass world_size<={count}, or set CUDA_VISIBLE_DEVICES='' "
            "before starting Python to run the ranks on the CPU."
        )
