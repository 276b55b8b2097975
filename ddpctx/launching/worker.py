"""One rank's life inside a forked worker process: output capture, stack dumps, tasks.

The parent side (:mod:`ddpctx.launching.launcher`) forks a worker per rank and sends it
:class:`Task` objects; :func:`worker_main` runs each inside a fresh process
group and ``distributed()``, and sends back an :class:`Outcome`: the value, a
``pytest.skip``, or the exception (rebuilt in the parent if it pickles) with
its traceback text starting at the user's own frames.

Set up once per worker: die with the parent (``PR_SET_PDEATHSIG``), and so
does every process the rank started (a watcher kills its process group), ignore
Ctrl-C (the parent handles it), send stdout/stderr -- Python and C level -- to
files the parent reads per task, dump every thread's stack on SIGUSR1, and
run torch with one intra-op thread (the parent's OpenMP pool does not survive
the fork; torchrun's workers use one thread too).

Example:
    >>> Task(print, ("hi",), {}, seed=None, timeout=None).args
    ('hi',)
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing.connection
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpctx.launching.poolstore import PoolStore
    from ddpctx.launching.taskstate import RankState

#: Signals that stop a launch; the parent holds them while it forks (see ``pool``).
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


@dataclass
class Task:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    seed: int | None
    timeout: float | None
    number: int = 0  # the task's number in its pool: its store prefix (see ``poolstore``)
    environ: dict[str, str] | None = None  # the caller's environment, to run the task in
    cwd: str | None = None  # the caller's working directory, likewise
    init: bool = True  # False: no group; the task gets the rendezvous variables instead


@dataclass
class Outcome:
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


def _end_group_with_rank() -> None:
    """Fork a watcher that SIGKILLs this rank's process group once the rank is gone.

    ``PR_SET_PDEATHSIG`` ends the rank with its parent (a SIGKILLed pytest),
    but not what the rank started -- DataLoader workers, a test's own
    subprocesses -- which would live on as orphans. They are in the rank's
    process group, and so is the watcher: told of the rank's death by a
    death signal of its own, it kills the whole group, itself included. The
    watcher makes system calls only (no Python state of the rank is used).
    """
    if not sys.platform.startswith("linux"):
        return
    rank = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})  # before fork: none is lost
    try:
        pid = os.fork()
    except OSError:
        pid = -1
    if pid != 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
        return
    try:  # the watcher
        os.closerange(0, 4096)  # the rank's pipes and sockets: never held open by it
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGHUP)  # PR_SET_PDEATHSIG
        if os.getppid() == rank:  # else the rank is already gone
            signal.sigwait({signal.SIGHUP})
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)


def _redirect_output(directory: Path, rank: int) -> tuple[Path, Path]:
    """Send this worker's stdout/stderr (Python and C level) to files."""
    out_path, err_path = directory / f"rank{rank}.out", directory / f"rank{rank}.err"
    for path, fd, name in ((out_path, 1, "stdout"), (err_path, 2, "stderr")):
        stream = open(path, "a", buffering=1)  # noqa: SIM115 -- lives as long as the worker
        os.dup2(stream.fileno(), fd)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    return out_path, err_path


def worker_main(
    rank: int,
    world_size: int,
    conn: multiprocessing.connection.Connection,
    directory: Path,
    first: Task | None,
    listener: socket.socket,
) -> None:
    """A worker's whole life: take tasks until told to stop (or the parent is gone)."""
    _die_with_parent()
    # A process group of its own: the parent can end the rank together with every process
    # the rank started (DataLoader workers, a user's subprocesses) with one killpg.
    os.setpgid(0, 0)
    _end_group_with_rank()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # Handlers the parent installed (launch()'s, the plugin's pool closer) are the parent's:
    # run in a rank they would act on the parent's copied state. A rank starts from the
    # defaults, so that distributed() turns SIGTERM into SystemExit here too.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # held by the parent while forking
    out_path, err_path = _redirect_output(directory, rank)
    stacks = open(directory / f"rank{rank}.stack", "w")  # noqa: SIM115 -- worker lifetime
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    _record_multiprocessing_dir(directory, rank)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch = sys.modules.get("torch")
    if torch is not None:
        # The parent's OpenMP thread pool does not survive fork: a forked rank that enters a
        # parallel region deadlocks. One intra-op thread per rank (torchrun's default too)
        # keeps torch from entering one.
        torch.set_num_threads(1)
    from ddpctx.launching.poolstore import PoolStore
    from ddpctx.launching.taskstate import capture

    stores = PoolStore(rank, world_size, listener)
    start = capture()
    reaper = Reaper()
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
        outcome = _run_task(rank, world_size, task, start, reaper, stores)
        sys.stdout.flush()
        sys.stderr.flush()
        outcome.stdout = read_from(out_path, out_start)
        outcome.stderr = read_from(err_path, err_start)
        try:
            conn.send(outcome)
        except Exception as error:  # the value or the exception would not pickle
            conn.send(_unpicklable(outcome, error))
        stores.finished(task.number)
        task = None


def _record_multiprocessing_dir(directory: Path, rank: int) -> None:
    """Create this process's ``pymp-*`` folder now and note where it is, for the parent.

    Sending a tensor back to the parent starts a ``multiprocessing`` listener
    whose socket lives in a ``pymp-*`` folder, removed when the process exits
    normally -- never when a rank is killed after a peer failed. The parent
    removes the folders noted here when it closes the pool.
    """
    import multiprocessing.util

    (directory / f"rank{rank}.pymp").write_text(multiprocessing.util.get_temp_dir())


def read_from(path: Path, offset: int) -> str:
    with open(path, errors="replace") as handle:
        handle.seek(offset)
        return handle.read()


def _unpicklable(outcome: Outcome, error: Exception) -> Outcome:
    what = "result" if outcome.kind == "ok" else "exception"
    return Outcome(
        outcome.rank,
        "error",
        error_text=outcome.error_text
        or f"TypeError: rank {outcome.rank}'s {what} could not be sent back ({error})",
        remote_traceback=outcome.remote_traceback,
        stdout=outcome.stdout,
        stderr=outcome.stderr,
    )


class Reaper:
    """Frees the process groups of finished tasks on threads of its own.

    Freeing a gloo group joins its transport threads, which wake every 10 ms:
    about 18 ms per group here, spent waiting with the GIL released. Freed
    here, that wait overlaps the next task instead of lengthening every one,
    and :attr:`BACKLOG` threads free groups side by side: with one thread a
    run of short tasks waited about 9 ms each for the group before last to
    be freed. At most :attr:`BACKLOG` groups wait to be freed; :meth:`drop`
    waits for a slot beyond that, so a long run of short tasks never piles up
    sockets and threads.

    Example:
        >>> reaper = Reaper()
        >>> reaper.drop(object())
        >>> reaper.drain()
    """

    BACKLOG = 4

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._slots = threading.Semaphore(self.BACKLOG)
        self._threads: list[threading.Thread] = []

    def drop(self, group: object) -> None:
        """Free ``group`` (this must be the last reference to it) soon, on a reaper thread."""
        self._slots.acquire()
        if len(self._threads) < self.BACKLOG:  # one more thread for each group in flight
            thread = threading.Thread(target=self._run, name="ddpctx-reaper", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._queue.put(group)

    def drain(self) -> None:
        """Return once every group dropped so far is freed."""
        for _ in range(self.BACKLOG):
            self._slots.acquire()
        for _ in range(self.BACKLOG):
            self._slots.release()

    def _run(self) -> None:
        while True:
            group = self._queue.get()
            del group  # the last reference: the group's destructor runs here
            self._slots.release()


def _release_group(reaper: Reaper) -> None:
    """Destroy the task's process group (formed by ddpctx, or left behind by the task).

    torch forgets the group at once, so the next task can form its own; the
    object itself is freed by ``reaper``.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    world = dist.group.WORLD
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    reaper.drop(world)


def _run_task(
    rank: int, world_size: int, task: Task, start: RankState, reaper: Reaper, stores: PoolStore
) -> Outcome:
    from ddpctx.launching.taskstate import task_state

    try:
        with task_state(start, task.environ, task.cwd):
            os.environ.update(
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size),
                GROUP_RANK="0",
                DDPCTX_LAUNCHER="launch",
                # The marker holds in this process only: a copy elsewhere is stale.
                DDPCTX_LAUNCHER_PID=str(os.getpid()),
            )
            try:
                return Outcome(rank, "ok", value=_call(rank, world_size, task, stores))
            finally:
                _release_group(reaper)
    except BaseException as error:
        if _is_pytest_skip(error):
            return Outcome(rank, "skip", error_text=str(error))
        text = "".join(traceback.format_exception(type(error), error, _user_frames(error)))
        return Outcome(
            rank,
            "error",
            error=_picklable(error),
            error_text=f"{type(error).__name__}: {error}",
            remote_traceback=text,
        )


def _call(rank: int, world_size: int, task: Task, stores: PoolStore) -> Any:
    """Form the group (or hand out the rendezvous variables) and run the task's function."""
    import torch

    from ddpctx.session.context import distributed
    from ddpctx.session.formation import form_group
    from ddpctx.session.group import init_kwargs, loopback_gloo
    from ddpctx.utils.env import resolve_timeout

    timeout = resolve_timeout(task.timeout, os.environ)
    store = stores.for_task(task.number, timeout)
    if not task.init:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=_agreed_port(store, rank))
        return task.fn(*task.args, **task.kwargs)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    with loopback_gloo():
        form_group(store, rank=rank, world_size=world_size, **init_kwargs(backend, device, timeout))
    with distributed(seed=task.seed, timeout=task.timeout):
        return task.fn(*task.args, **task.kwargs)


def _agreed_port(store: Any, rank: int) -> str:
    """A free loopback port, picked by rank 0 and read by the others from the task's store."""
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            store.set("ddpctx/master_port", str(probe.getsockname()[1]))
    return bytes(store.get("ddpctx/master_port")).decode()


#: The ddpctx package (not this subpackage), as a folder: a user's ddpctx_extras/ is not in it.
_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep


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


def _picklable(error: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return None
    error.__traceback__ = None  # tracebacks never pickle; the text travels separately
    return error
