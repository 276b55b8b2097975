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
  A :class:`~ddpctx.launching.pool.RankPool` keeps its workers for many tasks; each task gets a
  fresh process group. If CUDA is already initialised in the caller,
  forking is unsafe and :func:`launch` refuses with an explanation. What
  happens inside a worker is :mod:`ddpctx.launching.worker`.
- **Rendezvous** goes through one ``TCPStore`` per pool, served by rank 0 on
  a socket the caller bound to ``127.0.0.1`` before forking, with a fresh key
  prefix per task (:mod:`ddpctx.launching.poolstore`; a ``FileStore`` polls and
  made every test's group formation about 10 ms slower). gloo's own transport
  socket is pinned to the loopback interface.
- **Fail-fast**: the first rank to fail ends the task; the other ranks get a
  short grace period to report follow-on errors, then they are killed and the
  pool is marked spoiled (a new one is started next time). The error names
  the rank and carries the original exception and its traceback.
- **Hangs**: past ``timeout`` every rank dumps its Python stack (faulthandler
  on SIGUSR1, which works even inside a blocked C++ collective), then all are
  killed. The error carries every rank's stack.
- **Clean-up**: each worker leads a process group of its own. Stopping a
  rank sends it SIGTERM (its ``finally`` blocks run), then SIGKILL to its
  whole group, so the processes it started go too. Workers die with their
  parent (``PR_SET_PDEATHSIG`` on Linux), and every exit path -- Ctrl-C, and
  SIGTERM or SIGHUP to the caller of :func:`launch` -- stops what is still
  alive and removes the ranks' temporary folder.
- **Each task in the caller's world**: a task carries the caller's
  environment and working directory, and a warm worker puts its own back
  afterwards (:mod:`ddpctx.launching.taskstate`).

Example:
    >>> def rank_and_size(offset):
    ...     import ddpctx
    ...     ctx = ddpctx.current()
    ...     return ctx.rank + offset, ctx.world_size
    >>> launch(rank_and_size, 10, world_size=2)
    [(10, 2), (11, 2)]
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ddpctx.launching.failures import RankError, RankTimeoutError, RemoteTraceback
from ddpctx.launching.pool import RankPool
from ddpctx.launching.worker import Task
from ddpctx.utils.env import check_timeout

__all__ = ["RankError", "RankTimeoutError", "launch"]


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
    if timeout is not None:
        check_timeout(timeout, f"timeout={timeout!r}")
    with _exit_on_hangup():
        pool = RankPool(world_size, first=Task(fn, args, kwargs, seed, timeout))
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


@contextlib.contextmanager
def _exit_on_hangup() -> Iterator[None]:
    """While ranks run, SIGTERM and SIGHUP to this process become ``SystemExit(128 + n)``.

    Their default action ends the process at once, leaving the ranks to die by
    ``PR_SET_PDEATHSIG`` and their temporary folder behind; as an exception,
    they unwind through :meth:`~ddpctx.launching.pool.RankPool.close`. Only
    from the main thread, and only where nobody installed a handler of their own.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        signum: signal.getsignal(signum)
        for signum in (signal.SIGTERM, signal.SIGHUP)
        if signal.getsignal(signum) is signal.SIG_DFL
    }

    def leave(signum: int, frame: object) -> None:
        for number in previous:
            signal.signal(number, signal.SIG_DFL)  # a second signal ends the process at once
        raise SystemExit(128 + signum)

    for signum in previous:
        signal.signal(signum, leave)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


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
